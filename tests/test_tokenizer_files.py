"""A GGUF output from a model whose tokenizer files are broken: whatever llama.cpp's converter or the tokenizer
libraries raise on them is one line naming the file, in the run and in --dry-run, before any weight is read; nothing
is left.
The named cases are those a hostile trial met as tracebacks; the fuzz cases are seeded (``fuzz_case(seed)`` replays
one)."""

from __future__ import annotations

import json
import random
import shutil
import traceback
from pathlib import Path

import pytest
from click.testing import CliRunner

from nf4convert.cli.commands import main

from fixtures.checkpoints import build
from fixtures.trained_tokenizers import byte_bpe_tokenizer, sentencepiece_tokenizer, with_n_ctx

pytest.importorskip("conversion")  # the "gguf" extra: llama.cpp's converter
FUZZ_CASES = 60  # per tokenizer kind


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("tokenizers")
    llama = build(root / "llama-bnb-4bit", "llama-nf4-dq", seed=4)
    sentencepiece_tokenizer(llama)
    gpt2 = build(root / "gpt2-bnb-4bit", "gpt2-conv1d-nf4-dq", seed=5)
    byte_bpe_tokenizer(gpt2)
    with_n_ctx(gpt2)
    return {"sentencepiece": llama, "bpe": gpt2}


@pytest.fixture(autouse=True)
def known_pre_tokenizer(monkeypatch):
    """A tiny trained BPE's pre-tokenizer hash is llama.cpp's for none: named GPT-2's, as tests/test_gguf.py does."""
    from conversion.base import TextModel

    monkeypatch.setattr(TextModel, "get_vocab_base_pre", lambda self, tokenizer: "gpt-2")


def _invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=True)


def _verdict(result, where: Path) -> str | None:
    """None where the command ended cleanly (exit 0, or 1 with one Error line, no traceback), else what went wrong."""
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        frames = traceback.format_exception(result.exception)[-3:]
        return f"a traceback: {''.join(frames)[-400:]}"
    if result.exit_code == 0:
        return None
    lines = result.stderr.strip().splitlines()
    if result.exit_code != 1 or len(lines) != 1 or not lines[0].startswith("Error: "):
        return f"exit {result.exit_code}, not one error line: {result.stderr[-400:]!r}"
    if "llama.cpp's converter" in lines[0] and str(where) not in lines[0]:
        return f"the converter's error names neither the file nor the model: {lines[0]}"
    return None


def _case(sources, tmp_path, kind: str) -> Path:
    source = tmp_path / f"{kind}-bnb-4bit"
    shutil.copytree(sources[kind], source)
    return source


NAMED = [  # (tokenizer kind, file, content, words of the line)
    ("sentencepiece", "tokenizer.model", b"garbage \x00\x01\x02", "sentencepiece cannot read it"),
    ("sentencepiece", "tokenizer.model", b"", "sentencepiece cannot read it"),
    ("sentencepiece", "tokenizer.json", b"[]", "not a JSON object (a list)"),
    ("sentencepiece", "added_tokens.json", b'["<extra>"]', "not a JSON object (a list)"),
    ("sentencepiece", "added_tokens.json", b'{"<extra>": "five"}', "not a map of tokens to ids"),
    ("bpe", "tokenizer.json", b"[]", "not a JSON object (a list)"),
    ("bpe", "tokenizer.json", "vocab5", "the tokenizers library cannot read it"),
    ("bpe", "tokenizer.json", "unigram", "the tokenizers library cannot read it"),
    ("bpe", "tokenizer.json", b"{", "not JSON"),
    ("bpe", "added_tokens.json", b"[1, 2]", "not a JSON object (a list)"),
    ("bpe", "tokenizer_config.json", b"[]", "not a JSON object (a list)"),
    ("bpe", "special_tokens_map.json", b"7", "not a JSON object (a int)"),
]


def _named_content(source: Path, content) -> bytes:
    if isinstance(content, bytes):
        return content
    tokenizer = json.loads((source / "tokenizer.json").read_text())
    if content == "vocab5":
        tokenizer["model"]["vocab"] = 5
    else:  # a Unigram whose scores are not numbers
        tokenizer["model"] = {"type": "Unigram", "vocab": [["a", "x"]], "unk_id": 7}
    return json.dumps(tokenizer).encode()


@pytest.mark.parametrize("kind,name,content,words", NAMED, ids=[f"{n[0]}-{n[1]}-{i}" for i, n in enumerate(NAMED)])
def test_a_broken_tokenizer_file_is_one_line_naming_it(sources, tmp_path, kind, name, content, words):
    # each was a 60-95 line traceback
    source = _case(sources, tmp_path, kind)
    (source / name).write_bytes(_named_content(source, content))
    for extra in (["--dry-run"], []):
        result = _invoke(source, "-o", tmp_path / "out.gguf", "-q", "--device", "cpu", *extra)
        assert _verdict(result, source) is None, _verdict(result, source)
        line = result.stderr.strip()
        assert result.exit_code == 1 and line.startswith(f"Error: {source / name}: {words}"), line
        assert line.endswith("llama.cpp's converter cannot read it"), line
    assert sorted(path.name for path in tmp_path.iterdir()) == [source.name]


