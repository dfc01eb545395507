"""verify streams: each tensor's reference is recomputed and compared a slice at a time, on several threads, and
dropped. Here the slices are made a few hundred bytes (double-quantized weights: one nested block of quant blocks,
16384 elements), so every tensor of these small checkpoints is many slices long, and a tamper anywhere in a tensor,
of any kind, lands in a slice of its own; the memory test keeps the real sizes and a tensor many slices long.

Each case edits a copy of an output that verifies OK, so a failure can only come from the edit."""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
import textwrap

import pytest
import torch
from click.testing import CliRunner

from nf4convert.cli.commands import main
from nf4convert.errors import CheckpointError
from nf4convert.verification import stream
from nf4convert.verification.reference.dequantize_4bit import CPU_REFERENCE
from nf4convert.verification.report import report_lines
from nf4convert.verification.verify import verify

from fixtures import checkpoints, checkpoints8
from fixtures.adapters import make_adapter

pytest.importorskip("bitsandbytes")

INDEX = "model.safetensors.index.json"


def run(*args, code=0):
    result = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
    assert result.exit_code == code, result.output
    return result.output


@pytest.fixture
def small_slices(monkeypatch):
    """Slices of 1 KiB (a whole nested block where the weight is double-quantized), compared 256 bytes at a time."""
    monkeypatch.setattr(stream, "CPU_SLICE_BYTES", 1024)
    monkeypatch.setattr(stream, "CUDA_SLICE_BYTES", 1024)
    monkeypatch.setattr(stream, "COMPARE_BYTES", 256)


# kind -> (source builder, the tensor tampered with, what it is compared against on the CPU)
KINDS = {
    "4-bit nested": ("llama-nf4-dq", "model.layers.1.mlp.up_proj.weight", CPU_REFERENCE),
    "4-bit flat fp4": ("qwen2-tied-fp4", "model.layers.0.mlp.down_proj.weight", CPU_REFERENCE),
    "conv1d transposed": ("gpt2-conv1d-nf4-dq", "transformer.h.1.mlp.c_fc.weight", CPU_REFERENCE),
    "plain": ("llama-nf4-dq", "model.embed_tokens.weight", "the source tensor"),
    "8-bit": ("llama-8bit-bf16", "model.layers.0.mlp.gate_proj.weight", "bitsandbytes"),
    "merged": ("llama-nf4-dq+adapter", "model.layers.0.self_attn.q_proj.weight", f"{CPU_REFERENCE} + peft"),
}


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    """variant -> (source, output, adapter or None), each output converted on the CPU route, sharded."""
    root = tmp_path_factory.mktemp("streamed")
    made = {}
    for variant in sorted({builder for builder, _, _ in KINDS.values()}):
        base, _, merged = variant.partition("+")
        if base in checkpoints.VARIANTS:
            source = checkpoints.build(root / f"{base}-bnb-4bit", base, seed=31)
        else:
            source = checkpoints8.build(root / f"{base}-bnb-8bit", base, seed=31)
        adapter = make_adapter(root / "adapter", "linear", seed=33, base_model=str(source)) if merged else None
        out = root / f"out-{variant}"
        run(
            source,
            "-o",
            out,
            "-q",
            "--device",
            "cpu",
            "--max-shard-size",
            "300KB",
            *(["--adapter", adapter] * bool(adapter)),
        )
        made[variant] = source, out, adapter
    return made


def copy_of(outputs, variant, tmp_path):
    source, out, adapter = outputs[variant]
    copy = tmp_path / "out"
    shutil.copytree(out, copy)
    return source, copy, adapter


def problems(out, source, adapter=None, device="cpu"):
    report = verify(out, str(source), adapter=None if adapter is None else str(adapter), device=device)
    assert report.checked > 0
    return report.problems


def header_of(path):
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + length]), 8 + length


def shard_of(out, name):
    if not (out / INDEX).is_file():
        return out / "model.safetensors"
    return out / json.loads((out / INDEX).read_text())["weight_map"][name]


