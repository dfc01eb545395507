"""The output's model card (README.md): the source card, minus what described the quantization, plus how the
dense weights were made.

A model card is a Markdown body under a YAML "front matter" block; the Hub reads the YAML (base_model, tags,
license...) and renders the body. The card written for the output keeps the source card's YAML fields and its
body, with these changes:

- ``base_model`` names the source repo when SOURCE is a Hub repo id (the Hub's model tree then shows the dense
  model under the quantized one); for a local folder the source card's ``base_model``, if any, is kept.
- ``base_model_relation`` is dropped: it described how the source relates to *its* base ("quantized"), and the
  Hub infers ours.
- Tags that say the weights are quantized (``bitsandbytes``, ``4-bit``, ``bnb``, ``quantized``...) are dropped:
  any format's (each source format names its own, ``formats/base.py``).
- Fields that describe the quantization (``quantization_config``, ``quantized_by``, ``bnb_4bit_*``,
  ``load_in_4bit``...) are dropped, likewise.
- A section "How these weights were made" goes before the source card's body.

A malformed source card never stops a conversion: ``model_card`` returns the card it could make and, in
``warning``, one line saying what it dropped (front matter that is not YAML, or a card that is not text at
all). Its caller prints that line; the card is still written.
"""

from __future__ import annotations

import re
import shlex
from typing import NamedTuple

from ..dtypes import OUTPUT_DTYPES
from ..formats.base import all_formats
from ..hub.errors import first_line as error_line
from ..hub.names import looks_like_repo_id
from ..paths import as_utf8

# Tags that describe quantized weights, whatever the format (each format adds its own: formats/base.py, card_tags);
# compared lowercased. Tags about the model itself (unsloth, llama, text-generation, conversational...) are kept.
QUANTIZATION_TAGS = frozenset({"quantized", "quantization", "quantised"})
# YAML fields that describe the quantization, whatever the format (each format adds its own: card_fields), matched on
# the lowercased key: quantization_config, quantized_by, quant_method, bits.
QUANTIZATION_FIELD = r"quanti[sz]|^quant_|^bits$"
# Fields about the source's relation to its own base model, wrong once base_model names the source itself.
DROPPED_FIELDS = frozenset({"base_model_relation"})

DTYPE_NAMES = {dtype.short: dtype.name for dtype in OUTPUT_DTYPES.values()}  # bf16 -> bfloat16, ...
DTYPE_FLAGS = {name: flag for flag, name in DTYPE_NAMES.items()}

HUB_URL = "https://huggingface.co"
CARD = "source model card (README.md)"  # how warnings name the file
KEPT_TEXT = "; kept its text, dropped its metadata"


class Card(NamedTuple):
    text: str
    """The whole README.md: YAML front matter and Markdown body."""
    warning: str | None
    """One line saying what of the source card had to be dropped, or None."""


def card_for_plan(plan, *, base: str, adapter: str | None, revision: str | None, title: str | None) -> Card:
    """The card of a conversion of ``plan`` (a ``plan.Plan``): ``base`` the checkpoint as the user named it (SOURCE, or
    the base an adapter SOURCE names), ``adapter`` as named, ``revision`` the base's as given, ``title`` the output's
    name. What a conversion writes, and what verify gives llama.cpp's converter again for a GGUF's metadata."""
    from pathlib import Path

    from .. import __version__
    from ..hub.names import commit_of

    text = plan.card.read_bytes().decode("utf-8", errors="replace") if plan.card is not None else None
    merged = plan.merged
    return model_card(
        text,
        source_repo=base if looks_like_repo_id(base) and not Path(base).exists() else None,
        dtype=plan.dtype.short,
        version=__version__,
        quant_format=", ".join(plan.source_formats),
        adapter=adapter,
        revision=revision,
        commit=commit_of(plan.folder),
        untied=merged.untied if merged else None,
        vocabulary=merged.rows if merged else None,
        tokenizer=bool(merged and merged.files),
        title=title,
        source_name=base,
        has_config=plan.config is not None,
    )


