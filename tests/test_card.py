"""The output's model card: real-looking source cards in, a card the Hub's own parser reads out."""

from __future__ import annotations

import random

import pytest
import yaml
from huggingface_hub import ModelCard
from huggingface_hub.repocard import REGEX_YAML_BLOCK

from nf4convert.sinks.card import model_card

CARD = "source model card (README.md)"

UNSLOTH_BODY = """
# Finetune Llama 3.2, Gemma 2, Mistral 2-5x faster with 70% less memory via Unsloth!

We have a free Google Colab Tesla T4 notebook for Llama 3.2 (3B) here: https://colab.research.google.com/drive/1T5-zKWM

| Unsloth supports | Free Notebooks | Performance | Memory use |
|---|---|---|---|
| **Llama-3.2 (3B)** | [▶️ Start on Colab](https://colab.research.google.com/drive/1T5) | 2.4x faster | 58% less |

- This [conversational notebook](https://colab.research.google.com/drive/1Aau3lgPzeZKQ) is useful for ShareGPT ChatML.
- This is the 4bit bnb version of `meta-llama/Llama-3.2-1B-Instruct`: load it with `load_in_4bit=True`.

## Special Thanks
A huge thank you to the Meta and Llama team for creating and releasing these models.
"""
UNSLOTH_CARD = (
    """---
base_model: meta-llama/Llama-3.2-1B-Instruct
language:
- en
library_name: transformers
license: llama3.2
tags:
- llama-3
- llama
- meta
- facebook
- unsloth
- transformers
- bitsandbytes
- 4-bit
---
"""
    + UNSLOTH_BODY
)

# A card with everything a quantizer writes: quantization fields, relation, odd-case tags, a model-index.
QUANTIZER_CARD = """---
base_model:
- mistralai/Mistral-7B-v0.1
base_model_relation: quantized
datasets:
- HuggingFaceH4/ultrachat_200k
inference: false
license: apache-2.0
model-index:
- name: zephyr-qlora
  results:
  - task: {type: text-generation}
    dataset: {name: MT-Bench, type: mt-bench}
    metrics:
    - {type: score, value: 7.1, name: MT-Bench score, verified: false}
model_creator: Example Labs
pipeline_tag: text-generation
quantized_by: SomeQuantizer
quantization_config:
  bnb_4bit_compute_dtype: bfloat16
  bnb_4bit_quant_type: nf4
  load_in_4bit: true
load_in_8bit: true
bnb_8bit_threshold: 6.0
tags:
- QLoRA
- Quantized
- BNB
- 8-BIT
- mistral
- trl
---
# Zephyr QLoRA (8-bit)

Prompt template: `<|user|>\\n{prompt}</s>\\n<|assistant|>`
"""


def parse(text: str) -> tuple[dict, str]:
    """What the Hub reads: the front matter (by the Hub server's own rule) and the body."""
    card = ModelCard(text)  # raises on front matter that is not a mapping
    match = REGEX_YAML_BLOCK.search(text)
    assert match is not None, "no front matter"
    return yaml.safe_load(match.group(2)) or {}, card.text


def test_unsloth_card_from_the_hub():
    card = model_card(
        UNSLOTH_CARD,
        source_repo="unsloth/Llama-3.2-1B-Instruct-bnb-4bit",
        dtype="bf16",
        version="0.1.0",
        quant_format="bnb-4bit nf4",
        adapter=None,
    )
    assert card.warning is None
    fields, body = parse(card.text)
    assert fields == {
        "base_model": "unsloth/Llama-3.2-1B-Instruct-bnb-4bit",
        "language": ["en"],
        "library_name": "transformers",
        "license": "llama3.2",
        "tags": ["llama-3", "llama", "meta", "facebook", "unsloth", "transformers"],
    }
    assert list(fields) == ["base_model", "language", "library_name", "license", "tags"]  # the source's order
    assert UNSLOTH_BODY.strip() in body  # the source's text, untouched
    section = body[: body.index(UNSLOTH_BODY.strip())]
    assert section.lstrip().startswith("## How these weights were made")
    source = "unsloth/Llama-3.2-1B-Instruct-bnb-4bit"
    for text in [
        "dense bf16 (bfloat16) weights",
        f"[{source}](https://huggingface.co/{source})",
        "bitsandbytes 4-bit NF4",
        "quantized from [meta-llama/Llama-3.2-1B-Instruct]",
        "nf4convert 0.1.0",
        "bit for bit",
        f"nf4convert {source} --dtype bf16\n",
    ]:
        assert text in section, text
    assert "adapter" not in section