def flip(out, name, position: float, bit: int = 0) -> int:
    """Flip one bit of the byte at ``position`` (0 first, 1 last) of output tensor ``name``; its element count."""
    path = shard_of(out, name)
    header, start = header_of(path)
    begin, end = header[name]["data_offsets"]
    data = bytearray(path.read_bytes())
    data[start + begin + min(end - begin - 1, int(position * (end - begin)))] ^= 1 << bit
    path.write_bytes(bytes(data))
    return (end - begin) // {"BF16": 2, "F16": 2, "F32": 4}[header[name]["dtype"]]


def test_every_tensor_is_many_slices_and_verifies_ok(outputs, small_slices):
    from nf4convert.plan import make_plan
    from nf4convert.safetensors_io.read import TensorReader
    from nf4convert.verification.reference.base import Context

    for variant, (source, out, adapter) in outputs.items():
        assert problems(out, source, adapter) == [], variant
        with TensorReader() as reader:
            plan = make_plan(source, dtype=None, reader=reader, adapter=adapter)
            context = Context({t.name: t for t in plan.tensors}, None, None, None)
            name = next(name for kind, (v, name, _) in KINDS.items() if v == variant)
            tensor = next(t for t in plan.tensors if t.name == name)
            if tensor.recipe.kind not in ("merge_lora", "transpose"):  # those need the whole tensor: one slice
                assert len(list(context.slices(tensor, reader, "cpu", stream.CPU_SLICE_BYTES))) >= 3, name


@pytest.mark.parametrize("position", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("kind", list(KINDS))
def test_a_flipped_bit_in_any_slice_of_any_kind_is_found(kind, position, outputs, small_slices, tmp_path):
    variant, name, against = KINDS[kind]
    source, out, adapter = copy_of(outputs, variant, tmp_path)
    elements = flip(out, name, position, bit=3)
    assert problems(out, source, adapter) == [f"{name}: 1 of {elements} elements differ from {against}"]


def test_missing_and_extra_tensors_are_named(outputs, small_slices, tmp_path):
    from safetensors.torch import load_file, save_file

    source, out, _ = copy_of(outputs, "llama-nf4-dq", tmp_path)
    gone, extra = "model.layers.0.mlp.down_proj.weight", "model.layers.9.mlp.extra.weight"
    path = shard_of(out, gone)
    tensors = load_file(path)
    tensors[extra] = tensors.pop(gone)
    save_file(tensors, path, metadata={"format": "pt"})
    index = json.loads((out / INDEX).read_text())
    index["weight_map"][extra] = index["weight_map"].pop(gone)
    (out / INDEX).write_text(json.dumps(index))
    assert problems(out, source) == [
        f"{gone}: in the source, missing from the output",
        f"{extra}: in the output, not in the source",
    ]


def test_missing_and_extra_files_and_a_wrong_config_are_named(outputs, small_slices, tmp_path):
    source, out, _ = copy_of(outputs, "llama-nf4-dq", tmp_path)
    (out / "tokenizer_config.json").unlink()
    shutil.copy(next(out.glob("model-*.safetensors")), out / "stray.safetensors")
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 0.5}))
    assert problems(out, source) == [
        "stray.safetensors: a .safetensors file the index does not name",
        "config.json: differs from the source's made dense (in rms_norm_eps)",
        "tokenizer_config.json: carried over from the source, missing from the output",
    ]
    shard = next(iter(sorted(out.glob("model-*-of-*.safetensors"))))
    shard.unlink()
    with pytest.raises(CheckpointError, match="listed in the index but missing"):
        verify(out, str(source), device="cpu")


def test_a_slice_the_reference_refuses_is_a_finding_and_the_rest_is_checked(outputs, small_slices, monkeypatch):
    from nf4convert.verification.reference import cuda_arithmetic

    source, out, _ = outputs["llama-nf4-dq"]
    calls = []
    original = cuda_arithmetic.dequantize_4bit

    def refusing(packed, state, **options):
        calls.append(1)
        if len(calls) == 2:  # the second slice of the first 4-bit weight
            raise RuntimeError("refused\nsecond line")
        return original(packed, state, **options)

    monkeypatch.setattr(cuda_arithmetic, "dequantize_4bit", refusing)
    monkeypatch.setattr(stream, "threads_for", lambda device: 1)  # slices in order: the second is the second
    found = problems(out, source)
    assert len(found) == 1 and found[0].endswith(f": {CPU_REFERENCE} could not recompute it (RuntimeError: refused)")
    assert len(calls) > 20  # every other slice was still recomputed