def model_card(
    source_card_text: str | None,
    *,
    source_repo: str | None,
    dtype: str,
    version: str,
    quant_format: str,
    adapter: str | None = None,
    revision: str | None = None,
    commit: str | None = None,
    untied: str | None = None,
    vocabulary: int | None = None,
    tokenizer: bool = False,
    title: str | None = None,
    source_name: str | None = None,
    has_config: bool = True,
) -> Card:
    """The model card (README.md) for a converted checkpoint.

    ``source_card_text`` is the source's README.md (None when it has none); ``source_repo`` the Hub repo id of
    SOURCE, None for a local folder; ``dtype`` the output dtype, resolved (``bf16``/``fp16``/``fp32``, not
    ``auto``); ``version`` the nf4convert version; ``quant_format`` the source format (``"bnb-4bit nf4"``,
    ``"bnb-4bit fp4"``, ``"bnb-8bit"``, or several joined by ", "); ``adapter`` the adapter merged into the
    weights (a repo id or a folder), if any; ``revision`` the source repo's revision as given (None: its default
    branch) and ``commit`` the commit it resolved to, when known; ``untied`` why the tied base's head was written
    apart from its input embeddings, if it was; ``vocabulary`` the token count the adapter resized the
    model to, if it did, and ``tokenizer`` whether the tokenizer files came from the adapter; ``title`` the output's
    model name (the card's heading); ``source_name`` the source as the user named it (the command that made the
    weights shows it where it is no Hub repo); ``has_config`` False for an output without config.json (its source had
    none). Never raises on a
    malformed card: see the module docstring.

    Example:
        >>> card = model_card(readme, source_repo="unsloth/Llama-3.2-1B-Instruct-bnb-4bit", dtype="bf16",
        ...                   version="0.1.0", quant_format="bnb-4bit nf4")
        >>> (output / "README.md").write_text(card.text, encoding="utf-8")
        >>> if card.warning: print(f"Warning: {card.warning}")
    """
    output_name, title = title, as_utf8(title) if title is not None else None
    fields, body, warning = _split(source_card_text)
    original_base = fields.get("base_model")
    front_matter, yaml_warning = _front_matter(_dense_fields(fields, source_repo=source_repo))
    body = body.strip("\r\n") if body.strip() else ""
    section = _how_made(
        source_repo=source_repo,
        original_base=original_base,
        dtype=dtype,
        version=version,
        quant_format=quant_format,
        adapter=adapter,
        source_body=bool(body),
        revision=revision,
        commit=commit,
        untied=untied,
        vocabulary=vocabulary,
        tokenizer=tokenizer,
        source_name=source_name,
        has_config=has_config,
        output_name=output_name,
    )
    heading = [f"# {' '.join(title.split())}"] if title and title.strip() else []
    parts = [front_matter, *heading, section] + ([body] if body else [])
    return Card("\n\n".join(parts) + "\n", warning or yaml_warning)


def _split(text: str | None) -> tuple[dict, str, str | None]:
    """(YAML fields, Markdown body, warning) of a card; what cannot be read is dropped and named in the warning."""
    from huggingface_hub.repocard import REGEX_YAML_BLOCK  # the Hub server's own front-matter rule

    if text is None or not text.strip():
        return {}, "", None
    text = text.encode("utf-8", "replace").decode("utf-8")  # lone surrogates (from surrogateescape) cannot be written
    if "\x00" in text or sum(not c.isprintable() and c not in "\t\r\n" for c in text[:4096]) > 32:
        return {}, "", f"{CARD} is not text; wrote a new card without it"
    match = REGEX_YAML_BLOCK.search(text)
    if match is None:
        return {}, text, None
    body = text[match.end() :]
    try:
        import yaml

        fields = yaml.safe_load(match.group(2))
    except Exception as error:  # noqa: BLE001  (yaml.YAMLError, or a ValueError for a date like 2024-13-45)
        first_line = text[: match.start(2)].count("\n") + 1  # the YAML block's line numbers count from 1 in the file
        return {}, body, f"{CARD}: front matter is not valid YAML ({_yaml_problem(error, first_line)}){KEPT_TEXT}"
    if fields is None:
        return {}, body, None
    if not isinstance(fields, dict):
        return {}, body, f"{CARD}: front matter is a {type(fields).__name__}, not a mapping{KEPT_TEXT}"
    return {str(key): value for key, value in fields.items()}, body, None


