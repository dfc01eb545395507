"""The 8-bit (LLM.int8) format: finding the weights of real checkpoints, exact dequantization, one-line errors."""

import dataclasses
import random

import pytest
import torch

from nf4convert.errors import CheckpointError
from nf4convert.formats import bnb8
from nf4convert.safetensors_io.read import TensorReader, read_header, read_tensors

from fixtures.checkpoints8 import VARIANTS, build, model_class
from fixtures.weights import OUT_DTYPES, bits

bitsandbytes = pytest.importorskip("bitsandbytes")
F = pytest.importorskip("bitsandbytes.functional")

CUDA = torch.cuda.is_available()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("bnb8")
    return {variant: build(root / variant, variant, seed=index) for index, variant in enumerate(VARIANTS)}


@pytest.fixture
def reader():
    reader = TensorReader()
    yield reader
    reader.close()


def random_int8(rows, columns, generator, device="cpu"):
    """Codes over the whole int8 range: 0, and -128 (bitsandbytes never writes it, but it is an int8 all the same)."""
    return torch.randint(-128, 128, (rows, columns), generator=generator, dtype=torch.int8).to(device)


def random_scb(rows, generator):
    """Row scales as bitsandbytes writes them (fp16 absmaxes) mixed with extremes: tiny ones whose products
    are fp32 subnormals, huge ones whose products overflow, zeros, and arbitrary fp32 bit patterns."""
    scb = (torch.rand(rows, generator=generator) * 4).half().float()
    kind = torch.randint(0, 6, (rows,), generator=generator)
    scb[kind == 1] = torch.empty(rows).uniform_(1e-41, 1e-36, generator=generator)[kind == 1]
    scb[kind == 2] = torch.empty(rows).uniform_(1e36, 3.4e38, generator=generator)[kind == 2]
    scb[kind == 3] = 0.0
    patterns = torch.randint(-(2**31), 2**31, (rows,), generator=generator, dtype=torch.int64).to(torch.int32)
    scb[kind == 4] = patterns.view(torch.float32)[kind == 4]
    return scb


def test_dequantize_equals_bitsandbytes_on_random_rows():
    rng = random.Random(8)
    generator = torch.Generator().manual_seed(8)
    wrong_order_caught = subnormals = 0
    for _ in range(12):
        rows, columns = rng.randrange(1, 300), rng.randrange(1, 300)
        weight, scb = random_int8(rows, columns, generator), random_scb(rows, generator)
        for out_dtype in OUT_DTYPES:
            ours = bnb8.dequantize(weight, scb, out_dtype)
            assert ours.dtype == out_dtype and ours.shape == weight.shape
            assert torch.equal(bits(ours), bits(F.int8_vectorwise_dequant(weight, scb).to(out_dtype)))
        fp32 = bnb8.dequantize(weight, scb, torch.float32)
        subnormals += int(((fp32 != 0) & (fp32.abs() < torch.finfo(torch.float32).tiny)).sum())
        # The comparison can tell a reassociated formula apart: (weight * SCB) / 127 is not weight * (SCB / 127).
        other = (weight * (scb * bnb8.INV_127).view(-1, 1)).to(torch.float32)
        wrong_order_caught += not torch.equal(bits(fp32), bits(other))
    assert wrong_order_caught >= 6 and subnormals > 0


def test_dequantize_rejects_bad_arguments():
    generator = torch.Generator().manual_seed(3)
    weight, scb = random_int8(5, 7, generator), random_scb(5, generator)
    for args, message in [
        ((weight.float(), scb, torch.float16), "int8 weight and float32 scales"),
        ((weight, scb.half(), torch.float16), "int8 weight and float32 scales"),
        ((weight, scb[:4], torch.float16), "[5, 7] and [4]"),
        ((weight.view(-1), scb, torch.float16), "weight [rows, in]"),
        ((weight, scb, torch.int8), "float16, bfloat16 or float32"),
    ]:
        with pytest.raises(ValueError, match=message.replace("[", r"\[")):
            bnb8.dequantize(*args)