def test_quantizer_card_from_a_local_folder_with_an_adapter():
    card = model_card(
        QUANTIZER_CARD,
        source_repo=None,
        dtype="fp16",
        version="0.2.0",
        quant_format="bnb-8bit",
        adapter="/home/alice/runs/zephyr-lora/",
    )
    assert card.warning is None
    fields, body = parse(card.text)
    source_fields = yaml.safe_load(REGEX_YAML_BLOCK.search(QUANTIZER_CARD).group(2))
    dropped = {"base_model_relation", "quantized_by", "quantization_config", "load_in_8bit", "bnb_8bit_threshold"}
    kept = {key: value for key, value in source_fields.items() if key not in dropped | {"tags"}}
    assert fields == {**kept, "tags": ["QLoRA", "mistral", "trl"], "library_name": "transformers"}
    assert fields["model-index"] == source_fields["model-index"]  # verbatim, not re-parsed into eval results
    assert fields["base_model"] == ["mistralai/Mistral-7B-v0.1"]  # a local source keeps the card's base_model
    assert "Prompt template: `<|user|>\\n{prompt}</s>\\n<|assistant|>`" in body
    assert "dense fp16 (float16) weights, dequantized from a local bitsandbytes 8-bit (LLM.int8) checkpoint" in body
    assert "quantized from [mistralai/Mistral-7B-v0.1](https://huggingface.co/mistralai/Mistral-7B-v0.1)" in body
    assert "The adapter `zephyr-lora` (a local folder) was then merged" in body
    assert "nf4convert SOURCE --dtype fp16 --adapter zephyr-lora\n" in body  # the folder by its name alone
    assert "/home/alice" not in card.text  # a local path says nothing about the user's machine


def test_no_source_card_gives_a_small_card_with_an_adapter_from_the_hub():
    card = model_card(
        None,
        source_repo="org/model-bnb-4bit",
        dtype="fp32",
        version="0.1.0",
        quant_format="bnb-4bit fp4",
        adapter="org/lora-adapter",
    )
    assert card.warning is None
    fields, body = parse(card.text)
    assert fields == {"base_model": "org/model-bnb-4bit", "library_name": "transformers"}
    assert body.lstrip().startswith("## How these weights were made")
    assert "bitsandbytes 4-bit FP4" in body and "dense fp32 (float32) weights" in body
    assert "The adapter [org/lora-adapter](https://huggingface.co/org/lora-adapter) was then merged" in body
    assert "nf4convert org/model-bnb-4bit --dtype fp32 --adapter org/lora-adapter" in body
    assert "source model's card" not in body  # nothing follows


@pytest.mark.parametrize(
    "quant_format,says,never",
    [
        (
            "bnb-4bit nf4",
            ["`dequantize_4bit` computes from the quantized checkpoint with its CUDA kernels"],
            ["int8_vectorwise_dequant", "multiplies in int8"],
        ),
        (
            "bnb-8bit",
            [
                "`int8_vectorwise_dequant` (plain torch arithmetic, the same on CPU and GPU) and the cast to fp16",
                "multiplies in int8",
            ],
            ["CUDA kernels", "dequantize_4bit"],
        ),
        (
            "bnb-4bit fp4, bnb-8bit",
            [
                "a bitsandbytes 4-bit FP4 and bitsandbytes 8-bit (LLM.int8) checkpoint",
                "Every weight dequantized from 4-bit",
                "Every weight dequantized from 8-bit",
            ],
            [],
        ),
    ],
)
def test_what_the_weights_are_bit_for_bit_is_said_per_format(quant_format, says, never):
    card = model_card(None, source_repo="org/m-bnb", dtype="fp16", version="0.1.0", quant_format=quant_format)
    section = parse(card.text)[1]
    assert all(text in section for text in says), section
    assert not [text for text in never if text in section], section