def _yaml_problem(error: Exception, first_line: int) -> str:
    problem = getattr(error, "problem", None) or error_line(error)
    mark = getattr(error, "problem_mark", None)
    return f"{problem}, line {first_line + mark.line}" if mark is not None else problem


def _dense_fields(fields: dict, *, source_repo: str | None) -> dict:
    """The source card's fields without the quantization's, with base_model and library_name set."""
    dense = {}
    if source_repo is not None and "base_model" not in fields:
        dense["base_model"] = source_repo
    dropped = re.compile(
        "|".join([QUANTIZATION_FIELD, *(f.card_fields for f in all_formats().values() if f.card_fields)])
    )
    for key, value in fields.items():
        if dropped.search(key.lower()) or key in DROPPED_FIELDS:
            continue
        if key == "base_model" and source_repo is not None:
            value = source_repo
        if key == "tags":
            value = _dense_tags(value)
            if value == []:
                continue
        dense[key] = value
    dense.setdefault("library_name", "transformers")  # the output is a plain transformers checkpoint
    return dense


def _dense_tags(tags):
    if isinstance(tags, str):
        tags = [tags]
    if not isinstance(tags, list):
        return tags
    dropped = QUANTIZATION_TAGS.union(*(f.card_tags for f in all_formats().values()))
    return [tag for tag in tags if not (isinstance(tag, str) and tag.strip().lower() in dropped)]


def _front_matter(fields: dict) -> tuple[str, str | None]:
    """The YAML block, written the Hub's way, and one that huggingface_hub's ModelCard reads back.

    Written through CardData (huggingface_hub's YAML style, the fields' order kept), not its subclass
    ModelCardData, which re-parses ``model-index`` into eval results and back (reordering or dropping the
    source's entries): every field goes back as it came. But ModelCard, which tools load cards with, refuses a
    ``model-index`` or ``eval_results`` it cannot parse; those fields are then dropped, and if the card is still
    unreadable, every field but base_model and library_name."""
    from huggingface_hub import CardData, ModelCard

    readable = {key: value for key, value in fields.items() if key not in ("model-index", "eval_results")}
    minimal = {key: fields[key] for key in ("base_model", "library_name") if isinstance(fields.get(key), str)}
    attempts = [
        (fields, None),
        (readable, "its model-index or eval_results, which huggingface_hub cannot read, dropped"),
        (minimal, "its metadata could not be written back readably and was dropped"),
    ]
    for attempt, note in attempts:
        data = CardData()
        for key, value in attempt.items():
            data[key] = value  # item assignment: a field named like a CardData argument stays a field
        try:
            front_matter = f"---\n{data.to_yaml(original_order=list(attempt))}\n---"
            ModelCard(front_matter)  # raises where a tool loading the card would fail
        except Exception:  # noqa: BLE001  (any value yaml or ModelCard refuses: try with fewer fields)
            continue
        return front_matter, note and f"{CARD}: {note}"
    return "---\nlibrary_name: transformers\n---", f"{CARD}: its metadata was dropped"


