"""Adapters on tied and untied bases: the merged output is the model that was trained. Every output tensor equals
peft's merge_and_unload on the dense base untied after loading (the head a copy of the tied parameter as loaded)
bit for bit, the loaded output's logits are the unmerged adapter model's up to the merge's rounding, the head is
untied exactly where the adapter makes it differ from the input embeddings, and verify --adapter agrees."""

from __future__ import annotations

import json
import math
import warnings

import pytest
import torch
from click.testing import CliRunner

from nf4convert.cli.commands import main

from fixtures.checkpoints import build
from fixtures.weights import bits

pytest.importorskip("peft")
pytest.importorskip("bitsandbytes")
warnings.filterwarnings("ignore", module="peft")

# kind -> (LoraConfig arguments, whether a tied base's output is untied)
KINDS = {
    "modules_to_save-head": (dict(r=2, lora_alpha=3, target_modules=["v_proj"], modules_to_save=["lm_head"]), True),
    "modules_to_save-embeddings": (
        dict(r=2, lora_alpha=3, target_modules=["v_proj"], modules_to_save=["embed_tokens"]),
        True,
    ),
    # peft saves the embeddings' base_layer.weight too; loaded into the tied parameter, the trained head had it
    "lora-embeddings": (dict(r=4, lora_alpha=8, target_modules=["embed_tokens", "o_proj"]), True),
    # a list: peft ties the head's token adapter to the embeddings' (same rows): the output stays tied
    "tokens": (dict(r=2, lora_alpha=3, target_modules=["v_proj"], trainable_token_indices=[1, 5, 9]), False),
    "tokens-head-apart": (
        dict(
            r=2,
            lora_alpha=3,
            target_modules=["v_proj"],
            trainable_token_indices={"embed_tokens": [1, 2], "lm_head": [3, 7]},
        ),
        True,
    ),
    "attention": (dict(r=2, lora_alpha=3, target_modules=["q_proj", "v_proj"]), False),
}
BASES = {"tied": ("qwen2-tied-fp4", 2), "untied": ("llama-nf4-dq", 3)}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# the conversion's --device, and where the reference merges and the logits are computed: the same device type
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def run(*args, code=0):
    result = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
    assert result.exit_code == code, result.output
    return result.output


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    """base -> dtype -> (4-bit source, its dense conversion), built when first asked."""
    made = {}

    def get(base, dtype):
        if (base, dtype) not in made:
            root = tmp_path_factory.mktemp(f"{base}-{dtype}")
            variant, seed = BASES[base]
            source = made.get(base) or build(root / variant, variant, seed=seed)
            made[base] = source
            run(source, "-o", root / "dense", "-q", "--device", "cpu", "--dtype", dtype)
            made[base, dtype] = source, root / "dense"
        return made[base, dtype]

    return get


def _load(folder, **kwargs):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, **kwargs).eval()


def make_adapter(dense, folder, kind, seed):
    """peft's adapter of ``kind`` for the model in ``dense``, every saved value drawn at random (seeded)."""
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_file, save_file

    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        get_peft_model(_load(dense), LoraConfig(**KINDS[kind][0])).save_pretrained(folder)
    path = folder / "adapter_model.safetensors"
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for key, saved in load_file(path).items():
        noise = torch.randn(saved.shape, generator=generator)
        value = 0.3 * noise / math.sqrt(saved.shape[-1]) if ".lora_" in key else saved.float() + 0.05 * noise
        tensors[key] = value.to(torch.bfloat16 if seed % 2 else torch.float32).contiguous()
    save_file(tensors, path, metadata={"format": "pt"})
    return folder


def _untie_after_loading(peft_model):
    """The head given its own copy of the tied parameter, as loaded (with the adapter's saved weights in it)."""
    modules = dict(peft_model.named_modules(remove_duplicate=False))
    embedding = {
        id(m._parameters["weight"]) for n, m in modules.items() if "embed_tokens" in n and "weight" in m._parameters
    }
    for name, module in modules.items():
        held = module._parameters.get("weight")
        if "lm_head" in name and held is not None and id(held) in embedding:
            module.weight = torch.nn.Parameter(held.detach().clone(), requires_grad=False)


