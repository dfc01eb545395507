"""FP8, compressed-tensors FP8 and MXFP4: our arithmetic bit for bit against the reference libraries (transformers'
integrations, compressed-tensors' decompressors) on real-architecture checkpoints and on random values with every
edge case, the checks' one-line errors, and the logits of the dense models."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from nf4convert.errors import CheckpointError
from nf4convert.formats import compressed_float, fp8, mxfp4
from nf4convert.safetensors_io.read import TensorInfo, TensorReader, read_tensors
from nf4convert.verification.reference import dequantize_fp8 as fp8_reference
from nf4convert.verification.reference import dequantize_mxfp4 as mxfp4_reference
from nf4convert.verification.reference.base import whole

from fixtures import float_checkpoints as fc

OUT = {"fp32": ("F32", torch.float32), "bf16": ("BF16", torch.bfloat16), "fp16": ("F16", torch.float16)}
BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}
# compressed-tensors is the reference of FP8 block scales and of compressed-tensors checkpoints (the test extra).
needs_compressed_tensors = pytest.mark.skipif(
    importlib.util.find_spec("compressed_tensors") is None,
    reason="needs compressed-tensors (pip install compressed-tensors)",
)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(BITS[a.dtype]), b.view(BITS[b.dtype]))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("float-checkpoints")
    built = {"gpt-oss": fc.build_mxfp4(root / "gpt-oss")}
    if importlib.util.find_spec("compressed_tensors") is None:
        return built
    for variant in fc.FP8_VARIANTS:
        built[variant] = fc.build_fp8(root / variant, variant)
    for variant in fc.COMPRESSED_VARIANTS:
        built[variant] = fc.build_compressed(root / variant, variant)
    return built


def quantization(folder: Path) -> dict:
    return json.loads((folder / "config.json").read_text())["quantization_config"]


def fp8_weights(folder: Path, reader) -> list:
    config = quantization(folder)
    tensors = read_tensors(folder)
    if config["quant_method"] == "fp8":
        assert fp8.Fp8Format.config_problem(config) is None
        return fp8.find_weights(tensors, reader, fp8.block_size(config), fp8.ue8m0(config))
    assert compressed_float.CompressedFloatFormat.reads_config(config)
    assert compressed_float.config_problem(config) is None
    return compressed_float.find_weights(tensors, reader, config)


def ours_fp8(weight, reader, out_dtype, max_rows: int, host: bool = False) -> torch.Tensor:
    """A weight dequantized piece by piece as its kind would, through the torch function or the CPU route's host."""
    import numpy as np

    from nf4convert.dtypes import DTYPES
    from nf4convert.kinds.dequantize_compressed_fp8 import DequantizeCompressedFp8
    from nf4convert.kinds.dequantize_fp8 import DequantizeFp8

    kind = DequantizeCompressedFp8 if weight.format == "compressed-tensors" else DequantizeFp8
    through = kind(weight).through  # the dtype the kind rounds the product to first, if any
    grid = weight.grid
    scales = reader.tensor(weight.scale).reshape(-1)
    out_code = next(code for code, dtype in OUT.values() if dtype == out_dtype)
    parts = []
    for first, count in grid.pieces(max_rows):
        begin, rows = grid.scale_span(first, count)
        piece_scales = scales[begin * grid.scale_columns : (begin + rows) * grid.scale_columns]
        codes = reader.read(weight.weight, first * grid.columns, count * grid.columns)
        if host:
            out = np.empty(count * grid.columns * out_dtype.itemsize, dtype=np.uint8)
            fp8.host(
                codes.numpy(),
                out,
                scales=piece_scales.contiguous().view(torch.uint8).numpy(),
                scale_code=weight.scale.dtype,
                code=weight.weight.dtype,
                grid=grid,
                first_row=first,
                out_code=out_code,
                through_code=through,
            )
            parts.append(torch.from_numpy(out).view(out_dtype))
        else:
            codes = codes.view(torch.float8_e4m3fn).reshape(count, grid.columns)
            within = DTYPES[through].torch if through else None
            parts.append(fp8.dequantize(codes, piece_scales, grid, first, out_dtype, within).reshape(-1))
    return torch.cat(parts).reshape(weight.shape) if parts else torch.empty(weight.shape, dtype=out_dtype)