def test_bytes_no_slice_covered_are_never_called_ok(outputs, small_slices, monkeypatch):
    from nf4convert.verification.reference import base as reference

    source, out, _ = outputs["llama-nf4-dq"]
    name = "model.layers.1.mlp.up_proj.weight"
    original = reference.Context.slices

    def dropping(self, tensor, reader, device, piece_bytes):
        pieces = list(original(self, tensor, reader, device, piece_bytes))
        return pieces[:-1] if tensor.name == name else pieces

    monkeypatch.setattr(reference.Context, "slices", dropping)
    (found,) = problems(out, source)
    assert found.startswith(f"{name}: only ") and found.endswith(" bytes were compared")


def test_an_unreadable_output_stops_verify_with_one_error(outputs, small_slices, monkeypatch):
    from nf4convert.safetensors_io import read

    source, out, _ = outputs["llama-nf4-dq"]
    original = read.TensorReader.read

    def failing(self, info, first=0, count=None, out=None):
        if info.path.parent == out_folder and first > 0:
            raise CheckpointError(f"{info.path}: cannot be read (Input/output error)")
        return original(self, info, first, count, out)

    out_folder = out
    monkeypatch.setattr(read.TensorReader, "read", failing)
    with pytest.raises(CheckpointError, match=r"cannot be read \(Input/output error\)$"):
        verify(out, str(source), device="cpu")


def test_the_report_says_what_each_tensor_was_compared_against(outputs):
    # every linear layer merged (the adapter targets them all), the rest plain
    source, out, adapter = outputs["llama-nf4-dq+adapter"]
    report = verify(out, str(source), adapter=str(adapter), device="cpu")
    merged, plain = report.against[f"{CPU_REFERENCE} + peft"], report.against["the source tensor"]
    assert report.ok and merged == 14 and plain > 0 and sum(report.against.values()) == report.checked
    assert report.compared_against["model.layers.0.self_attn.q_proj.weight"] == f"{CPU_REFERENCE} + peft"
    assert report.compared_against["model.norm.weight"] == "the source tensor"
    first, last = report_lines(report)
    assert first == (
        f"{out}: {report.checked} tensors checked on cpu ({merged} against {CPU_REFERENCE} + peft, "
        f"{plain} against their source tensors)"
    )
    assert last == f"OK: bit-exact with {CPU_REFERENCE} and peft"
    source, out, _ = outputs["llama-8bit-bf16"]
    first, last = report_lines(verify(out, str(source), device="cpu"))
    assert " against bitsandbytes, " in first and last == "OK: bit-exact with bitsandbytes"