def reference(dense, adapter, device="cpu", base=_load):
    """peft's merge_and_unload on the dense base (as ``base`` loads it) untied after loading, and the unmerged
    (trained) adapter model, on ``device``."""
    from peft import PeftModel

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trained = PeftModel.from_pretrained(base(dense).to(device), adapter).eval()
        model = PeftModel.from_pretrained(base(dense).to(device), adapter)
        _untie_after_loading(model)
        merged = model.merge_and_unload().eval()
    return merged, trained


def assert_tied_where_trained_so(got: dict, expected: dict, config: dict, base: str, untied: bool) -> None:
    """On a tied base, the output stays tied (no head tensor; the reference's head, then dropped from ``expected``, is
    the embeddings) unless the adapter makes the head differ (``untied``: a head of its own, and the config says so);
    either way the output has the reference's tensors."""
    embedding = "model.embed_tokens.weight"
    if base == "tied" and not untied:
        assert "lm_head.weight" not in got and config["tie_word_embeddings"] is True
        assert torch.equal(bits(expected.pop("lm_head.weight")), bits(expected[embedding]))
    elif base == "tied":
        assert config["tie_word_embeddings"] is False and "lm_head.weight" in got
        assert not torch.equal(bits(got["lm_head.weight"]), bits(got[embedding]))
    assert sorted(got) == sorted(expected)


def assert_computes_the_trained_model(out, merged, trained, ids, device):
    """Loaded by transformers, the output gives the reference merge's logits bit for bit, and the trained (unmerged)
    adapter model's up to the merge's rounding."""
    ids = ids.to(device)
    with torch.no_grad():
        ours = _load(out).to(device)(input_ids=ids).logits
        assert torch.equal(ours, merged(input_ids=ids).logits)
        wanted = trained(input_ids=ids).logits
    assert (ours.float() - wanted.float()).abs().max() <= 0.02 * wanted.float().abs().max()


def _output_tensors(folder):
    from safetensors.torch import load_file

    tensors = {}
    for shard in folder.glob("*.safetensors"):
        tensors.update(load_file(shard))
    return tensors


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("base", list(BASES))
@pytest.mark.parametrize("kind", list(KINDS))
def test_merge_is_the_trained_model(kind, base, dtype, device, bases, tmp_path):
    source, dense = bases(base, dtype)
    seed = 100 + list(KINDS).index(kind) * 4 + list(BASES).index(base) * 2 + list(DTYPES).index(dtype)
    adapter = make_adapter(dense, tmp_path / "adapter", kind, seed)
    out = tmp_path / "merged"
    run(source, "--adapter", adapter, "-o", out, "--device", device, "--dtype", dtype, "--max-shard-size", "300KB")
    merged, trained = reference(dense, adapter, device)
    expected = {name: tensor.cpu().contiguous() for name, tensor in merged.state_dict().items()}
    got = _output_tensors(out)
    config = json.loads((out / "config.json").read_text())
    assert_tied_where_trained_so(got, expected, config, base, untied=KINDS[kind][1])
    dense_tensors = _output_tensors(dense)
    changed = 0
    for name, tensor in got.items():
        assert tensor.dtype == DTYPES[dtype] and torch.equal(bits(tensor), bits(expected[name])), name
        changed += name not in dense_tensors or not torch.equal(bits(tensor), bits(dense_tensors[name]))
    assert changed >= 2
    ids = torch.randint(0, 512, (2, 9), generator=torch.Generator().manual_seed(seed))
    ids[0, :4] = torch.tensor([1, 2, 3, 7])  # the trainable tokens
    assert_computes_the_trained_model(out, merged, trained, ids, device)
    assert "OK: bit-exact" in run("verify", out, source, "--adapter", adapter, "--device", device, "-q")