def planned(weight, code: str, shape) -> SimpleNamespace:
    """What verify hands a reference: the output tensor (dtype, shape, bytes) and its recipe (read by duck typing)."""
    from nf4convert.dtypes import DTYPES

    nbytes = math.prod(shape) * DTYPES[code].itemsize
    return SimpleNamespace(recipe=SimpleNamespace(weight=weight), dtype=code, shape=tuple(shape), nbytes=nbytes)


class _Context:
    def __init__(self, module):
        self.module = module

    def slices(self, tensor, reader, device, piece_bytes):
        return self.module.slices(tensor, reader, device, self, piece_bytes)


@needs_compressed_tensors
@pytest.mark.parametrize("flag", list(OUT))
@pytest.mark.parametrize("variant", [*fc.FP8_VARIANTS, *fc.COMPRESSED_VARIANTS])
def test_fp8_checkpoints_bit_for_bit_against_references(checkpoints, variant, flag):
    code, out_dtype = OUT[flag]
    with TensorReader() as reader:
        weights = fp8_weights(checkpoints[variant], reader)
        assert len(weights) >= 7
        ragged = 0
        for number, weight in enumerate(weights):
            ours = ours_fp8(weight, reader, out_dtype, max_rows=(5, 32, 100, 1 << 20)[number % 4], host=number % 2)
            tensor = planned(weight, code, weight.shape)
            made = fp8_reference.slices(tensor, reader, "cpu", _Context(fp8_reference), 3000)
            reference = whole(tensor, reader, "cpu", SimpleNamespace(slices=lambda *a: made))
            assert same_bits(ours, reference), weight.name
            rows, columns = weight.shape[-2:]
            ragged += rows % weight.block[0] != 0 or columns % weight.block[1] != 0
        strategy = weights[0].strategy
        assert ragged or "whole" in variant or "block32" in variant or strategy != "block"


@needs_compressed_tensors
def test_fp8_weight_scale_names_and_static_activations(checkpoints):
    tensors = read_tensors(checkpoints["llama-fp8-tensor-static"])
    assert any(k.endswith(".input_scale") for k in tensors)
    assert all(fp8.is_quantization_key(k) for k in tensors if k.endswith((".input_scale", ".weight_scale")))
    with TensorReader() as reader:
        weights = fp8.find_weights(tensors, reader, None)
    assert {w.scale.name.rsplit(".", 1)[-1] for w in weights} == {"weight_scale"}
    assert {w.strategy for w in weights} == {"tensor"}
    index = json.loads((checkpoints["qwen3-fp8-block128-bf16"] / "model.safetensors.index.json").read_text())
    alone = [file for file in set(index["weight_map"].values()) if list(index["weight_map"].values()).count(file) == 1]
    assert alone and any(k.endswith("_scale_inv") and index["weight_map"][k] in alone for k in index["weight_map"])


@pytest.mark.parametrize("flag", list(OUT))
def test_mxfp4_gpt_oss_bit_for_bit_against_transformers(checkpoints, flag):
    code, out_dtype = OUT[flag]
    folder = checkpoints["gpt-oss"]
    assert mxfp4.Mxfp4Format.reads_config(quantization(folder))
    tensors = read_tensors(folder)
    weights = mxfp4.find_weights(tensors)
    assert [w.name.rsplit(".", 1)[-1] for w in weights] == ["down_proj", "gate_up_proj"] * 2
    with TensorReader() as reader:
        for weight in weights:
            ours = ours_mxfp4(weight, reader, out_dtype, max_values=(weight.rows * 32) * 1 + 5)
            tensor = planned(weight, code, weight.shape)
            made = mxfp4_reference.slices(tensor, reader, "cpu", None, 1 << 12)
            reference = whole(tensor, reader, "cpu", SimpleNamespace(slices=lambda *a: made))
            assert same_bits(ours, reference), weight.name