def _how_made(
    *,
    source_repo,
    original_base,
    dtype,
    version,
    quant_format,
    adapter,
    source_body,
    revision,
    commit,
    untied=None,
    vocabulary=None,
    tokenizer=False,
    source_name=None,
    has_config=True,
    output_name=None,
) -> str:
    dtype_flag = DTYPE_FLAGS.get(dtype, dtype)
    dtype_text = f"{dtype_flag} ({DTYPE_NAMES[dtype_flag]})" if dtype_flag in DTYPE_NAMES else dtype
    formats = [part.strip().partition(" ") for part in quant_format.split(",") if part.strip()]  # (kind, _, detail)
    kinds = {kind for kind, _, _ in formats}
    titles = {name: source_format.title for name, source_format in all_formats().items()}
    format_text = (
        " and ".join(" ".join(filter(None, [titles.get(kind, kind), detail.upper()])) for kind, _, detail in formats)
        or "quantized"
    )

    if source_repo is not None:
        source_text = f"[{source_repo}]({HUB_URL}/{source_repo}), a {format_text} checkpoint"
        at = ([f"revision `{revision}`"] if revision else []) + (
            [f"commit `{commit}`"] if commit and commit != revision else []
        )
        if at:
            source_text += f" ({', '.join(at)})"
    else:
        source_text = f"a local {format_text} checkpoint"
    bases = original_base if isinstance(original_base, list) else [original_base]
    bases = [base for base in bases if isinstance(base, str) and base and base != source_repo]
    if bases:
        source_text += " quantized from " + ", ".join(_link(base) for base in bases)

    lines = [
        "## How these weights were made",
        "",
        f"These are dense {dtype_text} weights, dequantized from {source_text}, by nf4convert {version}.",
        "",
        " ".join(_exactness(kinds, dtype_flag)) + " Dequantizing does not bring back the precision lost to "
        f"quantization. The other tensors were cast to {dtype_flag}"
        + (
            ", and `config.json` no longer has a `quantization_config`."
            if has_config
            else ". There is no `config.json`: the source had none, so transformers cannot load these weights as a "
            "model by themselves."
        ),
    ]
    command = [
        "nf4convert",
        source_repo or (_local(source_name) if source_name else "SOURCE"),
        *(["--revision", revision] if revision else []),
        "--dtype",
        dtype_flag,
        *([] if has_config else ["--allow-no-config"]),
    ]
    if adapter:
        adapter_repo = looks_like_repo_id(adapter)
        name = adapter if adapter_repo else adapter.rstrip("/\\").replace("\\", "/").rsplit("/", 1)[-1]
        named = _link(adapter) if adapter_repo else f"`{as_utf8(name)}` (a local folder)"
        lines += ["", f"The adapter {named} was then merged into the dequantized weights."]
        if untied:
            # the one departure from peft's own merge of the tied base, which keeps the tie and is not the trained model
            lines[-1] += (
                f" The base ties its output head to its input embeddings; {untied}, so the model that was trained "
                "used two different tensors: the head was untied (`tie_word_embeddings: false`, `lm_head.weight` "
                "written out), each tensor what the trained adapter model used."
            )
        if vocabulary:
            lines[-1] += (
                f" The adapter was trained with the vocabulary resized to {vocabulary} tokens: the embeddings "
                f"and head have its rows, `vocab_size` is {vocabulary}, and "
                + (
                    "the tokenizer files are the adapter's, in place of the base's."
                    if tokenizer
                    else "the adapter folder held no tokenizer files: the base's were kept."
                )
            )
        command += ["--adapter", adapter if adapter_repo else _local(adapter)]
    if output_name and output_name.strip() and not output_name.lower().endswith(".gguf"):
        command += ["-o", _shell_word(output_name)]  # a GGUF's card is its dense weights': no -o names them
    lines += ["", "Made with:", "", "```sh", " ".join(command), "```"]
    if source_body:
        lines += [
            "",
            "The text below is the source model's card, kept as it was: where it says the weights are "
            "quantized, it describes the source, not these weights.",
        ]
    return "\n".join(lines)


def _local(folder: str) -> str:
    """A local folder in the card's command: as the user gave it, but an absolute path by its own name alone (the
    card is published; the path above says who made it where, and means nothing elsewhere)."""
    from pathlib import Path

    path = Path(folder)
    return _shell_word(path.name if path.is_absolute() else folder.rstrip("/") or folder)


def _shell_word(word: str) -> str:
    """``word`` quoted for a POSIX shell; one holding bytes that are not UTF-8 in bash's ``$'...'``, each such byte as
    ``\\xNN`` (the card is UTF-8 text, the command must still name the same path)."""
    if as_utf8(word) == word:
        return shlex.quote(word)
    escaped = "".join(
        f"\\x{ord(char) - 0xDC00:02x}" if 0xDC80 <= ord(char) <= 0xDCFF else "\\" + char if char in "\\'" else char
        for char in word
    )
    return f"$'{escaped}'"


def _exactness(kinds: set[str], dtype_flag: str) -> list[str]:
    """What the dequantized weights are bit for bit, in a sentence per source format named (``formats/base.py``:
    exactness), in the formats' order; where none is named, the first registered format's."""
    registered = all_formats()
    named = [source_format for name, source_format in registered.items() if name in kinds]
    named = named or list(registered.values())[:1]
    return [source_format.exactness(dtype_flag, len(named) > 1) for source_format in named]


def _link(repo_id: str) -> str:
    return f"[{repo_id}]({HUB_URL}/{repo_id})" if looks_like_repo_id(repo_id) else f"`{repo_id}`"
