"""End to end: real 4-bit checkpoints converted by the CLI, checked against bitsandbytes and transformers."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from nf4convert.cli.commands import main
from nf4convert.verification.reference.dequantize_4bit import CPU_REFERENCE

from fixtures.checkpoints import VARIANTS, build, model_class

# what verify --device auto compares 4-bit weights against: bitsandbytes itself on a GPU
AUTO_REFERENCE = "bitsandbytes" if torch.cuda.is_available() else CPU_REFERENCE

pytest.importorskip("bitsandbytes")
pytest.importorskip("transformers")


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("sources")
    return {variant: build(root / variant, variant, seed=index) for index, variant in enumerate(VARIANTS)}


def _has_avx512_fp16() -> bool:
    try:
        return "avx512_fp16" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


def run(*args, code=0):
    result = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
    assert result.exit_code == code, result.output
    return result.output


def _safetensors_keys(folder: Path) -> dict[str, str]:
    keys = {}
    for path in folder.glob("*.safetensors"):
        with open(path, "rb") as file:
            (length,) = struct.unpack("<Q", file.read(8))
            header = json.loads(file.read(length))
        keys.update({k: v["dtype"] for k, v in header.items() if k != "__metadata__"})
    return keys


def _inputs(arch):
    generator = torch.Generator().manual_seed(7)
    ids = torch.randint(0, 512, (2, 11), generator=generator)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_convert_verify_and_load(variant, checkpoints, tmp_path):
    source = checkpoints[variant]
    arch, quant_type, _, _, dense_dtype, _ = VARIANTS[variant]
    out = tmp_path / "out"
    run(source, "-o", out, "-q", "--max-shard-size", "300KB")

    # The quant-state keys of some weight sit in another shard than its packed bytes.
    weight_map = json.loads((source / "model.safetensors.index.json").read_text())["weight_map"]
    assert any(weight_map[k] != weight_map[k.rsplit(".quant_state.", 1)[0]] for k in weight_map if ".quant_state." in k)

    keys = _safetensors_keys(out)
    assert not [
        k
        for k in keys
        if k.endswith((".absmax", ".quant_map", ".nested_absmax", ".nested_quant_map")) or ".quant_state." in k
    ]
    expected_code = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}[dense_dtype]
    assert {dtype for dtype in keys.values()} == {expected_code}  # auto keeps the quantized-from dtype
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in json.dumps(config) and config["torch_dtype"] == str(dense_dtype).removeprefix(
        "torch."
    )
    for carried in ("tokenizer_config.json", "chat_template.jinja", "README.md", "generation_config.json"):
        assert (out / carried).exists() == (source / carried).exists()
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(keys)
    assert index["metadata"]["total_size"] == sum(
        (out / f).stat().st_size for f in set(index["weight_map"].values())
    ) - sum(8 + struct.unpack("<Q", (out / f).read_bytes()[:8])[0] for f in set(index["weight_map"].values()))

    output = run("verify", out, source)
    assert f"OK: bit-exact with {AUTO_REFERENCE}\n" in output

    # transformers loads it as an ordinary dense model, and its outputs match transformers' own
    # dequantize() of the 4-bit model exactly (same weights, same dense operations).
    cls = model_class(arch)
    dense = cls.from_pretrained(out).eval()
    assert not hasattr(dense.config, "quantization_config") and dense.dtype == dense_dtype
    # (bitsandbytes repacks weights for its CPU matmul on the first 4-bit forward, after which
    # dequantize() reads the repacked bytes: the reference model is loaded fresh.) transformers' dequantize() runs
    # bitsandbytes' CUDA kernels where there is a GPU; on the CPU its CPU op, which is CUDA's here except fp16 on
    # CPUs with AVX512-FP16 (about 1 element in 5000 differs): there the logits are compared for closeness only.
    quantized = cls.from_pretrained(source, device_map="cpu").eval()
    on = "cuda" if torch.cuda.is_available() else "cpu"
    dequantized = cls.from_pretrained(source, device_map=on).eval()
    dequantized.dequantize()
    dequantized.to("cpu")
    exact = on == "cuda" or dense_dtype != torch.float16 or not _has_avx512_fp16()

    def forward(model):
        result = model(**_inputs(arch))
        return (result.logits if arch != "bert" else result.last_hidden_state).float()

    # Newer transformers dequantize a Conv1D layer into an nn.Linear (weight (out, in)), whose forward rounds otherwise
    # than Conv1D's addmm: there the weights are compared, transposed back, and the logits for closeness only.
    swapped = {
        name
        for name, module in dequantized.named_modules()
        if isinstance(module, torch.nn.Linear) and type(dense.get_submodule(name)).__name__ == "Conv1D"
    }
    for name, weight in dense.state_dict().items():
        theirs = dequantized.state_dict()[name]
        theirs = theirs.T if name.rpartition(".")[0] in swapped and name.endswith(".weight") else theirs
        assert torch.equal(weight, theirs) if exact else (weight.float() - theirs.float()).abs().max() <= 0.01, name
    exact = exact and not swapped
    with torch.no_grad():
        got, four_bit, reference = forward(dense), forward(quantized), forward(dequantized)
    assert torch.equal(got, reference) if exact else (got - reference).abs().max() <= 0.01 * reference.abs().max()
    assert (got - four_bit).abs().max() <= 0.05 * four_bit.abs().max()


def test_verify_asks_transformers_which_layers_are_conv1d(checkpoints, tmp_path, monkeypatch):
    # The plan knows GPT-2's Conv1D layers from a table (model/conv1d.py); verify asks transformers' own model.
    # With the table emptied, the weights come out as quantized, (out, in): convert refuses the first whose shape is
    # not the model's, and of an output written so all the same (that check off), verify names each one.
    from nf4convert import plan
    from nf4convert.model import conv1d

    source = checkpoints["gpt2-conv1d-nf4-dq"]
    monkeypatch.setattr(conv1d, "MODEL_TYPES", ())
    out = tmp_path / "out"
    refused = run(source, "-o", out, "-q", code=1)
    assert "transformer.h.0.attn.c_attn.weight: [384, 128] from the checkpoint" in refused and not out.exists()
    monkeypatch.setattr(plan, "check_fits", lambda *args: None)
    run(source, "-o", out, "-q")
    output = run("verify", out, source, code=1)
    assert (
        "transformer.h.0.mlp.c_fc.weight: transformers' model has a Conv1D there; the output holds it (out, in)"
        in output
    )
    assert output.count("has a Conv1D there") == 8


def test_dtype_choice_and_single_shard(checkpoints, tmp_path):
    out = tmp_path / "fp32"
    run(checkpoints["llama-nf4-dq"], "-o", out, "--dtype", "fp32", "-q")
    assert sorted(p.name for p in out.glob("*.safetensors")) == ["model.safetensors"]
    assert not (out / "model.safetensors.index.json").exists()
    assert set(_safetensors_keys(out).values()) == {"F32"}
    assert json.loads((out / "config.json").read_text())["dtype"] == "float32"
    assert "OK" in run("verify", out, checkpoints["llama-nf4-dq"])


def test_default_output_name_and_overwrite(checkpoints, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    source = tmp_path / "Tiny-Model-bnb-4bit"
    shutil.copytree(checkpoints["llama-nf4-dq"], source)
    run(source, "-q")
    out = tmp_path / "Tiny-Model-bf16"
    assert (out / "config.json").exists()
    marker = out / "keep-me.txt"
    marker.write_text("user data")
    assert "exists and is not empty" in run(source, "-q", code=1)
    assert marker.exists()  # refused: nothing touched
    run(source, "-q", "--overwrite")
    assert not marker.exists() and (out / "config.json").exists()
    # Never the source itself, even with --overwrite; said first (not that it exists and is not empty), and so of a
    # folder that holds it.
    assert "is the source checkpoint's folder" in run(source, "-o", source, "-q", "--overwrite", code=1)
    held = shutil.copytree(source, tmp_path / "models" / "Held-bnb-4bit")
    for held_in in (held, held.parent):
        said = run(held, "-o", held_in, "-q", code=1)
        assert said.startswith(f"Error: {held_in}: is the source checkpoint's folder (or holds it)"), said
    assert "is the current folder or holds it" in run(source, "-o", tmp_path.parent, "-q", "--overwrite", code=1)
    assert "is the current folder" in run(source, "-o", tmp_path, "-q", "--overwrite", code=1)  # which holds it too
    assert "is inside the source checkpoint's folder" in run(source, "-o", source / "dense", "-q", code=1)
    assert (source / "config.json").exists()
    assert not list(tmp_path.glob(".*nf4convert*"))


def test_verify_catches_tampering(checkpoints, tmp_path):
    source = checkpoints["phi3-fused-fp4-dq"]
    out = tmp_path / "out"
    run(source, "-o", out, "-q", "--dtype", "bf16")
    shard = sorted(out.glob("*.safetensors"))[0]
    data = bytearray(shard.read_bytes())
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    name = next(k for k in header if k.endswith("qkv_proj.weight"))
    position = 8 + length + header[name]["data_offsets"][0] + 10
    data[position] ^= 0x01  # one bit of one element
    shard.write_bytes(bytes(data))
    output = run("verify", out, source, code=1)
    assert f"{name}: 1 of" in output and "FAILED" in output
    # A leftover quantization key and config are caught too.
    (out / "config.json").write_text(json.dumps({"quantization_config": {"load_in_4bit": True}}))
    assert "quantization_config remains" in run("verify", out, source, code=1)


def test_interrupted_run_leaves_nothing(checkpoints, tmp_path, monkeypatch):
    from nf4convert.kinds.copy import Copy

    calls = {"n": 0}
    original = Copy.produce

    def fail_after_some(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return original(*args, **kwargs)

    monkeypatch.setattr(Copy, "produce", fail_after_some)
    out = tmp_path / "out"
    output = CliRunner().invoke(main, [str(checkpoints["llama-nf4-dq"]), "-o", str(out), "-q"])
    assert output.exit_code == 130 and "interrupted" in output.output
    assert not out.exists() and not list(tmp_path.glob(".*"))


def test_a_dry_run_judges_the_space_and_the_destination_as_the_run_does(checkpoints, tmp_path, monkeypatch):
    # a dry run said "(enough)" where the run then refused (it forgot the headroom), and onto a read-only folder
    import os
    import shutil as shutil_module

    usage = shutil_module.disk_usage(tmp_path)
    monkeypatch.setattr(shutil_module, "disk_usage", lambda path: usage._replace(free=30_000_000))  # under the headroom
    source, out = checkpoints["llama-nf4-dq"], tmp_path / "out"
    refused = f"Error: {tmp_path}: 30.0 MB free, the output needs "
    dry = run(source, "-o", out, "--dry-run", code=1).splitlines()  # the plan, then the run's refusal (it exited 0)
    assert "free where it goes: 30.0 MB (NOT enough: " in dry[-3] and dry[-2] == "dry run: nothing was written"
    assert dry[-1].startswith(refused)
    assert run(source, "-o", out, "-q", code=1).startswith(refused)
    dry = run("batch", source, "-o", tmp_path / "root", "--dry-run", code=1).splitlines()
    assert "(NOT enough: " in dry[-3] and dry[-1].startswith(refused) and dry[-2] == "dry run: nothing was written"
    monkeypatch.setattr(shutil_module, "disk_usage", lambda path: usage._replace(free=10**12))
    assert "free where it goes: 1000.00 GB (enough)" in run(source, "-o", out, "--dry-run")
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode, **kw: not mode & os.W_OK and real_access(path, mode, **kw))
    for extra in (["--dry-run"], ["-q"]):
        line = run(source, "-o", out / "sub", *extra, code=1).strip()
        assert (
            line
            == f"Error: {tmp_path}: cannot be written (a read-only file system or no permission); choose another output"
        )
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    monkeypatch.setattr(os, "access", real_access)
    (tmp_path / "a-file").write_text("x")
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    for extra in (
        ["--dry-run"],
        ["-q"],
    ):  # the file was taken for a folder (the run failed later); the loop was a traceback
        assert run(source, "-o", tmp_path / "a-file" / "out", *extra, code=1).strip() == (
            f"Error: {tmp_path / 'a-file'}: is a file, not a folder; the output cannot be made in it"
        )
        line = run(source, "-o", tmp_path / "loop" / "out", *extra, code=1).strip()
        assert line == f"Error: {tmp_path / 'loop'}: cannot be resolved (a symbolic link loop)"
        line = run(source, "-o", f"{tmp_path / 'loop'}/x/../out", *extra, code=1).strip()  # resolved for its '..'
        assert line.startswith(f"Error: {tmp_path / 'loop'}/x/../out: cannot be resolved (") and "\n" not in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file", "loop"]


def test_verify_says_which_checks_it_could_not_run(tmp_path):
    # a config transformers cannot build a model from: the shape and Conv1D checks were skipped without a word
    example = Path(__file__).resolve().parents[1] / "examples" / "tiny-llama-bnb-4bit"
    source = tmp_path / "src"
    shutil.copytree(example, source)
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(
        json.dumps({**config, "model_type": "no-such-architecture", "architectures": []})
    )
    run(source, "-o", tmp_path / "out", "-q")
    lines = run("verify", tmp_path / "out", source, "-q").splitlines()
    assert lines[-1] == f"OK: bit-exact with {AUTO_REFERENCE}"
    assert lines[-2].startswith("  note: config.json: transformers could not build the model from it (")
    assert lines[-2].endswith("so the parameters it needs, the shapes it loads and its Conv1D layers were not checked")
    assert "does not know model_type 'no-such-architecture'" in lines[-2] and len(lines[-2]) < 300
    assert "note" not in run("verify", tmp_path / "out", source, "-q").replace(lines[-2], "")  # once
    run(example, "-o", tmp_path / "plain", "-q")
    assert "note" not in run("verify", tmp_path / "plain", example, "-q")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_fp16_beyond_its_range_is_named_in_a_warning(tmp_path, device):
    # --dtype fp16 of a bf16 model turned values past 65504 into inf without a word
    from safetensors.torch import load_file, save_file

    from fixtures.weights import quantize

    example = Path(__file__).resolve().parents[1] / "examples" / "tiny-llama-bnb-4bit"
    source = tmp_path / "src"
    shutil.copytree(example, source)
    shard = next(path for path in sorted(source.glob("*.safetensors")) if "model.norm.weight" in load_file(path))
    tensors = load_file(shard)
    tensors["model.norm.weight"] = tensors["model.norm.weight"] * 1e6  # a plain bf16 tensor, cast to fp16
    save_file(tensors, shard, metadata={"format": "pt"})
    big = tmp_path / "big"  # a 4-bit weight quantized from bf16 values past fp16's range, dequantized to fp16
    big.mkdir()
    packed, state = quantize(
        (64, 128), quant_type="nf4", blocksize=64, nested=True, dtype=torch.bfloat16, seed=5, scale=1e6
    )
    small, small_state = quantize((64, 128), quant_type="nf4", blocksize=64, nested=True, dtype=torch.bfloat16, seed=6)
    save_file(
        {
            "big.weight": packed,
            **{f"big.weight.{k}": v for k, v in state.as_dict(packed=True).items()},
            "small.weight": small,
            **{f"small.weight.{k}": v for k, v in small_state.as_dict(packed=True).items()},
        },
        big / "model.safetensors",
        metadata={"format": "pt"},
    )
    # An fp16 weight at fp16's largest value, double-quantized by bitsandbytes: the rebuilt scale of its blocks
    # (nested code * nested absmax + offset) is 65859.8, so bitsandbytes' dequantize (and ours) gives inf in fp16.
    import bitsandbytes.functional as F

    nested = tmp_path / "nested"
    nested.mkdir()
    weight = torch.zeros(256, 64, dtype=torch.float16)
    weight[:204, 0], weight[204:, 0] = 65504.0, 1.0
    packed, state = F.quantize_4bit(weight.view(8, -1), blocksize=64, quant_type="nf4", compress_statistics=True)
    save_file(
        {
            "top.weight": packed,
            **{f"top.weight.{k}": v for k, v in state.as_dict(packed=True).items()},
            "small.weight": small,
            **{f"small.weight.{k}": v for k, v in small_state.as_dict(packed=True).items()},
        },
        nested / "model.safetensors",
        metadata={"format": "pt"},
    )
    for folder, name in ((source, "model.norm.weight"), (big, "big.weight"), (nested, "top.weight")):
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "nf4convert",
                str(folder),
                "-o",
                str(tmp_path / f"{folder.name}-fp16"),
                "--dtype",
                "fp16",
                "-q",
                "--device",
                device,
                "--allow-no-config",  # the hand-made ones are tensors alone
            ],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert result.returncode == 0, result.stderr
        assert result.stderr.strip() == (
            f"Warning: 1 tensor holds ±inf in fp16, values beyond its range (65504): {name}; "
            "--dtype bf16 or fp32 keeps them finite"
        )
        written = load_file(next((tmp_path / f"{folder.name}-fp16").glob("*.safetensors")))
        assert torch.isinf(written[name]).any() and all(
            torch.isfinite(t.float()).all() for k, t in written.items() if k != name
        )
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "nf4convert",
                str(folder),
                "-o",
                str(tmp_path / f"{folder.name}-bf16"),
                "--dtype",
                "bf16",
                "-q",
                "--device",
                device,
                "--allow-no-config",
            ],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert result.returncode == 0 and result.stderr == "", result.stderr


def test_disk_full_is_one_line(checkpoints, tmp_path, monkeypatch):
    import shutil as shutil_module

    usage = shutil_module.disk_usage(tmp_path)
    monkeypatch.setattr(shutil_module, "disk_usage", lambda path: usage._replace(free=1000))
    output = run(checkpoints["llama-nf4-dq"], "-o", tmp_path / "out", "-q", code=1)
    assert (
        "0.0 MB free, the output needs" in output
        and "and 67.1 MB of headroom)" in output
        and not (tmp_path / "out").exists()
    )

    from nf4convert.safetensors_io import write as writing

    def no_space(self, name, data, offset=None):
        raise OSError(28, "No space left on device")

    monkeypatch.undo()
    monkeypatch.setattr(writing.ShardWriter, "write", no_space)
    output = run(checkpoints["llama-nf4-dq"], "-o", tmp_path / "out", "-q", code=1)
    assert "No space left on device" in output and not (tmp_path / "out").exists()
    assert not list(tmp_path.glob(".*nf4convert*"))


def _copy(source: Path, tmp_path: Path) -> Path:
    target = tmp_path / "src"
    shutil.copytree(source, target)
    return target


def _rewrite_shard(path: Path, edit):
    """Rewrite one safetensors file after ``edit(header, data)`` changed its header or bytes.

    The data is laid out again in header order, so the file stays valid safetensors (contiguous, no gaps
    or overlaps) when an entry was removed or added: the case then tests what it means to.
    """
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + length])
    data = bytearray(raw[8 + length :])
    edit(header, data)
    chunks, position = [], 0
    for name, entry in header.items():
        if name != "__metadata__":
            begin, end = entry["data_offsets"]
            chunks.append(bytes(data[begin:end]))
            entry["data_offsets"] = [position, position + end - begin]
            position += end - begin
    encoded = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + b"".join(chunks))


def _shard_of(folder: Path, key: str) -> Path:
    return folder / json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"][key]


@pytest.mark.parametrize(
    "case",
    [
        "missing-folder",
        "truncated",
        "corrupt-header",
        "missing-absmax",
        "bad-json",
        "packed-size",
        "eight-bit",
        "dense",
        "no-safetensors",
        "bad-quant-map",
        "quant-state-lost",
        "nested-absmax-nan",
        "flat-absmax-nan",
        "flat-absmax-negative",
    ],
)
def test_bad_input_is_one_clear_line(case, checkpoints, tmp_path):
    source = _copy(checkpoints["qwen2-tied-fp4" if case.startswith("flat-") else "llama-nf4-dq"], tmp_path)
    weight = "model.layers.0.self_attn.q_proj.weight"
    expected = {
        "missing-folder": "no such folder",
        "truncated": "truncated",
        "corrupt-header": "corrupt",
        "missing-absmax": f"quant state is missing '{weight}.absmax'",
        "bad-json": "quant state is not valid JSON",
        "packed-size": "packed bytes do not hold shape",
        "eight-bit": f"tensor '{weight}' has 8-bit scales ('{weight.removesuffix('weight')}SCB') but is U8, not I8",
        "dense": "no quantized weights of a format nf4convert reads",
        "no-safetensors": "no .safetensors files",
        "bad-quant-map": "quant_map is not bitsandbytes' nf4 table",
        "quant-state-lost": f"'{weight}' looks like a packed 4-bit weight (U8 [8192, 1]) but has no quant state",
        "nested-absmax-nan": f"{weight}: nested_absmax holds a negative, NaN or infinite value",
        "flat-absmax-nan": f"{weight}: absmax holds a negative, NaN or infinite value",
        "flat-absmax-negative": f"{weight}: absmax holds a negative, NaN or infinite value",
    }[case]
    if case == "missing-folder":
        source = tmp_path / "nope"
    elif case == "truncated":
        shard = _shard_of(source, weight)
        shard.write_bytes(shard.read_bytes()[:-100])
    elif case == "corrupt-header":
        shard = _shard_of(source, weight)
        raw = bytearray(shard.read_bytes())
        raw[8:20] = b"not json at "
        shard.write_bytes(bytes(raw))
    elif case == "nested-absmax-nan":  # bitsandbytes would make every weight of 256 blocks NaN
        key = weight + ".nested_absmax"

        def spoil(header, data):
            begin = header[key]["data_offsets"][0]
            data[begin : begin + 4] = struct.pack("<f", float("nan"))

        _rewrite_shard(_shard_of(source, key), spoil)
    elif case.startswith("flat-absmax"):  # an fp32 absmax, one float per block, read only while converting
        key = weight + ".absmax"

        def spoil_flat(header, data):
            assert header[key]["dtype"] == "F32"
            begin, end = header[key]["data_offsets"]
            data[end - 4 : end] = struct.pack("<f", float("nan") if case == "flat-absmax-nan" else -0.5)

        _rewrite_shard(_shard_of(source, key), spoil_flat)
    elif (
        case == "quant-state-lost"
    ):  # every part of one weight's quant state gone: the packed bytes must not pass as dense
        index = json.loads((source / "model.safetensors.index.json").read_text())
        parts = [key for key in index["weight_map"] if key.startswith(weight + ".")]
        for shard in {_shard_of(source, key) for key in parts}:
            _rewrite_shard(shard, lambda h, d: [h.pop(key) for key in parts if key in h])
        for key in parts:
            index["weight_map"].pop(key)
        (source / "model.safetensors.index.json").write_text(json.dumps(index))
    elif case == "missing-absmax":
        _rewrite_shard(_shard_of(source, weight + ".absmax"), lambda h, d: h.pop(weight + ".absmax"))
        index = json.loads((source / "model.safetensors.index.json").read_text())
        index["weight_map"].pop(weight + ".absmax")
        (source / "model.safetensors.index.json").write_text(json.dumps(index))
    elif case == "bad-json":
        key = weight + ".quant_state.bitsandbytes__nf4"

        def spoil(header, data):
            begin = header[key]["data_offsets"][0]
            data[begin] = ord("}")

        _rewrite_shard(_shard_of(source, key), spoil)
    elif case == "packed-size":
        key = weight + ".quant_state.bitsandbytes__nf4"

        def grow(header, data):
            begin, end = header[key]["data_offsets"]
            meta = json.loads(bytes(data[begin:end]))
            meta["shape"][0] *= 2
            encoded = json.dumps(meta).encode().ljust(end - begin)[: end - begin]
            data[begin:end] = encoded

        _rewrite_shard(_shard_of(source, key), grow)
    elif case == "eight-bit":  # 8-bit scales beside a weight that is not int8
        scb = weight.removesuffix("weight") + "SCB"

        def add_scb(header, data):
            header[scb] = {"dtype": "F32", "shape": [128], "data_offsets": [len(data), len(data) + 512]}
            data.extend(bytes(512))

        _rewrite_shard(_shard_of(source, weight), add_scb)
        index = json.loads((source / "model.safetensors.index.json").read_text())
        index["weight_map"][scb] = index["weight_map"][weight]
        (source / "model.safetensors.index.json").write_text(json.dumps(index))
    elif case == "dense":
        shutil.rmtree(source)
        from safetensors.torch import save_file

        source.mkdir()
        save_file({"w": torch.randn(4, 4)}, source / "model.safetensors")
    elif case == "no-safetensors":
        for path in source.glob("*.safetensors*"):
            path.unlink()
        torch.save({}, source / "pytorch_model.bin")
    elif case == "bad-quant-map":
        key = weight + ".quant_map"

        def swap(header, data):
            begin, end = header[key]["data_offsets"]
            data[begin:end] = torch.linspace(-1, 1, 16).numpy().tobytes()

        _rewrite_shard(_shard_of(source, key), swap)
    output = run(source, "-o", tmp_path / "out", "-q", code=1)
    lines = [line for line in output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error: ") and expected in lines[0], output
    assert "Traceback" not in output and not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "args,message",
    [
        (["--dtype", "int8"], "Invalid value for '--dtype'"),
        (["--max-shard-size", "lots"], "size 'lots' is not like"),
        (["--device", "tpu"], "device 'tpu' is not cpu, cuda or cuda:N"),
        (["--device", "cuda:0"] if not torch.cuda.is_available() else ["--device", "nonsense"], "device"),
        (["--no-such-option"], "No such option"),
        (
            ["--adapter", "a", "--adapter", "b"],
            "'--adapter': given 2 times; one adapter per conversion",
        ),  # not the last one kept
    ],
)
def test_bad_options_are_one_line(args, message, checkpoints, tmp_path):
    result = CliRunner().invoke(main, [str(checkpoints["llama-nf4-dq"]), "-o", str(tmp_path / "out"), "-q", *args])
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code in (1, 2) and len(lines) == 1 and lines[0].startswith("Error: ") and message in lines[0], (
        result.output
    )
    assert not (tmp_path / "out").exists()


def test_batch_keeps_going_and_reports(checkpoints, tmp_path):
    listing = tmp_path / "models.txt"
    listing.write_text(f"# two models\n{checkpoints['qwen2-tied-fp4']}\n")
    result = CliRunner().invoke(
        main,
        [
            "batch",
            str(checkpoints["llama-nf4-dq"]),
            str(tmp_path / "missing"),
            "--from-file",
            str(listing),
            "-o",
            str(tmp_path / "root"),
            "-q",
        ],
    )
    assert result.exit_code == 1
    lines = result.output.splitlines()
    table = lines[lines.index(next(line for line in lines if line.startswith("source"))) :]
    assert [line.split()[1] for line in table[1:4]] == ["ok", "failed", "ok"]
    assert "1 of 3 failed" in result.output
    assert (tmp_path / "root" / "llama-nf4-dq-bf16" / "model.safetensors").exists()
    assert (tmp_path / "root" / "qwen2-tied-fp16" / "model.safetensors").exists()


def test_an_output_named_through_a_missing_folder_makes_no_such_folder(tmp_path, monkeypatch):
    # -o x/../y made x (to step out of it) and left it behind, empty; batch's -o root too
    example = Path(__file__).resolve().parents[1] / "examples" / "tiny-llama-bnb-4bit"
    monkeypatch.chdir(tmp_path)
    run(example, "-o", "x/../y", "-q")
    run("batch", example, "-o", "r/../s", "-q")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s", "y"] and (tmp_path / "y" / "config.json").exists()
    assert [p.name for p in (tmp_path / "s").iterdir()] == ["tiny-llama-bf16"]
    (tmp_path / "t").mkdir()
    monkeypatch.chdir(tmp_path / "t")
    run("batch", example, "-o", "r/..", "-q")  # a root ending in '..': the output goes in t itself, and no r is made
    assert [p.name for p in (tmp_path / "t").iterdir()] == ["tiny-llama-bf16"]


def test_convert_options_may_come_before_source(tmp_path):
    # "nf4convert -q SOURCE" was "No such option '-q'": the group took the options for its own
    example = Path(__file__).resolve().parents[1] / "examples" / "tiny-llama-bnb-4bit"
    assert run("-q", example, "-o", tmp_path / "a").strip().startswith(f"{tmp_path / 'a'}: 39 tensors")
    assert "float16" in run("--dtype", "fp16", "-q", example, "-o", tmp_path / "b")
    assert "version" in run("--version") and "Usage:" in run("--help")
    assert "No such option '--no-such-option'" in run("--no-such-option", example, code=2)
    assert "options of 'verify' go after its name: nf4convert verify [OPTIONS]" in run(
        "-q", "verify", tmp_path / "a", example, code=2
    )


def test_help_and_bad_arguments_import_no_torch():
    # torch costs ~2 s and bitsandbytes ~5 s to import: help and argument errors must not pay for them.
    code = """