def ours_mxfp4(weight, reader, out_dtype, max_values: int) -> torch.Tensor:
    import numpy as np

    out = torch.empty(weight.shape, dtype=out_dtype)
    flat = out.view(-1).view(torch.uint8)
    scales = reader.tensor(weight.scales)
    out_code = next(code for code, dtype in OUT.values() if dtype == out_dtype)
    for number, piece in enumerate(weight.pieces(max_values)):
        first_expert, experts = piece[:2]
        first, count = mxfp4.source_bytes(weight, piece)
        blocks = reader.read(weight.blocks, first, count)
        piece_scales = scales[first_expert : first_expert + experts].contiguous()
        mxfp4.check_scales(weight.scales, piece_scales)
        offset, nbytes = mxfp4.output_bytes(weight, piece, out_dtype.itemsize)
        if number % 2:
            target = np.empty(nbytes, dtype=np.uint8)
            mxfp4.host(
                blocks.numpy(),
                target,
                scales=piece_scales.numpy(),
                rows=weight.rows,
                total_groups=weight.groups,
                first_group=piece[2],
                groups=piece[3],
                out_code=out_code,
            )
            flat[offset : offset + nbytes] = torch.from_numpy(target)
        else:
            dense = mxfp4.dequantize(
                blocks.view(experts, weight.rows, weight.groups, 16), piece_scales, out_dtype, piece[2], piece[3]
            )
            flat[offset : offset + nbytes] = dense.reshape(-1).view(torch.uint8)
    return out


# Random values, every code and edge case


def _random_codes(generator, shape) -> torch.Tensor:
    """FP8 codes drawing every byte: NaN (0x7f, 0xff), +-0, subnormals (0x01-0x07), the largest (0x7e)."""
    codes = torch.randint(0, 256, shape, dtype=torch.uint8, generator=generator)
    flat = codes.view(-1)
    flat[: min(256, flat.numel())] = torch.arange(min(256, flat.numel()), dtype=torch.uint8)
    return codes.view(torch.float8_e4m3fn)


def _random_scales(generator, shape, dtype) -> torch.Tensor:
    """Scales of every magnitude a writer could make, subnormal and tiny ones included, some negative."""
    exponent = torch.randint(-140, 20, shape, generator=generator).float()
    values = torch.exp2(exponent) * (1 + torch.rand(shape, generator=generator))
    values[..., 0] = torch.finfo(dtype).tiny / 4 if dtype != torch.float32 else 2.0**-140
    values = torch.where(torch.rand(shape, generator=generator) < 0.1, -values, values)
    return values.to(dtype)