def test_the_revision_and_the_commit_are_recorded():
    commit = "0123456789abcdef0123456789abcdef01234567"
    card = model_card(
        None,
        source_repo="org/m-bnb-4bit",
        dtype="bf16",
        version="0.1.0",
        quant_format="bnb-4bit nf4",
        revision="v2",
        commit=commit,
    )
    body = parse(card.text)[1]
    assert f"a bitsandbytes 4-bit NF4 checkpoint (revision `v2`, commit `{commit}`)" in body
    assert "nf4convert org/m-bnb-4bit --revision v2 --dtype bf16\n" in body
    body = parse(
        model_card(
            None,
            source_repo="org/m-bnb-4bit",
            dtype="bf16",
            version="0.1.0",
            quant_format="bnb-4bit nf4",
            commit=commit,
        ).text
    )[1]
    assert f"checkpoint (commit `{commit}`)" in body and "nf4convert org/m-bnb-4bit --dtype bf16\n" in body
    body = parse(
        model_card(
            None,
            source_repo="org/m-bnb-4bit",
            dtype="bf16",
            version="0.1.0",
            quant_format="bnb-4bit nf4",
            revision=commit,
            commit=commit,
        ).text
    )[1]
    assert f"checkpoint (revision `{commit}`)" in body  # a commit given as the revision is named once


@pytest.mark.parametrize(
    "source,warns,kept_body",
    [
        ("---\nlicense: mit\ntags: [unclosed\n---\n# Body\n", "front matter is not valid YAML", "# Body"),
        ("---\nlicense: mit\n\tbad: tab\n---\n# Body\n", "front matter is not valid YAML", "# Body"),
        ("---\ndate: 2024-13-45\n---\n# Body\n", "front matter is not valid YAML (month must be in 1..12)", "# Body"),
        ("---\n- just\n- a list\n---\n# Body\n", "front matter is a list, not a mapping", "# Body"),
        ("---\nplain words\n---\n# Body\n", "front matter is a str, not a mapping", "# Body"),
        ("---\n? [a, b]\n: complex key\n---\n# Body\n", "not valid YAML (found unhashable key, line 2)", "# Body"),
        ("# No front matter at all\n\nJust text.\n", None, "# No front matter at all\n\nJust text."),
        ("---\nlicense: mit\n", None, "---\nlicense: mit"),  # an unclosed block is body text, as on the Hub
        ("---\r\nlicense: mit\r\ntags:\r\n- 4-bit\r\n- llama\r\n---\r\n# CRLF body\r\n", None, "# CRLF body"),
        ("\x00\x01\x02GGUF binary junk\xff\xfe" * 40, "is not text", None),
        ('---\nloop: &x [*x]\nescaped: "\\ud800"\n---\n# Body \udcff (from surrogateescape)\n', None, "# Body ? (from"),
        ("", None, None),
    ],
)
def test_a_malformed_card_never_raises_and_says_what_it_dropped(source, warns, kept_body):
    card = model_card(
        source, source_repo="org/model-bnb-4bit", dtype="bf16", version="0.1.0", quant_format="bnb-4bit nf4"
    )
    fields, body = parse(card.text)
    assert fields["base_model"] == "org/model-bnb-4bit"
    if warns is None:
        assert card.warning is None
    else:
        assert warns in card.warning and "\n" not in card.warning and card.warning.startswith(CARD)
    if kept_body is not None:
        assert kept_body in body
    assert "\x00" not in card.text and "4-bit\n" not in card.text.split("## How")[0]
    card.text.encode("utf-8")  # writable as README.md, whatever came in


def test_fields_huggingface_hub_cannot_read_back_are_dropped_and_named():
    source = "---\nlicense: mit\nmodel-index: [{results: 7}]\neval_results: [1, 2]\nmodel_name: x\n1: one\n---\nBody\n"
    card = model_card(source, source_repo=None, dtype="bf16", version="0.1.0", quant_format="bnb-4bit nf4")
    fields, body = parse(card.text)
    assert card.warning == f"{CARD}: its model-index or eval_results, which huggingface_hub cannot read, dropped"
    assert fields == {"license": "mit", "model_name": "x", "1": "one", "library_name": "transformers"}
    assert body.rstrip().endswith("Body")

    source = "---\nignore_metadata_errors: true\nlicense: mit\nbase_model: a/b\n---\nBody\n"  # breaks ModelCard()
    card = model_card(source, source_repo=None, dtype="bf16", version="0.1.0", quant_format="bnb-4bit nf4")
    assert parse(card.text)[0] == {"base_model": "a/b", "library_name": "transformers"}
    assert card.warning == f"{CARD}: its metadata could not be written back readably and was dropped"