import sys
from nf4convert.cli.commands import main
for args in (
    ["--help"], ["verify", "--help"], ["batch", "--help"], ["verify", "/no/such/out", "src"], ["x", "--dtype", "int9"]
):
    try:
        main(args)
    except SystemExit as exit:
        print("exit", exit.code)
heavy = sorted(name for name in ("torch", "bitsandbytes", "transformers", "triton") if name in sys.modules)
print("heavy", heavy)
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "heavy []" in result.stdout, result.stdout
    assert result.stdout.count("exit 0") == 3 and "exit 1" in result.stdout and "exit 2" in result.stdout
    assert "/no/such/out: no such folder" in result.stderr
    result = subprocess.run(
        [sys.executable, "-m", "nf4convert.cli.commands", "--help"], capture_output=True, text=True, check=True
    )
    assert "verify" in result.stdout and "batch" in result.stdout
    for command in ("convert", "verify", "batch"):
        assert "Example" in run(command, "--help")


# --- the Python API's paths -----------------------------------------------------------------------------------------


def test_api_takes_paths_for_source_and_adapter(checkpoints, tmp_path):
    pytest.importorskip("peft")
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from nf4convert import convert, verify

    from fixtures.checkpoints import _configs

    source = checkpoints["llama-nf4-dq"]
    result = convert(source=Path(source), output=tmp_path / "out", device="cpu", progress=False)
    assert result.output == tmp_path / "out" and verify(tmp_path / "out", Path(source), device="cpu").ok
    adapter = tmp_path / "adapter"
    torch.manual_seed(5)
    model = AutoModelForCausalLM.from_config(_configs()["llama"]())
    get_peft_model(model, LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"])).save_pretrained(adapter)
    result = convert(Path(source), tmp_path / "merged", adapter=Path(adapter), device="cpu", progress=False)
    assert result.tensors > 0 and verify(tmp_path / "merged", Path(source), adapter=Path(adapter), device="cpu").ok


def test_api_expands_home_in_outputs_and_refuses_a_stem_that_is_no_name(checkpoints, tmp_path, monkeypatch):
    from nf4convert import ArgumentError, convert

    source = checkpoints["llama-nf4-dq"]
    (tmp_path / "home").mkdir()
    (tmp_path / "work").mkdir()
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path / "work")
    assert convert(source, "~/x", device="cpu", progress=False).output == tmp_path / "home" / "x"
    assert (
        convert(source, output_dir="~/od", stem="s", device="cpu", progress=False).output
        == tmp_path / "home" / "od" / "s-bf16"
    )
    assert (tmp_path / "home" / "x" / "model.safetensors").exists() and not list((tmp_path / "work").iterdir())
    for stem in ("../escape", "a/b", "/abs", "..", ".", ""):
        with pytest.raises(ArgumentError, match="^stem ") as raised:
            convert(source, output_dir=tmp_path / "work" / "od", stem=stem, device="cpu", progress=False)
        assert raised.value.option == "stem"
    assert not list((tmp_path / "work").iterdir()) and sorted(p.name for p in tmp_path.iterdir()) == ["home", "work"]


