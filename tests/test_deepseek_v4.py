"""DeepSeek-V4 (block FP8 with E8M0 scales named ``X.scale``, per-expert FP4 experts: I8 two E2M1 codes a byte, an
E8M0 scale per 32) on a small V4-shaped checkpoint: every output tensor bit for bit its reference (transformers'
``Fp8Dequantize`` for the experts, compressed-tensors' ``FP8BlockDequantizer`` for the FP8 weights) in every dtype,
through pieces that cut the rows; transformers loads the output as the dense model with the state and logits of its
own ``FineGrainedFP8Config(dequantize=True)`` load of the source; the experts' values those of DeepSeek's
``inference/convert.py`` cast; random codes and scales; the device computation the host's; bad input refused in one
line, nothing written."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import save_file
from test_float_convert import HostAsDevice

from nf4convert.dtypes import output_dtype
from nf4convert.formats import deepseek_fp4
from nf4convert.pipeline.routes.cpu import CpuRoute
from nf4convert.plan import make_plan
from nf4convert.safetensors_io.read import TensorReader
from nf4convert.sinks.safetensors import write_shards

from fixtures import deepseek_v4_checkpoints as dc
from fixtures import float_checkpoints as fc
from fixtures.cli import cli, one_error_line

OUT = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}
CODES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype not in BITS:
        return a.dtype == b.dtype and torch.equal(a, b)
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(BITS[a.dtype]), b.view(BITS[b.dtype]))


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return dc.build(tmp_path_factory.mktemp("deepseek-v4") / "tiny-v4")


def transformers_fp4(packed, scale, dtype):
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    return Fp8Dequantize(None)._dequantize_one(packed, scale, output_dtype=dtype)


def block_fp8(codes, scale, dtype):
    from compressed_tensors.entrypoints.convert.converters.fp8block_dequantizer import FP8BlockDequantizer

    dequantizer = FP8BlockDequantizer(weight_block_size=(128, 128), dtype=dtype)
    state = {"x.weight": codes, "x.weight_scale_inv": scale.to(torch.float32)}
    return dequantizer.process(state)["x.weight"]


@pytest.mark.parametrize("flag", list(OUT))
def test_every_tensor_equals_its_reference(source, flag, tmp_path, monkeypatch):
    monkeypatch.setattr(CpuRoute, "piece_bytes", 3000)  # pieces of a few rows
    dtype = OUT[flag]
    out = tmp_path / "out"
    cli(source, "-o", out, "--dtype", flag, "--device", "cpu", "-q")
    got, state = fc.read_state(out), fc.read_state(source)
    scales = {k for k in state if k.endswith(".scale") and k[: -len("scale")] + "weight" in state}
    assert got.keys() == state.keys() - scales
    fp4 = fp8 = 0
    for name, value in state.items():
        if name in scales:
            continue
        scale = state.get(name[: -len("weight")] + "scale")
        if value.dtype == torch.int8:
            fp4 += 1
            assert same_bits(got[name], transformers_fp4(value, scale, dtype)), name
        elif value.dtype == torch.float8_e4m3fn:
            fp8 += 1
            assert same_bits(got[name], block_fp8(value, scale, dtype)), name
        elif value.dtype == torch.float32:  # kept fp32, as an FP8 release's fp32 tensors are
            assert same_bits(got[name], value), name
        elif value.is_floating_point():
            assert same_bits(got[name], value.to(dtype)), name
        else:
            assert torch.equal(got[name], value), name
    assert fp4 == 19 and fp8 == 17  # the experts of both layers and the MTP layer; attention, shared experts
    assert "quantization_config" not in json.loads((out / "config.json").read_text())


def test_verify_and_dry_run(source, tmp_path):
    output = cli(source, "-o", tmp_path / "out", "--device", "cpu", "--verify")
    assert "transformers (Fp8Dequantize)" in output and "OK: bit-exact" in output
    plan = cli(source, "--dry-run")
    assert "dequantized from FP4" in plan and "dequantized from FP8" in plan


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([[1, 5, 7, 9, 3, 2, 8, 11, 40, 63]])).logits.float()


def test_transformers_loads_the_output_as_its_own_dequantized_load(source, tmp_path):
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    out = tmp_path / "out"
    cli(source, "-o", out, "--device", "cpu", "-q")
    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert all(not keys for keys in info.values()), info
    config = FineGrainedFP8Config(dequantize=True)
    reference = AutoModelForCausalLM.from_pretrained(source, quantization_config=config, dtype=torch.bfloat16)
    loaded, expected = model.state_dict(), reference.state_dict()
    assert loaded.keys() == expected.keys()
    for name, value in expected.items():
        assert value.dtype == loaded[name].dtype and torch.equal(loaded[name], value), name
    assert torch.equal(_logits(model.eval()), _logits(reference.eval()))


def maker_cast_e2m1fn_to_e4m3fn(x: torch.Tensor, scale: torch.Tensor):
    """DeepSeek-V4's ``inference/convert.py: cast_e2m1fn_to_e4m3fn``, restated statement by statement: the FP4 codes
    decoded by its FP4_TABLE, each 128 x 128 tile re-scaled to E4M3 with one E8M0 scale."""
    table = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
    out_dim, in_dim = x.size(0), x.size(1) * 2
    x = x.view(torch.uint8)
    x = torch.stack([table[(x & 0x0F).long()], table[((x >> 4) & 0x0F).long()]], dim=-1).flatten(1)
    b_out, b_in = out_dim // 128, in_dim // 128
    x = x.view(b_out, 128, b_in, 128).transpose(1, 2)
    scale = scale.float().view(b_out, 128, b_in, -1).transpose(1, 2).flatten(2)
    tile_scale = scale.amax(dim=-1, keepdim=True) / 2**6
    offset = (scale / tile_scale).unflatten(-1, (128, -1)).repeat_interleave(32, dim=-1)
    x = (x * offset).transpose(1, 2).reshape(out_dim, in_dim)
    return x.to(torch.float8_e4m3fn), tile_scale.squeeze(-1).to(torch.float8_e8m0fnu)


def test_the_values_are_those_of_deepseeks_convert(source):
    """Where the maker's cast to E4M3 is lossless (each tile's scales within 2 ** 6 of its largest), its codes times
    its tile scales are our fp32 values (equal as numbers: its table's zero is +0.0)."""
    generator = torch.Generator().manual_seed(7)
    packed = torch.randint(-128, 128, (256, 128), dtype=torch.int8, generator=generator)
    scale = torch.randint(120, 127, (256, 8), dtype=torch.uint8, generator=generator).view(torch.float8_e8m0fnu)
    codes, tile = maker_cast_e2m1fn_to_e4m3fn(packed, scale)
    maker = codes.float() * tile.float().repeat_interleave(128, 0).repeat_interleave(128, 1)
    ours = deepseek_fp4.dequantize(packed, scale, torch.float32)
    assert torch.equal(ours, maker)
    assert (ours == 0).any() and not torch.equal(ours.view(torch.int32), maker.view(torch.int32))  # -0.0 vs +0.0


def _random_fp4(generator, rows: int, groups: int):
    packed = torch.randint(-128, 128, (rows, groups * 16), dtype=torch.int8, generator=generator)
    packed.view(-1)[:256] = torch.arange(-128, 128, dtype=torch.int8)[: packed.numel()]
    scales = torch.randint(0, 255, (rows, groups), dtype=torch.uint8, generator=generator)
    scales.view(-1)[:6] = torch.tensor([0, 1, 100, 127, 200, 254], dtype=torch.uint8)[: scales.numel()]
    return packed, scales


@pytest.mark.parametrize("flag", list(OUT))
def test_random_codes_and_scales_against_transformers(flag):
    """Every code byte and every finite E8M0 byte (2 ** -127 to 2 ** 127: subnormal, overflowing bf16 and fp16 and
    fp32), odd rows and odd numbers of groups, cut into pieces; the torch function and the CPU route's host."""
    import numpy as np

    dtype = OUT[flag]
    generator = torch.Generator().manual_seed(13)
    for _ in range(4):
        rows, groups = (int(v) for v in torch.randint(1, 30, (2,), generator=generator))
        packed, scales = _random_fp4(generator, rows, groups)
        reference = transformers_fp4(packed, scales.view(torch.float8_e8m0fnu), dtype)
        cut = int(torch.randint(1, rows + 1, (1,), generator=generator))
        pieces = [deepseek_fp4.dequantize(packed[f : f + cut], scales[f : f + cut], dtype) for f in range(0, rows, cut)]
        assert same_bits(torch.cat(pieces), reference)
        out = np.empty(rows * groups * 32 * dtype.itemsize, dtype=np.uint8)
        deepseek_fp4.host(packed.numpy().reshape(-1), out, scales=scales.numpy(), out_code=CODES[dtype])
        assert same_bits(torch.from_numpy(out).view(dtype).view(rows, -1), reference)


def test_the_device_computation_gives_the_host_bytes(source, tmp_path):
    for flag in OUT:
        plan = make_plan(source, dtype=output_dtype(flag))
        device, host = tmp_path / f"device-{flag}", tmp_path / f"host-{flag}"
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
        assert all(same_bits(made[name], expected[name]) for name in expected), flag


# --- bad input: one line naming the tensor, nothing written ----------------------------------------------------------


EXPERT = "model.layers.1.ffn.experts.2.w2"  # [256, 96]: I8 [256, 48], scale [256, 3]
FP8 = "model.layers.0.attn.wq_a"


def edited(source, folder, edit):
    shutil.copytree(source, folder)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    state = fc.read_state(folder)
    edit(state)
    files = sorted({*index["weight_map"].values()})
    shards = {file: {} for file in files}
    for name, value in state.items():
        shards[index["weight_map"].get(name, files[-1])][name] = value.contiguous()
    for file, tensors in shards.items():
        save_file(tensors, folder / file, metadata={"format": "pt"})
    index["weight_map"] = {name: file for file, tensors in shards.items() for name in tensors}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return folder


def _set(name: str, value):
    def edit(state):
        state[name] = value(state[name])

    return edit


def _nan_byte(scale):
    scale = scale.view(torch.uint8).clone()
    scale.view(-1)[-1] = 255
    return scale.view(torch.float8_e8m0fnu)


CASES = {
    "packed of the wrong size": (_set(f"{EXPERT}.weight", lambda v: v[:, :-16]), "takes F8_E8M0 [256, 2]"),
    "packed of part groups": (_set(f"{EXPERT}.weight", lambda v: v[:, :-1]), "with in a multiple of 32"),
    "scale of the wrong shape": (_set(f"{EXPERT}.scale", lambda v: v[:-1]), "is F8_E8M0 [255, 3], but"),
    "scale of the wrong dtype": (_set(f"{EXPERT}.scale", lambda v: v.float()), "is F32 [256, 3], but"),
    "an E8M0 NaN expert scale": (_set(f"{EXPERT}.scale", _nan_byte), f"'{EXPERT}.scale' holds the E8M0 byte 255"),
    "an E8M0 NaN FP8 scale": (_set(f"{FP8}.scale", _nan_byte), f"'{FP8}.scale' holds the E8M0 byte 255"),
    "an FP8 weight without its scale": (lambda state: state.pop(f"{FP8}.scale"), f"'{FP8}.weight' is F8_E4M3 without"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_refused_in_one_line(source, tmp_path, case):
    edit, expected = CASES[case]
    bad = edited(source, tmp_path / "bad", edit)
    out = tmp_path / "out"
    line = one_error_line(cli(bad, "-o", out, "--device", "cpu", "-q", code=1))
    assert expected in line, line
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["bad"]


@pytest.mark.gpu
def test_cuda_bytes_equal_the_host_and_transformers():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    generator = torch.Generator().manual_seed(3)
    packed, scales = _random_fp4(generator, 301, 37)
    for dtype in BITS:
        cpu = deepseek_fp4.dequantize(packed, scales, dtype)
        gpu = deepseek_fp4.dequantize(packed.cuda(), scales.cuda(), dtype)
        assert same_bits(gpu.cpu(), cpu)
        assert same_bits(gpu, transformers_fp4(packed.cuda(), scales.view(torch.float8_e8m0fnu).cuda(), dtype))