def test_one_progress_bar_by_bytes(outputs):
    source, out, _ = outputs["llama-nf4-dq"]
    result = subprocess.run(
        [sys.executable, "-m", "nf4convert", "verify", str(out), str(source), "--device", "cpu"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    total = sum(info.nbytes for info in __import__("nf4convert").safetensors_io.read.read_tensors(out).values())
    bars = [line for line in result.stderr.replace("\r", "\n").splitlines() if line.startswith(f"verifying {out.name}")]
    assert result.returncode == 0 and bars, result.stderr
    assert all(line.count("/") >= 1 and "B" in line for line in bars) and "100%" in bars[-1], bars
    assert f"{total / 1e3:.0f}k/{total / 1e3:.0f}k " in bars[-1], (total, bars[-1])  # unit_scale: the tensors' bytes


def test_torch_threads_are_as_before(outputs):
    source, out, _ = outputs["llama-nf4-dq"]
    before = torch.get_num_threads()
    torch.set_num_threads(max(1, before - 1) if before > 1 else 1)
    try:
        wanted = torch.get_num_threads()
        assert verify(out, str(source), device="cpu").ok
        assert torch.get_num_threads() == wanted
    finally:
        torch.set_num_threads(before)


# VmHWM, not getrusage's ru_maxrss: that starts from the parent's at the fork (pytest's, here larger than verify's)
# Two cores, whatever the machine: a CPU verify runs a thread per core, each with its own slices in flight, so on a
# machine of many cores the smaller weight has too few slices to fill them all and the comparison would measure
# the thread count, not the tensor size.
MEMORY = """
import json, os, re, sys
os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:2])
from nf4convert.verification.verify import verify
report = verify(sys.argv[1], sys.argv[2], device="cpu")
peak = int(re.search(r"VmHWM:\\s+(\\d+) kB", open("/proc/self/status").read())[1])
print(json.dumps({"ok": report.ok, "problems": report.problems, "peak_mb": peak / 1024}))
"""


def _one_big_weight(folder, rows: int, columns: int = 8192, seed: int = 0):
    """A valid double-quantized NF4 checkpoint of one (rows, columns) weight and a norm: random packed bytes and absmax
    codes, positive nested absmax, bitsandbytes' own tables (nothing is quantized: that would take long here)."""
    import numpy as np
    from bitsandbytes.functional import create_dynamic_map
    from safetensors.torch import save_file

    from nf4convert.formats.bnb4 import CODES

    generator = np.random.default_rng(seed)
    n = rows * columns
    meta = {"quant_type": "nf4", "blocksize": 64, "dtype": "bfloat16", "shape": [rows, columns],
            "nested_blocksize": 256, "nested_dtype": "float32", "nested_offset": 0.0312}  # fmt: skip
    name = "model.layers.0.mlp.up_proj.weight"
    tensors = {
        name: torch.from_numpy(generator.integers(0, 256, (n // 2, 1), dtype=np.uint8)),
        f"{name}.absmax": torch.from_numpy(generator.integers(0, 256, n // 64, dtype=np.uint8)),
        f"{name}.quant_map": torch.tensor(CODES["nf4"], dtype=torch.float32),
        f"{name}.nested_absmax": torch.from_numpy(generator.random(-(-n // 64 // 256), dtype=np.float32) * 0.05 + 1e-3),
        f"{name}.nested_quant_map": create_dynamic_map(signed=True).float(),
        f"{name}.quant_state.bitsandbytes__nf4": torch.tensor(list(json.dumps(meta).encode()), dtype=torch.uint8),
        "model.norm.weight": torch.ones(columns, dtype=torch.bfloat16),
    }
    folder.mkdir(parents=True)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return folder, name


def test_memory_does_not_grow_with_the_tensor(tmp_path):
    # one weight of 8 slices against one of 64 (16 MiB slices): the peak must stay that of a few slices, where
    # recomputing and reading a tensor whole takes about three times its 256 MiB
    peaks = {}
    for rows in (2048, 16384):
        source, name = _one_big_weight(tmp_path / f"src-{rows}", rows)
        out = tmp_path / f"out-{rows}"
        run(source, "-o", out, "-q", "--device", "cpu", "--allow-no-config")  # a weight alone: no config.json
        if rows == 16384:
            flip(out, name, 0.9, bit=2)
        result = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(MEMORY), str(out), str(source)],
            capture_output=True,
            text=True,
            timeout=900,
        )
        assert result.returncode == 0, result.stderr
        peaks[rows] = json.loads(result.stdout.splitlines()[-1])
    assert peaks[2048]["ok"] and peaks[16384]["problems"] == [
        f"{name}: 1 of {16384 * 8192} elements differ from {CPU_REFERENCE}"
    ]
    grown = peaks[16384]["peak_mb"] - peaks[2048]["peak_mb"]
    assert grown < 48, peaks  # the larger output is 224 MiB larger


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["4-bit nested", "4-bit flat fp4", "plain", "8-bit", "merged", "conv1d transposed"])
def test_on_the_gpu_a_flipped_bit_is_found_against_bitsandbytes(kind, outputs, small_slices, tmp_path):
    variant, name, against = KINDS[kind]
    source, out, adapter = copy_of(outputs, variant, tmp_path)
    assert problems(out, source, adapter, device="cuda") == []
    elements = flip(out, name, 0.7, bit=5)
    against = against.replace(CPU_REFERENCE, "bitsandbytes")
    assert problems(out, source, adapter, device="cuda") == [f"{name}: 1 of {elements} elements differ from {against}"]