@pytest.mark.parametrize(
    "form", ["output", "source", "adapter", "batch root", "batch list", "verify source", "verify out"]
)
def test_a_tilde_user_that_does_not_exist_is_one_line(form, tmp_path, monkeypatch):
    # Path.expanduser raises RuntimeError for ~user with no such user: it was a traceback
    example = str(Path(__file__).resolve().parents[1] / "examples" / "tiny-llama-bnb-4bit")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "list.txt").write_text(f"{example}\n~nf4convert-no-such-user/q\n")
    bad = "~nf4convert-no-such-user/x"
    arguments = {
        "output": [example, "-o", bad],
        "source": [bad, "-o", "out"],
        "adapter": [example, "--adapter", bad, "-o", "out"],
        "batch root": ["batch", example, "-o", bad],
        "batch list": ["batch", "--from-file", "list.txt", "-o", "root"],
        "verify source": ["verify", example, bad],
        "verify out": ["verify", bad, example],
    }[form]
    result = CliRunner().invoke(main, arguments, catch_exceptions=False)
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.startswith("Error")]
    assert len(lines) == 1 and "no such user for '~nf4convert-no-such-user'" in lines[0], result.output
    assert "Traceback" not in result.output and sorted(p.name for p in tmp_path.iterdir()) == ["list.txt"]