def test_verify_without_the_adapter_says_the_output_looks_merged(bases, tmp_path):
    source, dense = bases("tied", "fp16")
    adapter = make_adapter(dense, tmp_path / "adapter", "lora-embeddings", seed=7)
    run(source, "--adapter", adapter, "-o", tmp_path / "merged", "--device", "cpu", "-q")
    output = run("verify", tmp_path / "merged", source, "--device", "cpu", "-q", code=1)
    assert "looks merged with an adapter" in output and "--adapter" in output, output


def test_model_card_says_why_the_head_was_untied(bases, tmp_path):
    source, dense = bases("tied", "fp16")
    adapter = make_adapter(dense, tmp_path / "adapter", "modules_to_save-embeddings", seed=8)
    run(source, "--adapter", adapter, "-o", tmp_path / "merged", "--device", "cpu", "-q")
    card = (tmp_path / "merged" / "README.md").read_text()
    assert "untied" in card and "model.embed_tokens" in card and "tie_word_embeddings" in card
    adapter = make_adapter(dense, tmp_path / "attention", "attention", seed=9)
    run(source, "--adapter", adapter, "-o", tmp_path / "kept", "--device", "cpu", "-q")
    assert "untied" not in (tmp_path / "kept" / "README.md").read_text()


@pytest.mark.parametrize("case", ["rows-out-of-range", "repeated-row", "rows-of-another-width", "no-indices"])
def test_bad_trainable_tokens_are_one_line(case, bases, tmp_path):
    from safetensors.torch import load_file, save_file

    source, dense = bases("tied", "fp16")
    adapter = make_adapter(dense, tmp_path / "adapter", "tokens", seed=11)
    config = json.loads((adapter / "adapter_config.json").read_text())
    tensors = load_file(adapter / "adapter_model.safetensors")
    key = "base_model.model.model.embed_tokens.token_adapter.trainable_tokens_delta"
    expected = {
        "rows-out-of-range": "has 512, outside the 512 rows",
        "repeated-row": "repeats a token id",
        "rows-of-another-width": "need [3, 128]",
        "no-indices": "has no trainable_token_indices",
    }[case]
    if case == "rows-out-of-range":
        config["trainable_token_indices"] = [1, 5, 512]
    elif case == "repeated-row":
        config["trainable_token_indices"] = [1, 5, 5]
    elif case == "rows-of-another-width":
        tensors[key] = torch.randn(3, 64)
    else:
        config["trainable_token_indices"] = None
    (adapter / "adapter_config.json").write_text(json.dumps(config))
    save_file(tensors, adapter / "adapter_model.safetensors")
    line = run(source, "--adapter", adapter, "-o", tmp_path / "out", "-q", code=1).strip()
    assert line.startswith("Error: ") and expected in line and "\n" not in line, line
    assert not (tmp_path / "out").exists()


# A resized vocabulary: the trainer resized the embeddings (and head) to ROWS, peft saved them in the adapter.
ROWS = 520
RESIZED = {  # kind -> (LoraConfig arguments, save_embedding_layers, whether a tied base's output is untied)
    "attention": (dict(r=2, lora_alpha=3, target_modules=["q_proj", "v_proj"]), True, False),
    "modules_to_save": (
        dict(r=2, lora_alpha=3, target_modules=["v_proj"], modules_to_save=["embed_tokens", "lm_head"]),
        False,
        True,
    ),
    "tokens": (
        dict(r=2, lora_alpha=3, target_modules=["v_proj"], trainable_token_indices=[512, 515, 519]),
        True,
        False,
    ),
}
TOKENIZER = {
    "tokenizer.json": '{"added": 8}',
    "tokenizer_config.json": '{"model_max_length": 256, "added": 8}',
    "special_tokens_map.json": "{}",
    "added_tokens.json": '{"<x>": 512}',
    "chat_template.jinja": "{{ added }}",
}


def _resized(dense):
    model = _load(dense)
    model.resize_token_embeddings(ROWS, mean_resizing=False)
    return model