def test_random_junk_never_raises():
    """Fresh junk each draw (seeded): YAML-ish fragments, control characters, unicode, around front matter."""
    rng = random.Random(1313)
    pieces = [
        "---",
        "\n",
        "\r\n",
        ":",
        "- ",
        "[",
        "]",
        "{",
        "}",
        "&a",
        "*a",
        "!!python/object:os.system",
        "? ",
        "\t",
        "'",
        '"',
        "#",
        "base_model: ",
        "tags:",
        "- bitsandbytes",
        "model-index:",
        "é",
        "\u2028",
        "\x85",
        "\x0b",
        "\x1b[31m",
        "2024-02-30",
        "~",
        "null",
        "|",
        ">",
        "%YAML 1.1",
        "...",
        "<<: *a",
        "0x1F",
    ]
    for _ in range(300):
        source = "".join(rng.choice(pieces) for _ in range(rng.randrange(1, 40)))
        if rng.random() < 0.5:
            source = "---\n" + source + "\n---\nbody\n"
        card = model_card(source, source_repo=None, dtype="bf16", version="0.1.0", quant_format="bnb-4bit nf4")
        fields, _ = parse(card.text)
        assert isinstance(fields, dict) and fields.get("library_name") is not None, source
        assert card.warning is None or "\n" not in card.warning, source


@pytest.mark.parametrize(
    "given,shown",
    [
        ("./my-model-bnb-4bit", "./my-model-bnb-4bit"),
        ("my-model-bnb-4bit/", "my-model-bnb-4bit"),
        ("~/models/my model", "'~/models/my model'"),  # quoted as a shell takes it
        ("/home/alice/models/my-model-bnb-4bit", "my-model-bnb-4bit"),  # the published card names no one's machine
    ],
)
def test_the_card_has_a_title_and_the_command_shows_a_local_source_as_given(given, shown):
    # the card had no title, and its command read "nf4convert SOURCE" for every local source
    card = model_card(
        UNSLOTH_CARD,
        source_repo=None,
        dtype="bf16",
        version="0.1.0",
        quant_format="bnb-4bit nf4",
        title="my-model-bf16",
        source_name=given,
    )
    fields, body = parse(card.text)
    assert body.lstrip().startswith("# my-model-bf16\n\n## How these weights were made")
    assert f"```sh\nnf4convert {shown} --dtype bf16 -o my-model-bf16\n```" in body and "SOURCE" not in body
    assert "/home/alice" not in card.text


def test_a_card_without_config_says_so():
    # the card of an output written without config.json said "config.json no longer has a quantization_config"
    with_config = model_card(None, source_repo=None, dtype="bf16", version="0.1.0", quant_format="bnb-4bit nf4")
    assert "`config.json` no longer has a `quantization_config`" in with_config.text
    card = model_card(
        None,
        source_repo=None,
        dtype="bf16",
        version="0.1.0",
        quant_format="bnb-4bit nf4",
        source_name="src",
        has_config=False,
    )
    assert "quantization_config" not in card.text
    assert "There is no `config.json`: the source had none, so transformers cannot load these weights" in card.text
    assert "nf4convert src --dtype bf16 --allow-no-config\n" in card.text


@pytest.mark.parametrize(
    "title,expected",
    [
        ("Llama-3.2-1B-Instruct-bf16", "--dtype bf16 -o Llama-3.2-1B-Instruct-bf16\n"),
        ("my model", "--dtype bf16 -o 'my model'\n"),
        ("model.gguf", "--dtype bf16\n"),  # a GGUF's card describes its dense weights, which no -o names
    ],
)
def test_the_command_that_made_the_weights_names_the_output(title, expected):
    # the card's command dropped -o, so it made a folder of another name
    card = model_card(
        None, source_repo="org/m-bnb-4bit", dtype="bf16", version="0.1.0", quant_format="bnb-4bit nf4", title=title
    )
    assert f"```sh\nnf4convert org/m-bnb-4bit {expected}```" in card.text, card.text