def test_verify_api_expands_home_and_refuses_empty_names(checkpoints, tmp_path, monkeypatch):
    # verify took "~/x" literally, and "" as source or adapter meant the current folder (convert already refused them)
    from nf4convert import ArgumentError, convert, verify

    source = checkpoints["llama-nf4-dq"]
    (tmp_path / "home").mkdir()
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    convert(source, "~/x", device="cpu", progress=False)
    assert verify("~/x", source, device="cpu").ok
    for name, arguments, keywords in (
        ("output", ("", source), {}),
        ("source", ("~/x", " "), {}),
        ("adapter", ("~/x", source), {"adapter": ""}),
    ):
        with pytest.raises(ArgumentError, match=f"^{name} is empty") as raised:
            verify(*arguments, device="cpu", **keywords)
        assert raised.value.option == name


def test_api_refuses_output_with_output_dir(checkpoints, tmp_path):
    from nf4convert import ArgumentError, convert

    with pytest.raises(ArgumentError, match="output and output_dir both given") as raised:
        convert(checkpoints["llama-nf4-dq"], tmp_path / "out", output_dir=tmp_path / "od", device="cpu", progress=False)
    assert raised.value.option == "output_dir" and not list(tmp_path.iterdir())


def test_api_refuses_output_with_stem_and_empty_names(tmp_path):
    # stem was silently ignored beside output; "" as source or adapter meant the current folder
    from nf4convert import convert
    from nf4convert.errors import ArgumentError

    example = Path(__file__).resolve().parents[1] / "examples" / "tiny-llama-bnb-4bit"
    with pytest.raises(ArgumentError, match="^output and stem both given") as raised:
        convert(example, tmp_path / "out", stem="x", progress=False)
    assert raised.value.option == "stem"
    for name, arguments in (("source", ("", tmp_path / "a")), ("adapter", (example, tmp_path / "b"))):
        with pytest.raises(ArgumentError, match=f"^{name} is empty"):
            convert(*arguments, **({"adapter": " "} if name == "adapter" else {}), progress=False)
    assert not list(tmp_path.iterdir())


