"""Which of a model's tokenizer files the converter could not read, and why, in one line naming it: asked when
llama.cpp's converter (or the tokenizer library it calls) fails on a model's files, whose own error names none
(``'list' object has no attribute 'get'``, ``failed to extract enum PyVocab``, sentencepiece's "unk is not defined").

Each file is read as its library reads it: JSON files as JSON objects (an ``added_tokens.json`` maps tokens to ids),
``tokenizer.json`` by the tokenizers library, ``tokenizer.model`` by sentencepiece.
"""

from __future__ import annotations

import json
from pathlib import Path

# JSON files a tokenizer is read from, each an object (the converter, gguf's SpecialVocab and transformers read them)
JSON_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "tekken.json",
    "chat_template.json",
    "generation_config.json",
)
_READ_LIMIT = 1 << 30  # a tokenizer file past this is no tokenizer file


def _first_line(error: BaseException) -> str:
    text = " ".join(str(error).split()) or type(error).__name__
    return text if len(text) <= 200 else text[:197] + "..."


def _json_problem(path: Path) -> str | None:
    try:
        text = path.read_bytes()[:_READ_LIMIT].decode("utf-8")
        value = json.loads(text)
    except UnicodeDecodeError:
        return "not UTF-8"
    except ValueError as error:
        return f"not JSON ({_first_line(error)})"
    if not isinstance(value, dict):
        return f"not a JSON object (a {type(value).__name__})"
    if path.name == "added_tokens.json" and not all(
        isinstance(token, str) and type(index) is int for token, index in value.items()
    ):
        return "not a map of tokens to ids"
    if path.name == "tokenizer.json":
        try:
            import tokenizers

            tokenizers.Tokenizer.from_str(text)
        except ImportError:
            return None
        except Exception as error:  # noqa: BLE001  (whatever the library raises for a file it cannot read)
            return f"the tokenizers library cannot read it ({_first_line(error)})"
    return None


def _sentencepiece_problem(path: Path) -> str | None:
    try:
        import sentencepiece
    except ImportError:
        return None
    processor = sentencepiece.SentencePieceProcessor()
    try:
        processor.LoadFromSerializedProto(path.read_bytes()[:_READ_LIMIT])
        if processor.vocab_size() == 0:
            return "sentencepiece reads no vocabulary in it"
    except Exception as error:  # noqa: BLE001  (sentencepiece raises RuntimeError, OSError, ...)
        return f"sentencepiece cannot read it ({_first_line(error)})"
    return None


def broken_file(folder: Path) -> str | None:
    """``<file>: <why>`` for the first tokenizer file of ``folder`` that its library cannot read, or None where each
    reads (or none is there)."""
    for name in ("tokenizer.model", *JSON_FILES):
        path = folder / name
        if not path.is_file():
            continue
        try:
            problem = _sentencepiece_problem(path) if name == "tokenizer.model" else _json_problem(path)
        except OSError as error:
            problem = f"cannot be read ({error.strerror or error})"
        if problem is not None:
            return f"{path}: {problem}"
    return None