@needs_compressed_tensors
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("flag", list(OUT))
def test_fp8_random_blocks_against_deepseek_rule_and_compressed_tensors(scale_dtype, flag):
    from compressed_tensors.entrypoints.convert.converters.fp8block_dequantizer import FP8BlockDequantizer

    _, out_dtype = OUT[flag]
    generator = torch.Generator().manual_seed(hash((flag, str(scale_dtype))) % 1000)
    for _ in range(6):
        block = tuple(int(v) for v in torch.randint(1, 40, (2,), generator=generator))
        lead = [int(v) for v in torch.randint(1, 4, (int(torch.randint(0, 2, (1,), generator=generator)),))]
        rows, columns = (int(v) for v in torch.randint(1, 130, (2,), generator=generator))
        codes = _random_codes(generator, (*lead, rows, columns))
        scale_shape = (*lead, -(-rows // block[0]), -(-columns // block[1]))
        scales = _random_scales(generator, scale_shape, scale_dtype)
        grid = fp8.Grid(math.prod(lead) * rows, columns, rows, *block)
        flat_codes, flat_scales = codes.reshape(-1, columns), scales.reshape(-1)
        pieces = []
        for first, count in grid.pieces(int(torch.randint(1, 90, (1,), generator=generator))):
            begin, span = grid.scale_span(first, count)
            piece_scales = flat_scales[begin * grid.scale_columns : (begin + span) * grid.scale_columns]
            pieces.append(fp8.dequantize(flat_codes[first : first + count], piece_scales, grid, first, out_dtype))
        ours = torch.cat(pieces).reshape(codes.shape)
        dequantizer = FP8BlockDequantizer(weight_block_size=block, dtype=out_dtype)
        matrices = codes.reshape(-1, rows, columns)
        reference = torch.stack(
            [
                dequantizer.process({"m.weight": matrix, "m.weight_scale_inv": scale})["m.weight"]
                for matrix, scale in zip(matrices, scales.reshape(-1, *scale_shape[-2:]))
            ]
        ).reshape(codes.shape)
        # DeepSeek's rule, written out: each code times its own block's scale in fp32, one rounding.
        expanded = scales.float().repeat_interleave(block[0], -2)[..., :rows, :].repeat_interleave(block[1], -1)
        rule = (codes.float() * expanded[..., :columns]).to(out_dtype)
        assert same_bits(ours, reference)
        assert same_bits(ours, rule)


@needs_compressed_tensors
@pytest.mark.parametrize("flag", list(OUT))
def test_fp8_e8m0_scales_every_byte_against_compressed_tensors_and_transformers(flag):
    """scale_fmt "ue8m0" block scales: every E8M0 byte but NaN's (0 is 2 ** -127, a subnormal), as float8_e8m0fnu
    and as uint8, on ragged blocks; the product is exact but below fp32's normal range."""
    from compressed_tensors.entrypoints.convert.converters.fp8block_dequantizer import FP8BlockDequantizer
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    _, out_dtype = OUT[flag]
    generator = torch.Generator().manual_seed(17)
    codes = _random_codes(generator, (255, 37))
    exponents = torch.arange(255, dtype=torch.uint8).view(255, 1)
    grid = fp8.Grid(255, 37, 255, 1, 37)
    stored = exponents.view(torch.float8_e8m0fnu)
    dequantizer = FP8BlockDequantizer(weight_block_size=(1, 37), dtype=out_dtype)
    reference = dequantizer.process({"m.weight": codes, "m.weight_scale_inv": stored})["m.weight"]
    for scales in (stored, exponents):
        ours = torch.cat(
            [fp8.dequantize(codes[f : f + 40], scales[f : f + 40], grid, f, out_dtype) for f in range(0, 255, 40)]
        )
        assert same_bits(ours, reference)
        # transformers' own reading of uint8 scales (2 ** (byte - 127)) and of float8_e8m0fnu ones
        assert same_bits(ours, Fp8Dequantize(None)._dequantize_one(codes, scales, output_dtype=out_dtype))
    blocks = fp8.Grid(255, 37, 255, 16, 16)
    scales = torch.randint(0, 255, (16, 3), generator=generator, dtype=torch.uint8)
    ours = fp8.dequantize(codes, scales, blocks, 0, out_dtype)
    dequantizer = FP8BlockDequantizer(weight_block_size=(16, 16), dtype=out_dtype)
    reference = dequantizer.process({"m.weight": codes, "m.weight_scale_inv": scales.view(torch.float8_e8m0fnu)})
    assert same_bits(ours, reference["m.weight"])


@pytest.mark.parametrize("flag", list(OUT))
def test_fp8_transformers_agrees_on_whole_blocks_and_misblocks_ragged_ones(flag):
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    _, out_dtype = OUT[flag]
    generator = torch.Generator().manual_seed(7)
    dequantize_one = Fp8Dequantize(None)._dequantize_one
    codes = _random_codes(generator, (96, 160))
    scales = _random_scales(generator, (3, 5), torch.float32).abs()
    grid = fp8.Grid(96, 160, 96, 32, 32)
    assert same_bits(fp8.dequantize(codes, scales, grid, 0, out_dtype), dequantize_one(codes, scales, out_dtype))
    # A [200, 300] weight in 128-blocks has 2 x 3 scales, which transformers reads as 100 x 100 blocks.
    codes = torch.randn(200, 300, generator=generator).to(torch.float8_e4m3fn)
    scales = torch.rand(2, 3, generator=generator) + 0.5
    ours = fp8.dequantize(codes, scales, fp8.Grid(200, 300, 200, 128, 128), 0, out_dtype)
    theirs = dequantize_one(codes, scales, out_dtype)
    assert (ours != theirs).sum().item() > 10_000
    with pytest.raises(ValueError, match="not divisible by scale grid"):  # DeepSeek V3's kv_a_proj_with_mqa
        dequantize_one(torch.zeros(576, 7168, dtype=torch.float8_e4m3fn), torch.ones(5, 56), out_dtype)


@needs_compressed_tensors
@pytest.mark.parametrize("strategy", ["tensor", "channel", "block"])
def test_compressed_random_values_all_dtypes(strategy):
    """Every output dtype from bf16 and fp16 scales against decompress then the cast (the product rounded to the
    scale's dtype first), and the exact product rounded once (the plain FP8 format's arithmetic) counted against it."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    generator = torch.Generator().manual_seed(3)
    rows, columns, block = 157, 203, (32, 48)
    codes = torch.randn(rows, columns, generator=generator).mul(30).to(torch.float8_e4m3fn)
    codes.view(torch.uint8).view(-1)[:256] = torch.arange(256, dtype=torch.uint8)
    shape = {"tensor": (1,), "channel": (rows, 1), "block": (-(-rows // 32), -(-columns // 48))}[strategy]
    args = QuantizationArgs(
        num_bits=8, type="float", strategy=strategy, block_structure=list(block) if strategy == "block" else None
    )
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    compressor = BaseCompressor.get_value_from_registry("float-quantized")
    grid = {
        "tensor": fp8.Grid(rows, columns, rows, rows, columns),
        "channel": fp8.Grid(rows, columns, rows, 1, columns),
        "block": fp8.Grid(rows, columns, rows, *block),
    }[strategy]
    for scale_dtype in (torch.bfloat16, torch.float16):
        scales = (torch.rand(shape, generator=generator) * 0.01 + 1e-4).to(scale_dtype)
        library = compressor.decompress({"weight": codes, "weight_scale": scales}, scheme)["weight"]
        exact = compressor.decompress({"weight": codes, "weight_scale": scales.float()}, scheme)["weight"]
        for out_dtype in BITS:
            ours = fp8.dequantize(codes, scales, grid, 0, out_dtype, scale_dtype)
            assert same_bits(ours, library.to(out_dtype)), (scale_dtype, out_dtype)
            once = fp8.dequantize(codes, scales, grid, 0, out_dtype)
            assert same_bits(once, exact.to(out_dtype))
            if out_dtype != scale_dtype:  # rounding twice differs from rounding once on some elements
                finite = ours.isfinite()
                assert (ours[finite] != once[finite]).sum().item() > 0, (scale_dtype, out_dtype)


def test_mxfp4_every_byte_and_every_scale_against_transformers():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    blocks = torch.arange(256, dtype=torch.uint8).repeat(2 * 256).view(2, 256, 16, 16)
    scales = torch.arange(256, dtype=torch.uint8).view(1, 256, 1).expand(2, 256, 16).contiguous()
    scales[1] = scales[1].flip(0)
    for out_dtype in BITS:
        reference = convert_moe_packed_tensors(blocks, scales, dtype=out_dtype)
        ours = mxfp4.dequantize(blocks, scales, out_dtype)
        assert same_bits(ours, reference)
        assert not ours.isnan().any()
        assert same_bits(mxfp4.dequantize(blocks, scales, out_dtype, 5, 7), reference[:, 160:384].contiguous())
    with pytest.raises(CheckpointError, match="E8M0 NaN"):
        mxfp4.check_scales(_info("x_scales", "U8", (1,)), scales)


def test_mxfp4_random_odd_shapes():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    generator = torch.Generator().manual_seed(11)
    for experts, rows, groups in ((1, 1, 1), (3, 7, 5), (2, 33, 3)):
        blocks = torch.randint(0, 256, (experts, rows, groups, 16), dtype=torch.uint8, generator=generator)
        scales = torch.randint(0, 256, (experts, rows, groups), dtype=torch.uint8, generator=generator)
        weight = mxfp4.WeightMxfp4("x", _info("x_blocks", "U8", blocks.shape), _info("x_scales", "U8", scales.shape))
        for out_dtype in BITS:
            reference = convert_moe_packed_tensors(blocks, scales, dtype=out_dtype)
            for max_values in (1, 40, rows * 32, rows * 32 * groups + 1, 1 << 20):
                out = torch.empty(weight.shape, dtype=out_dtype).view(-1).view(torch.uint8)
                for piece in weight.pieces(max_values):
                    e, m, g, n = piece
                    offset, nbytes = mxfp4.output_bytes(weight, piece, out_dtype.itemsize)
                    made = mxfp4.dequantize(blocks[e : e + m], scales[e : e + m], out_dtype, g, n)
                    out[offset : offset + nbytes] = made.reshape(-1).view(torch.uint8)
                assert same_bits(out.view(out_dtype).reshape(weight.shape), reference)


# The checks


def _info(name, dtype, shape, path="model.safetensors") -> TensorInfo:
    from nf4convert.dtypes import DTYPES

    nbytes = math.prod(shape) * DTYPES[dtype].itemsize
    return TensorInfo(name, dtype, tuple(shape), 0, nbytes, Path(path))


class _Scales:
    """A reader whose every scale is ``value``."""

    def __init__(self, value=1.0):
        self.value = value

    def tensor(self, info):
        return torch.full(info.shape, self.value)


def _fp8_error(tensors: dict, block=(128, 128), value=1.0) -> str:
    with pytest.raises(CheckpointError) as caught:
        fp8.find_weights({t.name: t for t in tensors.values()}, _Scales(value), block)
    message = str(caught.value)
    assert "\n" not in message
    return message


def test_fp8_checks_name_file_and_tensor():
    weight = _info("a.weight", "F8_E4M3", (200, 300), "w.safetensors")
    scale = _info("a.weight_scale_inv", "F32", (2, 3), "s.safetensors")
    assert fp8.find_weights({"a.weight": weight, "a.weight_scale_inv": scale}, _Scales(), (128, 128))
    message = _fp8_error({"a.weight": weight})
    assert "w.safetensors: tensor 'a.weight'" in message and "a.weight_scale_inv" in message
    message = _fp8_error({"a.weight_scale_inv": scale})
    assert "s.safetensors: tensor 'a.weight_scale_inv'" in message and "missing" in message
    message = _fp8_error({"a.weight": weight, "a.weight_scale_inv": _info("a.weight_scale_inv", "F32", (4, 3))})
    assert "[4, 3]" in message and "[2, 3]" in message and "weight_block_size" in message
    message = _fp8_error({"a.weight": weight, "a.weight_scale_inv": scale}, block=(64, 128))
    assert "[4, 3]" in message
    assert "NaN" in _fp8_error({"a.weight": weight, "a.weight_scale_inv": scale}, value=float("nan"))
    assert "NaN or infinite" in _fp8_error({"a.weight": weight, "a.weight_scale_inv": scale}, value=float("inf"))
    both = {"a.weight": weight, "a.weight_scale_inv": scale, "a.weight_scale": _info("a.weight_scale", "F32", (2, 3))}
    assert "both scale" in _fp8_error(both)
    assert "I8" in _fp8_error({"a.weight": _info("a.weight", "I8", (200, 300)), "a.weight_scale_inv": scale})
    assert "I32" in _fp8_error({"a.weight": weight, "a.weight_scale_inv": _info("a.weight_scale_inv", "I32", (2, 3))})
    message = _fp8_error({"a.weight": weight, "a.weight_scale": _info("a.weight_scale", "F32", (2, 3))}, block=None)
    assert "one scale" in message
    assert fp8.config_problem({"quant_method": "fp8", "weight_block_size": [128, 0]})
    assert fp8.config_problem({"quant_method": "fp8", "scale_fmt": "ue8m0"}) is None
    assert fp8.config_problem({"quant_method": "fp8", "scale_fmt": "e4m3"})
    ue8m0 = {"a.weight": weight, "a.weight_scale_inv": scale}
    for value in (0.75, 0.0, -2.0, float("inf"), float("nan"), 3.0):
        with pytest.raises(CheckpointError, match="a.weight_scale_inv' holds a scale that is not a power of two"):
            fp8.find_weights(ue8m0, _Scales(value), (128, 128), True)
    for value in (1.0, 2.0**-133, 2.0**127, 0.25):
        assert fp8.find_weights(ue8m0, _Scales(value), (128, 128), True)
    assert fp8.config_problem({"quant_method": "fp8", "weight_block_size": [128, 128]}) is None


@needs_compressed_tensors
def test_compressed_checks(checkpoints):
    config = quantization(checkpoints["qwen3-ct-fp8-block"])
    weight = _info("a.weight", "F8_E4M3", (100, 100))
    with pytest.raises(CheckpointError, match=r"tensor 'a.weight_scale' has shape \[100, 1\].*\[4, 3\]"):
        compressed_float.find_weights(
            {"a.weight": weight, "a.weight_scale": _info("a.weight_scale", "BF16", (100, 1))}, _Scales(), config
        )
    with pytest.raises(CheckpointError, match="asymmetric"):
        compressed_float.find_weights(
            {
                "a.weight": weight,
                "a.weight_scale": _info("a.weight_scale", "BF16", (4, 3)),
                "a.weight_zero_point": _info("a.weight_zero_point", "BF16", (4, 3)),
            },
            _Scales(),
            config,
        )
    with pytest.raises(CheckpointError, match="'a.weight' is F8_E4M3 without its scale 'a.weight_scale'"):
        compressed_float.find_weights({"a.weight": weight}, _Scales(), config)
    int4 = {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "config_groups": {"g": {"weights": {"num_bits": 4, "type": "int"}}},
    }
    assert not compressed_float.CompressedFloatFormat.reads_config(int4)
    grouped = json.loads(json.dumps(config))
    grouped["config_groups"]["group_0"]["weights"]["strategy"] = "group"
    assert "strategy 'group'" in compressed_float.config_problem(grouped)


def test_mxfp4_checks():
    blocks = _info("e.gate_up_proj_blocks", "U8", (2, 8, 3, 16), "b.safetensors")
    scales = _info("e.gate_up_proj_scales", "U8", (2, 8, 3), "s.safetensors")
    assert mxfp4.find_weights({"e.gate_up_proj_blocks": blocks, "e.gate_up_proj_scales": scales})[0].shape == (2, 96, 8)
    with pytest.raises(
        CheckpointError, match=r"b.safetensors: tensor 'e.gate_up_proj_blocks' .* 'e.gate_up_proj_scales' is missing"
    ):
        mxfp4.find_weights({"e.gate_up_proj_blocks": blocks})
    with pytest.raises(
        CheckpointError, match=r"model.safetensors: tensor 'e.gate_up_proj_scales' has shape \[2, 8, 4\]"
    ):
        mxfp4.find_weights(
            {"e.gate_up_proj_blocks": blocks, "e.gate_up_proj_scales": _info("e.gate_up_proj_scales", "U8", (2, 8, 4))}
        )
    with pytest.raises(CheckpointError, match="BF16, U8 expected"):
        mxfp4.find_weights(
            {
                "e.gate_up_proj_blocks": blocks,
                "e.gate_up_proj_scales": _info("e.gate_up_proj_scales", "BF16", (2, 8, 3)),
            }
        )
    with pytest.raises(CheckpointError, match=r"\[experts, rows, blocks, 16\]"):
        mxfp4.find_weights(
            {
                "e.gate_up_proj_blocks": _info("e.gate_up_proj_blocks", "U8", (8, 3, 16)),
                "e.gate_up_proj_scales": _info("e.gate_up_proj_scales", "U8", (8, 3)),
            }
        )


# The dense models: the reference's dequantization (transformers' dequantize=True) and ours give the same logits


def _dense_from_ours(folder: Path, weights: dict, quantization_keys) -> torch.nn.Module:
    """The model of ``folder``'s config (no quantization) holding our dequantized weights and the other tensors."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(folder)
    del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    state = {k: v for k, v in fc.read_state(folder).items() if not quantization_keys(k)}
    state.update(weights)
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and not [m for m in missing if m != "lm_head.weight" or "lm_head.weight" not in state]
    return model


def _logits(model) -> torch.Tensor:
    ids = torch.tensor([[1, 5, 77, 300, 2, 9, 120, 45, 8, 3, 250, 17]])
    with torch.no_grad():
        return model(ids).logits


@needs_compressed_tensors
@pytest.mark.parametrize("variant", ["qwen3-fp8-block32-f32", "qwen3-ct-fp8-block-whole", "qwen3-ct-fp8-channel"])
def test_fp8_dense_model_logits_equal_transformers_dequantize(checkpoints, variant):
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig, FineGrainedFP8Config

    folder = checkpoints[variant]
    if variant.startswith("qwen3-fp8"):
        config, keys = FineGrainedFP8Config(dequantize=True), fp8.is_quantization_key
    else:
        config, keys = CompressedTensorsConfig(dequantize=True), compressed_float.is_quantization_key
    reference = AutoModelForCausalLM.from_pretrained(folder, quantization_config=config, dtype=torch.bfloat16).eval()
    with TensorReader() as reader:
        ours = {w.name: ours_fp8(w, reader, torch.bfloat16, 64) for w in fp8_weights(folder, reader)}
    mine = _dense_from_ours(folder, ours, keys)
    parameters = dict(reference.named_parameters())
    for name, value in ours.items():
        assert same_bits(parameters[name].data, value), name
    assert torch.equal(_logits(reference), _logits(mine))


def test_gpt_oss_dense_model_logits_equal_transformers_dequantize(checkpoints):
    from transformers import AutoModelForCausalLM, Mxfp4Config

    folder = checkpoints["gpt-oss"]
    reference = AutoModelForCausalLM.from_pretrained(
        folder, quantization_config=Mxfp4Config(dequantize=True), dtype=torch.bfloat16
    ).eval()
    with TensorReader() as reader:
        ours = {w.name: ours_mxfp4(w, reader, torch.bfloat16, 1000) for w in mxfp4.find_weights(read_tensors(folder))}
    mine = _dense_from_ours(folder, ours, mxfp4.is_quantization_key)
    parameters = dict(reference.named_parameters())
    for name, value in ours.items():
        assert same_bits(parameters[name].data, value), name
    assert torch.equal(_logits(reference), _logits(mine))


# The CUDA path: the same bytes as the CPU's, and as the references on the GPU


@needs_compressed_tensors
@pytest.mark.gpu
def test_cuda_bytes_equal_cpu_and_references():
    from compressed_tensors.entrypoints.convert.converters.fp8block_dequantizer import FP8BlockDequantizer
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    generator = torch.Generator().manual_seed(5)
    codes = torch.randn(301, 517, generator=generator).mul(40).to(torch.float8_e4m3fn)
    for scale_dtype in (torch.float32, torch.bfloat16, torch.float16):
        scales = _random_scales(generator, (3, 5), scale_dtype)
        grid = fp8.Grid(301, 517, 301, 128, 128)
        for out_dtype in BITS:
            cpu = fp8.dequantize(codes, scales, grid, 0, out_dtype)
            gpu = fp8.dequantize(codes.cuda(), scales.cuda(), grid, 0, out_dtype)
            assert same_bits(gpu.cpu(), cpu)
            dequantizer = FP8BlockDequantizer(weight_block_size=(128, 128), dtype=out_dtype)
            reference = dequantizer.process({"m.weight": codes, "m.weight_scale_inv": scales})["m.weight"]
            assert same_bits(gpu.cpu(), reference)
            # the library on the GPU, on whole blocks (its padding of F8 tensors is a CPU matter here)
            whole_blocks = codes[:256, :512].cuda()
            on_gpu = dequantizer.process({"m.weight": whole_blocks, "m.weight_scale_inv": scales[:2, :4].cuda()})
            assert same_bits(gpu[:256, :512], on_gpu["m.weight"])
    # scale_fmt "ue8m0": one-byte E8M0 scales (every byte but NaN's), as float8_e8m0fnu and as uint8
    exponents = torch.randint(0, 255, (3, 5), generator=generator, dtype=torch.uint8)
    exponents[0, :3] = torch.tensor([0, 1, 254], dtype=torch.uint8)
    for scales in (exponents, exponents.view(torch.float8_e8m0fnu)):
        for out_dtype in BITS:
            cpu = fp8.dequantize(codes, scales, grid, 0, out_dtype)
            assert same_bits(fp8.dequantize(codes.cuda(), scales.cuda(), grid, 0, out_dtype).cpu(), cpu)
            dequantizer = FP8BlockDequantizer(weight_block_size=(128, 128), dtype=out_dtype)
            fp32 = exponents.view(torch.float8_e8m0fnu).float()
            reference = dequantizer.process({"m.weight": codes, "m.weight_scale_inv": fp32})["m.weight"]
            assert same_bits(cpu, reference)
    blocks = torch.arange(256, dtype=torch.uint8).repeat(256).view(1, 256, 16, 16).cuda()
    scales = torch.arange(256, dtype=torch.uint8).view(1, 256, 1).expand(1, 256, 16).contiguous().cuda()
    for out_dtype in BITS:
        gpu = mxfp4.dequantize(blocks, scales, out_dtype)
        assert same_bits(gpu.cpu(), mxfp4.dequantize(blocks.cpu(), scales.cpu(), out_dtype))
        # transformers' ldexp on CUDA for the E8M0 extremes is what this finds out; ours is exact by construction
        reference = convert_moe_packed_tensors(blocks, scales, dtype=out_dtype)
        usual = scales[..., None].expand(1, 256, 16, 32).reshape(1, 256, 512).transpose(1, 2)
        usual = (usual >= 2) & (usual <= 253)
        assert same_bits(gpu[usual], reference[usual])