def test_without_triton_auto_takes_the_cpu_and_cuda_is_one_line(monkeypatch, tmp_path):
    # without Triton (torch's CPU builds, other platforms), auto took the GPU and the kernel's import failed
    import nf4convert.devices
    import nf4convert.kernels
    from nf4convert import dequantize_4bit
    from nf4convert.devices import pick_device
    from nf4convert.errors import DependencyError

    from fixtures.weights import quantize

    monkeypatch.setitem(sys.modules, "triton", None)  # what an import of a missing module meets
    for name in ("launch", "nf4", "configs", "compiled"):
        monkeypatch.delitem(sys.modules, f"nf4convert.kernels.{name}", raising=False)
        monkeypatch.delattr(nf4convert.kernels, name, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(nf4convert.devices, "gpu_driver_present", lambda: True)
    assert pick_device("auto") == torch.device("cpu")
    with pytest.raises(DependencyError, match=r"^device 'cuda:0' needs Triton, which is not installed"):
        pick_device("cuda:0")
    # verify recomputes with bitsandbytes, not our kernel: it takes the GPU without Triton
    assert (
        pick_device("auto", kernel=False) == torch.device("cuda") and pick_device("cuda:0", kernel=False).type == "cuda"
    )
    example = Path(__file__).resolve().parents[1] / "examples" / "tiny-llama-bnb-4bit"
    line = run(example, "-o", tmp_path / "out", "--device", "cuda", code=1).strip()
    assert line.startswith("Error: device 'cuda' needs Triton") and "\n" not in line and not (tmp_path / "out").exists()
    packed, state = quantize((64, 64), quant_type="nf4", blocksize=64, nested=True, dtype=torch.float16, seed=3)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(DependencyError, match=r"^dequantizing cpu tensors with backend='triton' needs Triton"):
        dequantize_4bit(packed, state, backend="triton")
    assert dequantize_4bit(packed, state).dtype == torch.float16  # the CPU path needs no Triton
    code = (
        "import sys; sys.modules['triton'] = None; from nf4convert.cli.commands import main; "
        f"main([{str(example)!r}, '-o', {str(tmp_path / 'cpu')!r}, '-q'])"
    )
    subprocess.run(
        [sys.executable, "-c", code], check=True, timeout=300, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    )
    assert (tmp_path / "cpu" / "model.safetensors").exists()


def test_an_amd_gpu_is_not_taken_for_an_nvidia_one(monkeypatch, tmp_path):
    # the kernel is NVIDIA PTX: on a ROCm build of torch, auto picks the CPU and cuda is refused in one line (it was
    # taken, and the kernel's build failed)
    from nf4convert.devices import pick_device
    from nf4convert.errors import ArgumentError

    monkeypatch.setattr(torch.version, "hip", "6.2", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert pick_device("auto") == torch.device("cpu")
    with pytest.raises(
        ArgumentError,
        match=r"^device 'cuda': an AMD GPU \(ROCm\), where the kernel, written with NVIDIA's PTX, "
        r"cannot run; use cpu$",
    ):
        pick_device("cuda")
    example = Path(__file__).resolve().parents[1] / "examples" / "tiny-llama-bnb-4bit"
    line = run(example, "-o", tmp_path / "out", "--device", "cuda:0", code=2).strip()
    assert line.startswith("Error: device 'cuda:0': an AMD GPU (ROCm)") and not (tmp_path / "out").exists()


NO_TORCH = """
import sys
sys.modules["torch"] = None  # what an import of a missing module meets: any import of torch fails
from nf4convert.cli.commands import main
try:
    main(sys.argv[1:])
finally:
    assert sys.modules["torch"] is None, "torch was imported"
"""


@pytest.mark.parametrize("processes", ["0", "2"])
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_the_cpu_route_runs_without_torch(processes, dtype, tmp_path):
    # torch's import is seconds with a CUDA build: a 4-bit checkpoint on the CPU route (threads, or worker processes)
    # never imports it for bf16 or fp32 out, and gives the same bytes as a conversion in a process that has torch
    example = Path(__file__).resolve().parents[1] / "examples" / "tiny-llama-bnb-4bit"
    run(example, "-o", tmp_path / "with" / "out", "--device", "cpu", "--dtype", dtype)  # one name: the card's title
    for device in ("cpu", "auto"):
        out = tmp_path / f"without-{device}" / "out"
        env = {**os.environ, "NF4CONVERT_PROCESSES": processes}
        if device == "auto" and any(Path("/dev").glob("nvidia[0-9]*")):
            continue  # a GPU's driver: auto asks torch
        subprocess.run(
            [sys.executable, "-c", NO_TORCH, str(example), "-o", str(out), "--device", device, "--dtype", dtype, "-q"],
            check=True,
            timeout=300,
            env=env,
        )
        for name in ("model.safetensors", "config.json", "README.md"):
            assert (out / name).read_bytes() == (tmp_path / "with" / "out" / name).read_bytes(), name
    # fp16 out does take torch (its conversion: numpy's goes one element at a time): blocked, it fails, writing nothing
    if processes == "2" and dtype == "bf16":
        result = subprocess.run(
            [
                sys.executable,
                "-c",
                NO_TORCH,
                str(example),
                "-o",
                str(tmp_path / "fp16"),
                "--device",
                "cpu",
                "--dtype",
                "fp16",
                "-q",
            ],
            capture_output=True,
            text=True,
            timeout=300,
            env=env,
        )
        assert result.returncode != 0 and not (tmp_path / "fp16").exists()


def test_one_of_a_thing_is_counted_in_the_singular(tmp_path):
    """A shard of one tensor, one tensor checked: "1 tensor", never "1 tensors"."""
    from nf4convert.verification.report import VerifyReport, report_lines

    example = Path(__file__).resolve().parents[1] / "examples" / "tiny-llama-bnb-4bit"
    plan = run(example, "-o", tmp_path / "out", "--dry-run", "--max-shard-size", "1")  # a shard per tensor
    assert "  model-00001-of-00039.safetensors: 1 tensor, " in plan and "1 tensors" not in plan
    report = VerifyReport(tmp_path / "out", checked=1, compared_against={"lm_head.weight": "the source tensor"})
    assert report_lines(report)[0] == f"{tmp_path / 'out'}: 1 tensor checked on cpu (1 against its source tensor)"