def _expected_quantized(model):
    import bitsandbytes as bnb

    modules = model.named_modules()
    return {f"{name}.weight": module for name, module in modules if isinstance(module, bnb.nn.Linear8bitLt)}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_find_weights_on_real_checkpoints(variant, checkpoints, reader):
    folder = checkpoints[variant]
    tensors = read_tensors(folder)
    weights = bnb8.find_weights(tensors, reader)
    assert [w.name for w in weights] == sorted(w.name for w in weights)
    arch, dtype, skip = VARIANTS[variant]
    model = model_class(arch).from_pretrained(folder, device_map="cpu")
    quantized = _expected_quantized(model)
    assert {w.name for w in weights} == set(quantized)
    for skipped in skip or ():
        assert not any(skipped in w.name for w in weights) and any(skipped in name for name in tensors)
    assert not any("embed" in w.name or "lm_head" in w.name for w in weights)
    if arch == "phi3":
        assert {"model.layers.0.self_attn.qkv_proj.weight", "model.layers.0.mlp.gate_up_proj.weight"} <= set(quantized)
    consumed = {key for w in weights for key in w.source_keys}
    for w in weights:
        assert w.shape == tuple(quantized[w.name].weight.shape) and w.weight_format is not None
        prefix = w.name[: -len("weight")]
        assert w.source_keys == (w.name, prefix + "SCB", prefix + "weight_format")
    # Everything left is dense: no quantization data is unclaimed.
    assert all(info.dtype in ("F16", "BF16") for name, info in tensors.items() if name not in consumed)
    assert any(w.scb.path.name == "model-scales.safetensors" != w.weight.path.name for w in weights)


# The dtype transformers dequantizes to by default (the checkpoint's), and one other per architecture.
TRANSFORMERS_CASES = [
    *((variant, None) for variant in VARIANTS),
    ("llama-8bit-bf16", torch.float32),
    ("qwen2-tied-8bit-fp16", torch.bfloat16),
]


@pytest.mark.parametrize("variant, out_dtype", TRANSFORMERS_CASES)
def test_dequantize_equals_transformers(variant, out_dtype, checkpoints, reader):
    folder = checkpoints[variant]
    arch, source_dtype, _ = VARIANTS[variant]
    out_dtype = out_dtype or source_dtype
    model = model_class(arch).from_pretrained(folder, device_map="cpu")
    quantized = _expected_quantized(model)
    weights = bnb8.find_weights(read_tensors(folder), reader)
    loaded = {w.name: (quantized[w.name].weight.data.clone(), quantized[w.name].weight.SCB.clone()) for w in weights}
    dense = dict(model.dequantize(dtype=out_dtype).named_parameters())
    for w in weights:
        weight, scb = reader.tensor(w.weight), reader.tensor(w.scb)
        assert torch.equal(weight, loaded[w.name][0]) and torch.equal(bits(scb), bits(loaded[w.name][1]))
        assert dense[w.name].dtype == out_dtype
        assert torch.equal(bits(bnb8.dequantize(weight, scb, out_dtype)), bits(dense[w.name].data))


@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
def test_dequantize_real_weights_whole_and_in_row_chunks(out_dtype, checkpoints, reader):
    rng = random.Random(str(out_dtype))
    for variant, folder in checkpoints.items():
        for w in bnb8.find_weights(read_tensors(folder), reader):
            weight, scb = reader.tensor(w.weight), reader.tensor(w.scb)
            whole = bnb8.dequantize(weight, scb, out_dtype)
            assert torch.equal(bits(whole), bits(F.int8_vectorwise_dequant(weight, scb).to(out_dtype))), (
                variant,
                w.name,
            )
            rows = weight.shape[0]
            cuts = sorted({0, rows, *(rng.randrange(1, rows) for _ in range(3))})
            chunks = [bnb8.dequantize(weight[a:b], scb[a:b], out_dtype) for a, b in zip(cuts, cuts[1:])]
            assert torch.equal(bits(torch.cat(chunks)), bits(whole)), (variant, w.name, cuts)


