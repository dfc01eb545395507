"""ModelOpt checkpoints (``quant_method: "modelopt"``: NVFP4, FP8, and both in one MIXED_PRECISION checkpoint; the
config in config.json or in ``hf_quant_config.json`` alone), built by the documented layout: every output tensor bit
for bit ModelOpt's dequantization (``NVFP4QTensor`` / ``FP8QTensor.dequantize``: the library where nvidia-modelopt
imports, else the verify side's restatement, itself checked against the library where it imports) in every dtype,
through pieces that cut the rows; random codes and scales; the device computation the host's; transformers' load
and logits; a LoRA merged as peft merges it; GGUF; and bad input refused in one line, nothing written."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from test_float_convert import HostAsDevice

from nf4convert.dtypes import output_dtype
from nf4convert.formats import fp8, nvfp4
from nf4convert.pipeline.routes.cpu import CpuRoute
from nf4convert.plan import make_plan
from nf4convert.safetensors_io.read import TensorReader
from nf4convert.sinks.safetensors import write_shards
from nf4convert.verification.reference import dequantize_modelopt_fp8 as fp8_reference
from nf4convert.verification.reference import dequantize_modelopt_nvfp4 as nvfp4_reference

from fixtures import float_checkpoints as fc
from fixtures import modelopt_checkpoints as mc
from fixtures import nvfp4_checkpoints as nc
from fixtures.cli import cli, one_error_line

OUT = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}
CODES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
SEEDS = {variant: index for index, variant in enumerate(mc.VARIANTS)}


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(BITS[a.dtype]), b.view(BITS[b.dtype]))


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("modelopt-sources")
    return {variant: mc.build(root / variant, variant, seed=SEEDS[variant]) for variant in mc.VARIANTS}


@pytest.mark.parametrize("flag", list(OUT))
@pytest.mark.parametrize("variant", list(mc.VARIANTS))
def test_every_tensor_equals_modelopt(sources, variant, flag, tmp_path, monkeypatch):
    monkeypatch.setattr(CpuRoute, "piece_bytes", 3000)  # pieces of a few rows
    source, dtype = sources[variant], OUT[flag]
    out = tmp_path / "out"
    cli(source, "-o", out, "--dtype", flag, "--device", "cpu", "-q")
    got, state = fc.read_state(out), fc.read_state(source)
    reference = mc.reference_weights(source, dtype)
    assert reference
    dropped = {k for k in state if k.rsplit(".", 1)[1] in ("input_scale", "k_scale", "v_scale")}
    parts = {k for k in state if k.rsplit(".", 1)[1] in ("weight_scale", "weight_scale_2")}
    plain = {k: v for k, v in state.items() if k not in reference and k not in dropped | parts}
    assert got.keys() == reference.keys() | plain.keys()
    for name, value in reference.items():
        assert same_bits(got[name], value), name
    for name, value in plain.items():
        assert same_bits(got[name], value.to(dtype)), name
    assert not (out / "hf_quant_config.json").exists()
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config and config["dtype"] == str(dtype).removeprefix("torch.")
    assert "ModelOpt" in (out / "README.md").read_text()


def test_verify_and_dry_run(sources, tmp_path):
    source = sources["qwen3-modelopt-mixed"]
    output = cli(source, "-o", tmp_path / "out", "--device", "cpu", "--verify")
    assert "NVFP4QTensor.dequantize" in output and "FP8QTensor.dequantize" in output and "OK: bit-exact" in output
    plan = cli(sources["qwen3-modelopt-nvfp4-side"], "--dry-run")
    assert "dequantized from NVFP4" in plan and "modelopt-nvfp4" in plan


def _random_nvfp4(generator, rows: int, groups: int):
    packed = torch.randint(0, 256, (rows, groups * 8), dtype=torch.uint8, generator=generator)
    packed.view(-1)[:256] = torch.arange(256, dtype=torch.uint8)[: packed.numel()]
    scales = torch.randint(0, 256, (rows, groups), dtype=torch.uint8, generator=generator)
    scales[torch.isin(scales, torch.tensor(nvfp4.NAN_SCALES, dtype=torch.uint8))] = 0x3F
    scales.view(-1)[:8] = torch.tensor([0, 1, 7, 8, 0x7E, 0x80, 0x81, 0xFE], dtype=torch.uint8)[: scales.numel()]
    return packed, scales.view(torch.float8_e4m3fn)


SCALES_2 = (1.7e-4, 1.0, 3.0e-30, 7.5e30, -2.0, 1e-45)


@pytest.mark.parametrize("flag", list(OUT))
def test_random_nvfp4_codes_and_scales_against_modelopt(flag):
    """Every code byte (nibble 8 is +0.0 in ModelOpt's table), every finite E4M3 scale, tensor scales tiny, huge,
    negative and subnormal, odd rows and odd numbers of groups, cut into pieces; the torch function and the host."""
    import numpy as np

    dtype = OUT[flag]
    generator = torch.Generator().manual_seed(11)
    for value in SCALES_2:
        rows, groups = (int(v) for v in torch.randint(1, 40, (2,), generator=generator))
        packed, scales = _random_nvfp4(generator, rows, groups)
        scale_2 = torch.tensor(value, dtype=torch.float32)
        reference = mc.library_nvfp4(packed, scales, scale_2, dtype)
        cut = int(torch.randint(1, rows + 1, (1,), generator=generator))
        pieces = [
            nvfp4.dequantize(packed[f : f + cut], scales[f : f + cut], scale_2, dtype, multiply=True)
            for f in range(0, rows, cut)
        ]
        assert same_bits(torch.cat(pieces), reference), value
        out = np.empty(rows * groups * 16 * dtype.itemsize, dtype=np.uint8)
        bytes_ = scales.view(torch.uint8).numpy()
        nvfp4.host(
            packed.numpy().reshape(-1), out, scales=bytes_, global_scale=value, out_code=CODES[dtype], multiply=True
        )
        assert same_bits(torch.from_numpy(out).view(dtype).view(rows, -1), reference), value


def _random_fp8(generator, rows: int, columns: int):
    codes = torch.randint(0, 256, (rows, columns), dtype=torch.uint8, generator=generator)
    codes[(codes & 0x7F) == 0x7F] = 0x3C  # no NaN codes: their bits differ by device
    codes.view(-1)[:128] = torch.arange(128, dtype=torch.uint8)[: codes.numel()]
    return codes.view(torch.float8_e4m3fn)


def _ours_fp8(codes, scale, dtype):
    """What the ModelOpt FP8 kind computes: FP8's arithmetic on the scale rounded to the output dtype."""
    rows, columns = codes.shape
    grid = fp8.Grid(rows, columns, rows, rows, columns)
    return fp8.dequantize(codes, scale.to(dtype).reshape(1), grid, 0, dtype)


@pytest.mark.parametrize("flag", list(OUT))
def test_random_fp8_codes_against_modelopt(flag):
    """Every non-NaN code, scales that are no bf16 or fp16 value, tiny and large: the scale rounded to the output
    dtype first, as ModelOpt's multiply in that dtype does."""
    dtype = OUT[flag]
    generator = torch.Generator().manual_seed(5)
    for value in (0.0123456789, 1.0 / 448, 3.3e-7, 123.456, 1e-40):
        rows, columns = (int(v) for v in torch.randint(1, 60, (2,), generator=generator))
        codes = _random_fp8(generator, rows, columns)
        scale = torch.tensor(value, dtype=torch.float32)
        assert same_bits(_ours_fp8(codes, scale, dtype), mc.library_fp8(codes, scale, dtype)), value


def test_the_restatements_equal_modelopt_itself():
    """Where nvidia-modelopt imports, the verify side's restatements give the library's bytes."""
    if nvfp4_reference.library() is None or fp8_reference.library() is None:
        pytest.skip("nvidia-modelopt is not installed")
    generator = torch.Generator().manual_seed(17)
    for dtype in OUT.values():
        for value in SCALES_2:
            packed, scales = _random_nvfp4(generator, 37, 11)
            scale_2 = torch.tensor(value, dtype=torch.float32)
            restated = nvfp4_reference.restated(packed, scales, scale_2, dtype)
            assert same_bits(restated, mc.library_nvfp4(packed, scales, scale_2, dtype))
        codes = _random_fp8(generator, 29, 45)
        scale = torch.tensor(0.0123456789)
        library = fp8_reference.library()(codes.shape, dtype, codes).dequantize(dtype=dtype, scale=scale)
        assert same_bits(codes.to(dtype) * scale.to(dtype), library)


def test_the_device_computation_gives_the_host_bytes(sources, tmp_path):
    for variant in ("qwen3-modelopt-mixed", "qwen3-modelopt-fp8"):
        for flag in OUT:
            plan = make_plan(sources[variant], dtype=output_dtype(flag))
            device, host = tmp_path / f"{variant}-device-{flag}", tmp_path / f"{variant}-host-{flag}"
            device.mkdir()
            host.mkdir()
            with TensorReader() as reader:
                with HostAsDevice() as route:
                    write_shards(plan, device, reader, route, progress=lambda n: None)
                    assert route.on_device > plan.n_dequantized
                with CpuRoute(processes=1) as route:
                    route.piece_bytes = 7000
                    write_shards(plan, host, reader, route, progress=lambda n: None)
            made, expected = fc.read_state(device), fc.read_state(host)
            assert made.keys() == expected.keys()
            assert all(same_bits(made[name], expected[name]) for name in expected), (variant, flag)


def _logits(model) -> torch.Tensor:
    ids = torch.tensor([[1, 5, 77, 300, 2, 9, 120, 45, 8, 3, 250, 17]])
    with torch.no_grad():
        return model(ids).logits.float()


def test_transformers_loads_the_output_with_the_logits_of_modelopts_dequantization(sources, tmp_path):
    from transformers import AutoModelForCausalLM

    variant = "qwen3-modelopt-mixed"
    out = tmp_path / "out"
    cli(sources[variant], "-o", out, "--device", "cpu", "-q")
    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert all(not keys for keys in info.values()), info
    reference = mc.dense_reference(sources[variant], torch.bfloat16)
    loaded = model.state_dict()
    for name, value in reference.state_dict().items():
        assert same_bits(loaded[name], value), name
    assert torch.equal(_logits(model.eval()), _logits(reference))


@pytest.mark.parametrize("flag", ["bf16", "fp32"])
def test_lora_merges_as_peft_on_modelopts_dense_base(sources, tmp_path, flag):
    pytest.importorskip("peft")
    from peft import PeftModel

    variant, dtype = "qwen3-modelopt-mixed", OUT[flag]
    adapter = nc.make_adapter(
        tmp_path / "adapter", 5, r=4, lora_alpha=8, target_modules=["q_proj", "up_proj", "down_proj"]
    )
    out = tmp_path / "out"
    assert "OK: bit-exact" in cli(
        sources[variant], "--adapter", adapter, "-o", out, "--dtype", flag, "--device", "cpu", "--verify"
    )
    base = mc.dense_reference(sources[variant], dtype)
    merged = PeftModel.from_pretrained(base, adapter).merge_and_unload().state_dict()
    ours = fc.read_state(out)
    assert ours.keys() == merged.keys()
    for name, value in merged.items():
        assert same_bits(ours[name], value), name


def test_gguf(sources, tmp_path, monkeypatch):
    pytest.importorskip("conversion")
    from test_gguf import assert_same_gguf, converter, dense, pre_tokenizer

    from fixtures.trained_tokenizers import byte_bpe_tokenizer

    source = tmp_path / "tiny-qwen3-modelopt-nvfp4"
    shutil.copytree(sources["qwen3-modelopt-nvfp4-side"], source)
    byte_bpe_tokenizer(source, vocab_size=384)
    pre_tokenizer(monkeypatch, "gpt-2")
    expected = converter(dense(source, tmp_path / "dense", "bf16"), "bf16", tmp_path / "expected.gguf", monkeypatch)
    ours = tmp_path / "ours.gguf"
    cli(source, "-o", ours, "--gguf-type", "bf16", "-q", "--device", "cpu")
    assert_same_gguf(expected, ours)


# --- bad input: one line naming the tensor or setting, nothing written ---------------------------------------------


def edited(source: Path, folder: Path, edit) -> Path:
    shutil.copytree(source, folder)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    config = json.loads((folder / "config.json").read_text())
    state = fc.read_state(folder)
    edit(state, config["quantization_config"])
    (folder / "config.json").write_text(json.dumps(config))
    files = sorted({*index["weight_map"].values()})
    shards = {file: {} for file in files}
    for name, value in state.items():
        shards[index["weight_map"].get(name, files[-1])][name] = value.contiguous()
    for file, tensors in shards.items():
        save_file(tensors, folder / file, metadata={"format": "pt"})
    index["weight_map"] = {name: file for file, tensors in shards.items() for name in tensors}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return folder


LAYER = "model.layers.0.mlp.up_proj"  # NVFP4 [176, 80] in the mixed checkpoint
FP8_LAYER = "model.layers.0.self_attn.q_proj"


def _set(name: str, value):
    def edit(state, quantization):
        state[name] = value(state[name])

    return edit


def _nan_scale(scale):
    scale = scale.view(torch.uint8).clone()
    scale[3, 2] = 0x7F
    return scale.view(torch.float8_e4m3fn)


def _config(**changes):
    def edit(state, quantization):
        quantization.update(changes)

    return edit


def _listed_as(layer: str, algo: str):
    def edit(state, quantization):
        quantization["quantized_layers"][layer] = {"quant_algo": algo}

    return edit


def _add(name: str, value):
    def edit(state, quantization):
        state[name] = value

    return edit


W, S, S2 = f"{LAYER}.weight", f"{LAYER}.weight_scale", f"{LAYER}.weight_scale_2"
CASES = {
    "packed of the wrong size": (_set(W, lambda v: v[:, :-8]), f"'{S}' is F8_E4M3"),
    "packed of part groups": (_set(W, lambda v: v[:, :-1]), "holds 78 values a row, not whole groups"),
    "packed not U8": (_set(W, lambda v: v.view(torch.int8)), f"'{W}' is I8"),
    "scale of the wrong shape": (_set(S, lambda v: v[:-1]), "takes F8_E4M3 [176, 5]"),
    "scale of the wrong dtype": (_set(S, lambda v: v.to(torch.bfloat16)), "is BF16 [176, 5]"),
    "NaN scale": (_set(S, _nan_scale), f"'{S}' holds a NaN scale"),
    "NaN scale_2": (_set(S2, lambda v: v * float("nan")), "global scale must be finite and nonzero"),
    "inf scale_2": (_set(S2, lambda v: v * float("inf")), "global scale must be finite and nonzero"),
    "zero scale_2": (_set(S2, lambda v: v * 0), f"'{S2}' is 0.0"),
    "scale_2 of the wrong dtype": (_set(S2, lambda v: v.to(torch.bfloat16)), "not F32 [] or F32 [1]"),
    "scale_2 of the wrong shape": (_set(S2, lambda v: v.reshape(1, 1)), "is F32 [1, 1], not F32 []"),
    "missing scale": (lambda state, q: state.pop(S), f"has no '{S}' beside it"),
    "missing scale_2": (lambda state, q: state.pop(S2), f"tensor '{W}' is U8 (packed NVFP4 codes?) without"),
    "unread algorithm": (_config(quant_algo="NVFP4_AWQ"), "quant_algo 'NVFP4_AWQ', which is not read"),
    "unread layer algorithm": (_listed_as(LAYER, "INT4_AWQ"), "MIXED_PRECISION layers of quant_algo ['INT4_AWQ']"),
    "NVFP4 codes of an FP8 layer": (_listed_as(LAYER, "FP8"), f"layer '{LAYER}' is FP8"),
    "FP8 codes of an NVFP4 layer": (_listed_as(FP8_LAYER, "NVFP4"), f"layer '{FP8_LAYER}' is NVFP4"),
    "group size": (_config(group_size=32), "NVFP4 group_size 32"),
    "AWQ scale": (_add(f"{LAYER}.pre_quant_scale", torch.ones(80)), "is an AWQ pre-quantization scale"),
    "FP8 NaN scale": (_set(f"{FP8_LAYER}.weight_scale", lambda v: v * float("nan")), "holds a NaN or infinite scale"),
    "FP8 scale not F32": (_set(f"{FP8_LAYER}.weight_scale", lambda v: v.to(torch.bfloat16)), "scales are F32"),
    "FP8 without its scale": (lambda state, q: state.pop(f"{FP8_LAYER}.weight_scale"), "without its scale"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_refused_in_one_line(sources, tmp_path, case):
    edit, expected = CASES[case]
    bad = edited(sources["qwen3-modelopt-mixed"], tmp_path / "bad", edit)
    out = tmp_path / "out"
    line = one_error_line(cli(bad, "-o", out, "--device", "cpu", "-q", code=1))
    assert expected in line, line
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["bad"]


def test_a_side_config_without_its_quantization_is_refused(sources, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(sources["qwen3-modelopt-nvfp4-side"], bad)
    (bad / "hf_quant_config.json").write_text(json.dumps({"producer": {"name": "modelopt"}}))
    line = one_error_line(cli(bad, "-o", tmp_path / "out", "--device", "cpu", "-q", code=1))
    assert "hf_quant_config.json: has no 'quantization' object" in line, line
    assert not (tmp_path / "out").exists()


@pytest.mark.gpu
def test_cuda_bytes_equal_the_host_and_modelopt():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    generator = torch.Generator().manual_seed(3)
    for value in SCALES_2:
        packed, scales = _random_nvfp4(generator, 301, 37)
        scale_2 = torch.tensor(value, dtype=torch.float32)
        codes = _random_fp8(generator, 203, 77)
        for dtype in BITS:
            cpu = nvfp4.dequantize(packed, scales, scale_2, dtype, multiply=True)
            gpu = nvfp4.dequantize(packed.cuda(), scales.view(torch.uint8).cuda(), scale_2.cuda(), dtype, multiply=True)
            assert same_bits(gpu.cpu(), cpu)
            assert same_bits(gpu, mc.library_nvfp4(packed.cuda(), scales.cuda(), scale_2.cuda(), dtype))
            fp8_scale = torch.tensor(abs(value) % 7 or 0.37, dtype=torch.float32)
            on_cpu = _ours_fp8(codes, fp8_scale, dtype)
            on_gpu = _ours_fp8(codes.cuda(), fp8_scale.cuda(), dtype)
            assert same_bits(on_gpu.cpu(), on_cpu)
            assert same_bits(on_gpu, mc.library_fp8(codes.cuda(), fp8_scale.cuda(), dtype))