ODD_VALUES = [None, True, 0, -1, 5, 1e308, "", "x", [], [[]], {}, {"a": None}, ["a", 1], "\x00"]


def _mutated_json(rng: random.Random, raw: bytes, log: list[str]) -> bytes:
    try:
        value = json.loads(raw)
    except ValueError:
        value = None
    choice = rng.randrange(4)
    if choice == 0 or not isinstance(value, (dict, list)):
        log.append("whole value replaced")
        return json.dumps(rng.choice(ODD_VALUES)).encode()
    node, path = value, []
    while isinstance(node, (dict, list)) and node and rng.random() < 0.7:  # a random nested place
        key = rng.choice(sorted(node)) if isinstance(node, dict) else rng.randrange(len(node))
        if not isinstance(node[key], (dict, list)) or not node[key]:
            break
        node, path = node[key], [*path, key]
    if not node:
        return json.dumps(rng.choice(ODD_VALUES)).encode()
    key = rng.choice(sorted(node)) if isinstance(node, dict) else rng.randrange(len(node))
    if choice == 1:
        node[key] = rng.choice(ODD_VALUES)
        log.append(f"{[*path, key]} = odd value")
    elif choice == 2:
        del node[key]
        log.append(f"{[*path, key]} deleted")
    else:
        node[key] = [node[key]]
        log.append(f"{[*path, key]} wrapped in a list")
    return json.dumps(value).encode()


def _mutated_bytes(rng: random.Random, raw: bytes, log: list[str]) -> bytes:
    choice = rng.randrange(4)
    if choice == 0:
        log.append("emptied")
        return b""
    if choice == 1 and raw:
        cut = rng.randrange(len(raw))
        log.append(f"cut at {cut}")
        return raw[:cut]
    if choice == 2 and raw:
        data = bytearray(raw)
        for _ in range(rng.randint(1, 8)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        log.append("bytes flipped")
        return bytes(data)
    log.append("random bytes")
    return bytes(rng.randrange(256) for _ in range(rng.randint(1, 300)))


def fuzz_case(seed: int, sources, root: Path) -> str | None:
    rng = random.Random(seed)
    kind = ("sentencepiece", "bpe")[seed % 2]
    source = root / f"case-{seed}"
    shutil.copytree(sources[kind], source)
    log = [kind]
    try:
        for _ in range(rng.choice([1, 1, 2])):
            present = sorted(
                name
                for name in ("tokenizer.model", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
                if (source / name).is_file()
            )
            name = rng.choice([*present, "added_tokens.json"])
            path = source / name
            raw = path.read_bytes() if path.is_file() else b'{"<extra_0>": 600}'
            log.append(name)
            if name.endswith(".json") and rng.random() < 0.7:
                path.write_bytes(_mutated_json(rng, raw, log))
            else:
                path.write_bytes(_mutated_bytes(rng, raw, log))
        extra = ["--dry-run"] if seed % 3 else []
        result = _invoke(source, "-o", root / f"out-{seed}.gguf", "-q", "--device", "cpu", *extra)
        problem = _verdict(result, source)
        if problem is None and result.exit_code != 0 and (root / f"out-{seed}.gguf").exists():
            problem = "an output was left after an error"
        leftovers = [path.name for path in root.iterdir() if "nf4convert" in path.name]
        problem = problem or (f"left {leftovers}" if leftovers else None)
        return f"seed {seed} ({'; '.join(log)}): {problem}" if problem else None
    finally:
        shutil.rmtree(source, ignore_errors=True)
        (root / f"out-{seed}.gguf").unlink(missing_ok=True)


def test_fuzz_tokenizer_files(sources, tmp_path):
    failures = [failure for seed in range(2 * FUZZ_CASES) if (failure := fuzz_case(seed, sources, tmp_path))]
    assert not failures, f"{len(failures)} of {2 * FUZZ_CASES} cases went wrong:\n" + "\n".join(failures[:8])


def test_only_what_the_libraries_raise_is_put_on_the_models_files():
    # an error of nf4convert's own code under the converter (a tensor it asked for) must stay what it is
    import nf4convert
    from nf4convert.sinks.gguf.converter import _raised_by_libraries

    ours = str(Path(nf4convert.__file__).parent / "kinds" / "made_here.py")
    namespace: dict = {}
    exec(compile("def make(inner):\n    return inner()\n", ours, "exec"), namespace)
    exec(compile("def convert(inner):\n    return inner()\n", "/x/site-packages/conversion/base.py", "exec"), namespace)
    exec(
        compile("def kernel():\n    raise RuntimeError('out of memory')\n", "/x/site-packages/torch/k.py", "exec"),
        namespace,
    )
    exec(
        compile("def vocab():\n    raise TypeError('bad vocab')\n", "/x/site-packages/tokenizers/t.py", "exec"),
        namespace,
    )

    def raised(call):
        try:
            call()
        except Exception as error:  # noqa: BLE001
            return error
        raise AssertionError("nothing raised")

    convert, make = namespace["convert"], namespace["make"]
    assert _raised_by_libraries(raised(lambda: convert(namespace["vocab"])))
    assert not _raised_by_libraries(raised(lambda: convert(lambda: make(namespace["kernel"]))))
    assert not _raised_by_libraries(raised(lambda: make(namespace["kernel"])))