WEIGHT, SCB, FORMAT = (lambda w: w.name), (lambda w: w.scb.name), (lambda w: w.weight_format.name)


def _drop(*keys):
    def change(tensors, w, extra):
        for key in keys:
            tensors.pop(key(w))

    return change


def _replace(key, **changes):
    """Change a header field; a callable value is computed from the weight."""

    def change(tensors, w, extra):
        values = {field: value(w) if callable(value) else value for field, value in changes.items()}
        tensors[key(w)] = dataclasses.replace(tensors[key(w)], **values)

    return change


def _weight_format(value, dtype=torch.uint8, shape=()):
    """A weight_format with real bytes (find_weights reads it), saved in a file of its own."""

    def change(tensors, w, extra):
        tensors[w.weight_format.name] = extra(w.weight_format.name, torch.full(shape, value, dtype=dtype))

    return change


def _scales(value):
    """The SCB replaced by real scales (find_weights reads them), one of them ``value``, saved in a file of its own."""

    def change(tensors, w, extra):
        scales = torch.rand(w.shape[0], generator=torch.Generator().manual_seed(9)) + 0.5
        scales[w.shape[0] // 2] = value
        tensors[w.scb.name] = extra(w.scb.name, scales)

    return change


# case: (change to the header, the tensor the message must name, what it must say)
MALFORMED = {
    "scb-nan": (_scales(float("nan")), SCB, "holds a negative, NaN or infinite scale"),
    "scb-inf": (_scales(float("inf")), SCB, "holds a negative, NaN or infinite scale"),
    "scb-negative": (_scales(-0.25), SCB, "holds a negative, NaN or infinite scale"),
    "scb-without-weight": (_drop(WEIGHT), SCB, "is 8-bit quantization data but its weight '{weight}' is missing"),
    "format-without-weight-or-scb": (_drop(WEIGHT, SCB), FORMAT, "is 8-bit quantization data but its weight"),
    "format-without-scb": (_drop(SCB), FORMAT, "marks '{weight}' as 8-bit, but its scales '{scb}' are missing"),
    "weight-not-int8": (_replace(WEIGHT, dtype="F16"), WEIGHT, "has 8-bit scales ('{scb}') but is F16, not I8"),
    "weight-not-2d": (
        _replace(WEIGHT, shape=lambda w: (w.shape[0], 1, w.shape[1])),
        WEIGHT,
        "shape [{rows}, 1, {columns}], [out, in] expected",
    ),
    "scb-not-f32": (_replace(SCB, dtype="F16"), SCB, "(8-bit scales) is F16, F32 expected"),
    "scb-too-short": (
        _replace(SCB, shape=lambda w: (w.shape[0] - 1,)),
        SCB,
        "has shape [{rows_less}], one scale per row of '{weight}' [{rows}, {columns}] expected: [{rows}]",
    ),
    "scb-2d": (_replace(SCB, shape=lambda w: (w.shape[0], 1)), SCB, "has shape [{rows}, 1], one scale per row"),
    "format-col-turing": (
        _weight_format(2),
        FORMAT,
        "says weight format 2 ('col_turing', a tiled GPU layout of bitsandbytes 0.42-0.44); "
        "only 0 (row-major) can be dequantized",
    ),
    "format-unknown": (_weight_format(9), FORMAT, "says weight format 9 (unknown); only 0 (row-major)"),
    "format-not-integer": (_weight_format(0.0, torch.float32), FORMAT, "should be one integer, not F32 of shape []"),
    "format-two-values": (_weight_format(0, shape=(2,)), FORMAT, "should be one integer, not U8 of shape [2]"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_is_one_line_naming_file_and_tensor(case, checkpoints, reader, tmp_path):
    from safetensors.torch import save_file

    change, culprit, message = MALFORMED[case]
    tensors = read_tensors(checkpoints["llama-8bit-bf16"])
    weights = bnb8.find_weights(tensors, reader)
    w = weights[len(weights) // 2]
    expected_info = tensors[culprit(w)]

    def extra(name, value):
        path = tmp_path / "replaced.safetensors"
        save_file({name: value}, path)
        return read_header(path)[0][name]

    change(tensors, w, extra)
    info = tensors.get(culprit(w), expected_info)
    with pytest.raises(CheckpointError) as raised:
        bnb8.find_weights(tensors, reader)
    text = str(raised.value)
    rows, columns = w.shape
    assert "\n" not in text
    assert text.startswith(f"{info.path}: tensor '{culprit(w)}' ")
    assert message.format(weight=w.name, scb=w.scb.name, rows=rows, columns=columns, rows_less=rows - 1) in text


def test_a_weight_whose_scales_are_all_lost_is_refused_not_copied(checkpoints, reader, tmp_path):
    # Old checkpoints have no weight_format; without its SCB too, an 8-bit weight is a bare I8 matrix that would be
    # copied as an integer "dense" weight. A layer named like a quantized one, or any when the config says 8-bit.
    from safetensors.torch import save_file

    tensors = read_tensors(checkpoints["llama-8bit-bf16"])
    w = bnb8.find_weights(tensors, reader)[3]
    lost = {k: v for k, v in tensors.items() if k not in (w.scb.name, w.weight_format.name)}
    weights = bnb8.find_weights(lost, reader)
    assert w.name not in {x.name for x in weights}
    with pytest.raises(
        CheckpointError, match=rf"'{w.name}' is an 8-bit weight \(I8 \[{w.shape[0]}, {w.shape[1]}\]\) with no"
    ):
        bnb8.unclaimed_int8(lost, weights, {"load_in_8bit": True})
    path = tmp_path / "extra.safetensors"
    save_file({"model.codebook.weight": random_int8(9, 13, torch.Generator().manual_seed(5))}, path)
    bnb8.unclaimed_int8({**tensors, **read_header(path)[0]}, bnb8.find_weights(tensors, reader), {"load_in_8bit": True})
    alone = {k: v for k, v in lost.items() if k == w.name}
    with pytest.raises(CheckpointError):  # no weight kept its scales, the config says 8-bit
        bnb8.unclaimed_int8(alone, [], {"load_in_8bit": True})
    bnb8.unclaimed_int8(alone, [], None)  # a checkpoint that says nothing of 8-bit: a plain integer tensor


def test_plain_int8_tensors_and_old_checkpoints_without_weight_format(checkpoints, reader, tmp_path):
    from safetensors.torch import save_file

    tensors = read_tensors(checkpoints["qwen2-tied-8bit-fp16"])
    generator = torch.Generator().manual_seed(5)
    path = tmp_path / "extra.safetensors"
    plain = {"model.codebook.weight": random_int8(9, 13, generator), "model.counts": random_int8(1, 3, generator)[0]}
    save_file(plain, path)
    tensors.update(read_header(path)[0])
    weights = bnb8.find_weights(tensors, reader)
    assert not any(w.name.startswith("model.codebook") for w in weights)
    # Checkpoints saved before bitsandbytes wrote weight_format have the SCB alone.
    without = {k: v for k, v in tensors.items() if not k.endswith(".weight_format")}
    old = bnb8.find_weights(without, reader)
    assert [w.name for w in old] == [w.name for w in weights]
    assert all(w.weight_format is None and w.source_keys == (w.name, w.scb.name) for w in old)


@pytest.mark.gpu
def test_cuda_equals_bitsandbytes_on_cuda_and_the_cpu(checkpoints, reader):
    rng = random.Random(80)
    generator = torch.Generator().manual_seed(80)
    shapes = [(rng.randrange(1, 3000), rng.randrange(1, 3000)) for _ in range(10)] + [(1, 1), (4099, 8191)]
    cases = [(random_int8(rows, columns, generator), random_scb(rows, generator)) for rows, columns in shapes]
    for folder in checkpoints.values():
        for w in bnb8.find_weights(read_tensors(folder), reader):
            cases.append((reader.tensor(w.weight), reader.tensor(w.scb)))
    for weight, scb in cases:
        weight_cuda, scb_cuda = weight.cuda(), scb.cuda()
        for out_dtype in OUT_DTYPES:
            ours = bnb8.dequantize(weight_cuda, scb_cuda, out_dtype)
            assert ours.is_cuda
            assert torch.equal(bits(ours), bits(F.int8_vectorwise_dequant(weight_cuda, scb_cuda).to(out_dtype)))
            cut = rng.randrange(0, weight.shape[0] + 1)
            bounds = ((0, cut), (cut, weight.shape[0]))
            chunks = [bnb8.dequantize(weight_cuda[a:b], scb_cuda[a:b], out_dtype) for a, b in bounds]
            assert torch.equal(bits(torch.cat(chunks)), bits(ours))
            # CPU and GPU agree bit for bit, except the payload of NaNs (a non-finite SCB): x86 and CUDA
            # make different NaN bits for inf * 0 and pass payloads on differently.
            cpu, gpu = bnb8.dequantize(weight, scb, out_dtype), ours.cpu()
            nan = cpu.isnan()
            assert torch.equal(nan, gpu.isnan())
            assert torch.equal(bits(cpu[~nan]), bits(gpu[~nan]))
            finite_rows = scb.isfinite()
            assert torch.equal(bits(cpu[finite_rows]), bits(gpu[finite_rows]))


# --- end to end: the CLI converts 8-bit checkpoints, verify checks them ---------------------------------------


def _cli(*args, code=0):
    from click.testing import CliRunner

    from nf4convert.cli.commands import main

    result = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
    assert result.exit_code == code, result.output
    return result.output


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_cli_converts_verifies_and_transformers_loads(variant, checkpoints, tmp_path):
    import json

    source = checkpoints[variant]
    arch, dense_dtype, _ = VARIANTS[variant]
    out = tmp_path / "out"
    summary = _cli(source, "-o", out, "--max-shard-size", "200KB", "--device", "cpu")
    produced = read_tensors(out)
    assert not [k for k in produced if k.endswith((".SCB", ".weight_format"))]
    code = {torch.bfloat16: "BF16", torch.float16: "F16"}[dense_dtype]
    assert {info.dtype for info in produced.values()} == {code}  # auto: the config's dtype
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in json.dumps(config) and config["dtype"] == str(dense_dtype).removeprefix(
        "torch."
    )
    assert f"{len(produced)} tensors" in summary
    assert "OK: bit-exact with bitsandbytes" in _cli("verify", out, source, "--device", "cpu")

    # transformers loads it as a dense model whose logits equal its own dequantize() of the 8-bit model.
    dense = model_class(arch).from_pretrained(out).eval()
    reference = model_class(arch).from_pretrained(source, device_map="cpu").eval()
    reference.dequantize()
    ids = torch.randint(0, 512, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(dense(input_ids=ids).logits, reference(input_ids=ids).logits)


def test_cli_fp32_and_tamper_is_caught(checkpoints, tmp_path):
    import json
    import struct

    source = checkpoints["phi3-fused-8bit-fp16"]
    out = tmp_path / "out"
    _cli(source, "-o", out, "--dtype", "float32", "-q")
    shard = out / "model.safetensors"
    data = bytearray(shard.read_bytes())
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    name = next(k for k in sorted(header) if k.endswith("qkv_proj.weight"))
    data[8 + length + header[name]["data_offsets"][0] + 4 * 101] ^= 0x01  # one bit of one element
    shard.write_bytes(bytes(data))
    output = _cli("verify", out, source, code=1)
    assert f"{name}: 1 of" in output and "differ from bitsandbytes" in output and "FAILED: 1 problem\n" in output