def make_resized_adapter(dense, folder, kind, seed):
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_file, save_file

    torch.manual_seed(seed)
    arguments, save_embeddings, _ = RESIZED[kind]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        get_peft_model(_resized(dense), LoraConfig(**arguments)).save_pretrained(
            folder, save_embedding_layers=save_embeddings
        )
    path = folder / "adapter_model.safetensors"
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for key, saved in sorted(load_file(path).items()):
        noise = torch.randn(saved.shape, generator=generator)
        value = 0.3 * noise / math.sqrt(saved.shape[-1]) if ".lora_" in key else saved.float() + 0.05 * noise
        tensors[key] = value.to(torch.bfloat16 if seed % 2 else torch.float32).contiguous()
    save_file(tensors, path, metadata={"format": "pt"})
    for name, text in TOKENIZER.items():
        (folder / name).write_text(text)
    return folder


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("base", list(BASES))
@pytest.mark.parametrize("kind", list(RESIZED))
def test_resized_vocabulary_merges_as_trained(kind, base, dtype, device, bases, tmp_path):
    source, dense = bases(base, dtype)
    seed = 200 + list(RESIZED).index(kind) * 4 + list(BASES).index(base) * 2 + list(DTYPES).index(dtype)
    adapter = make_resized_adapter(dense, tmp_path / "adapter", kind, seed)
    out = tmp_path / "merged"
    run(source, "--adapter", adapter, "-o", out, "--device", device, "--dtype", dtype, "-q")
    merged, trained = reference(dense, adapter, device, base=_resized)
    expected = {name: tensor.cpu().contiguous() for name, tensor in merged.state_dict().items()}
    got = _output_tensors(out)
    config = json.loads((out / "config.json").read_text())
    assert config["vocab_size"] == ROWS and got["model.embed_tokens.weight"].shape[0] == ROWS
    assert_tied_where_trained_so(got, expected, config, base, untied=RESIZED[kind][2])
    for name, tensor in got.items():
        assert torch.equal(bits(tensor), bits(expected[name])), name
    for name, text in TOKENIZER.items():  # the adapter's tokenizer, in place of the base's
        assert (out / name).read_text() == text
    assert "resized to 520 tokens" in (out / "README.md").read_text()
    ids = torch.randint(0, ROWS, (2, 9), generator=torch.Generator().manual_seed(seed))
    ids[0, :3] = torch.tensor([512, 515, 519])
    assert_computes_the_trained_model(out, merged, trained, ids, device)
    assert "OK: bit-exact" in run("verify", out, source, "--adapter", adapter, "--device", device, "-q")


@pytest.mark.parametrize("case", ["fewer-rows", "other-width", "head-rows-missing"])
def test_a_vocabulary_that_does_not_fit_is_one_line(case, bases, tmp_path):
    from safetensors.torch import load_file, save_file

    source, dense = bases("untied", "bf16")
    adapter = make_resized_adapter(dense, tmp_path / "adapter", "attention", seed=31)
    tensors = load_file(adapter / "adapter_model.safetensors")
    key = "base_model.model.model.embed_tokens.weight"
    expected = {
        "fewer-rows": "has 500 rows, fewer than the 512",
        "other-width": "is [520, 64], the base's",
        "head-rows-missing": "saves no 520-row 'lm_head.weight'",
    }[case]
    if case == "fewer-rows":
        tensors[key] = tensors[key][:500].clone()
        tensors["base_model.model.lm_head.weight"] = tensors["base_model.model.lm_head.weight"][:500].clone()
    elif case == "other-width":
        tensors[key] = torch.randn(ROWS, 64)
    else:
        del tensors["base_model.model.lm_head.weight"]
    save_file(tensors, adapter / "adapter_model.safetensors")
    line = run(source, "--adapter", adapter, "-o", tmp_path / "out", "-q", code=1).strip()
    assert line.startswith("Error: ") and expected in line and "\n" not in line, line
    assert not (tmp_path / "out").exists()
