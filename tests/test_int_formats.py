"""GPTQ, AWQ and compressed-tensors integer weights: found and checked from real-architecture checkpoints, dequantized
bit for bit as their reference libraries do (ours vs verify's references vs what the quantization means), on random
packed words of every bit pattern, on a GPU as on a CPU, and the dense models they make giving the same logits."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import random
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from nf4convert.dtypes import BY_NAME, DTYPES
from nf4convert.errors import CheckpointError
from nf4convert.formats import awq, compressed_int, gptq
from nf4convert.formats.packed_int import unpack
from nf4convert.safetensors_io.read import TensorReader, read_tensors
from nf4convert.verification.reference import dequantize_awq, dequantize_compressed_int, dequantize_gptq

from fixtures.int_checkpoints import VARIANTS, build, pack
from fixtures.processes import package_env
from fixtures.weights import OUT_DTYPES, bits

pytest.importorskip("compressed_tensors")

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("int")
    return {variant: build(root / variant, variant, seed=index) for index, variant in enumerate(VARIANTS)}


@pytest.fixture
def reader():
    reader = TensorReader()
    yield reader
    reader.close()


def weights_of(built, reader):
    """The checkpoint's quantized weights, as its format module finds them."""
    tensors = read_tensors(built.folder)
    method = VARIANTS[built.folder.name][0]
    if method == "gptq":
        return gptq.find_weights(tensors, reader, built.quantization)
    if method == "awq":
        return awq.find_weights(tensors, built.quantization)
    return compressed_int.find_weights(tensors, reader, built.quantization)


def ours(weight, reader, out_dtype=None, device="cpu", rows=None):
    """A weight made by our dequantization in pieces of ``rows`` output rows (the format's alignment by default),
    each piece from only its own slices of the packed tensors, as a converter's pieces are."""
    load = lambda info: reader.tensor(info).to(device)  # noqa: E731
    out_features = weight.shape[0]
    if isinstance(weight, gptq.GptqWeight):
        step = rows or gptq.PIECE_ALIGN
        qweight, qzeros, scales, g_idx = (load(info) for info in weight.sources)

        def piece(first, count):
            begin, end = weight.zero_words(first, count)
            return gptq.dequantize(
                qweight[:, first : first + count],
                qzeros[:, begin:end],
                scales[:, first : first + count],
                g_idx,
                bits=weight.bits,
                v1=weight.v1,
                out_dtype=out_dtype,
            )
    elif isinstance(weight, awq.AwqWeight):
        step = rows or awq.PIECE_ALIGN
        qweight, qzeros, scales = (load(info) for info in weight.sources)

        def piece(first, count):
            if weight.layout == "gemv":
                return awq.dequantize_gemv(
                    qweight[first : first + count],
                    qzeros[first : first + count],
                    scales[first : first + count],
                    group_size=weight.group_size,
                    out_dtype=out_dtype,
                )
            words = slice(first // 8, (first + count) // 8)
            return awq.dequantize_gemm(
                qweight[:, words],
                qzeros[:, words],
                scales[:, first : first + count],
                group_size=weight.group_size,
                out_dtype=out_dtype,
            )
    else:
        step = rows or compressed_int.PIECE_ALIGN
        codes, scale = load(weight.codes), load(weight.scale)
        zero_point = None if weight.zero_point is None else load(weight.zero_point)

        def piece(first, count):
            if weight.scheme.format != compressed_int.PACKED:
                zeros = None if zero_point is None else zero_point[first : first + count]
                return compressed_int.dequantize_naive(
                    codes[first : first + count], scale[first : first + count], zeros, out_dtype=out_dtype
                )
            zeros = None
            if zero_point is not None:
                begin, end = weight.zero_rows(first, count)
                zeros = zero_point[begin:end]
            return compressed_int.dequantize_packed(
                codes[first : first + count],
                scale[first : first + count],
                zeros,
                bits=weight.scheme.bits,
                in_features=weight.in_features,
                out_dtype=out_dtype,
            )

    return torch.cat([piece(first, min(step, out_features - first)) for first in range(0, out_features, step)])


def planned(weight, code: str):
    """The stand-in of a planned tensor that verify's references read (by duck typing)."""
    shape = weight.shape
    nbytes = shape[0] * shape[1] * DTYPES[code].itemsize
    return SimpleNamespace(
        name=weight.name, dtype=code, shape=shape, nbytes=nbytes, recipe=SimpleNamespace(weight=weight)
    )


def theirs(module, weight, reader, code: str, device="cpu", piece_bytes=1 << 24):
    """A weight as verify's reference module computes it, in slices of ``piece_bytes``."""
    context = SimpleNamespace(
        slices=lambda tensor, reader, device, size: module.slices(tensor, reader, device, None, piece_bytes)
    )
    return module.reference(planned(weight, code), reader, device, context)


def reference_module(weight):
    return {gptq.GptqWeight: dequantize_gptq, awq.AwqWeight: dequantize_awq}.get(
        type(weight), dequantize_compressed_int
    )


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_weight_bit_for_bit(checkpoints, reader, variant):
    """Ours (in aligned pieces and in odd ones) == verify's reference == what the quantization means, in the
    reference's own dtype; and the reference's output cast, in every output dtype."""
    built = checkpoints[variant]
    weights = weights_of(built, reader)
    assert {w.name for w in weights} == set(built.expected), "the quantized layers found are the ones written"
    for weight in weights:
        own = ours(weight, reader)
        assert own.dtype == DTYPES[weight.dtype].torch and tuple(own.shape) == weight.shape
        assert torch.equal(bits(own), bits(built.expected[weight.name])), weight.name
        module = reference_module(weight)
        assert torch.equal(bits(own), bits(theirs(module, weight, reader, weight.dtype))), weight.name
        assert torch.equal(bits(own), bits(theirs(module, weight, reader, weight.dtype, piece_bytes=1))), "small slices"
        assert torch.equal(bits(own), bits(ours(weight, reader, rows=weight.shape[0]))), "one piece"
        for out_dtype in OUT_DTYPES:
            code = BY_NAME[str(out_dtype).removeprefix("torch.")].code
            cast = ours(weight, reader, out_dtype)
            assert torch.equal(bits(cast), bits(own.to(out_dtype))), (weight.name, out_dtype)
            assert torch.equal(bits(cast), bits(theirs(module, weight, reader, code))), (weight.name, out_dtype)


def test_references_slice_a_quarter_of_the_bytes_on_the_cpu(checkpoints, reader):
    """On the CPU a verify thread's slice of a packed weight is a quarter of its share of bytes (its temporaries are
    several times that), whole multiples of the packed words' rows; a GPU's slices are whole."""
    from nf4convert.verification.reference.base import unpacking_rows

    assert unpacking_rows(1 << 23, 28672 * 2, 32, "cpu") == 32  # a 70B down_proj's rows: 36 fit in 2 MiB
    assert unpacking_rows(1 << 23, 28672 * 2, 32, torch.device("cuda")) == 128
    assert unpacking_rows(1 << 23, 10**7, 8, "cpu") == 8  # at least one whole multiple
    for variant in ("gptq-llama-4bit-g32-v1-sym", "awq-llama-gemm-g32", "ct-llama-w4a16-g32-sym"):
        for weight in weights_of(checkpoints[variant], reader):
            tensor = planned(weight, weight.dtype)
            row_bytes = tensor.nbytes // weight.shape[0]
            module = reference_module(weight)
            sizes = [piece.nbytes for piece in module.slices(tensor, reader, "cpu", None, 64 * row_bytes)]
            assert sum(sizes) == tensor.nbytes and max(sizes) <= 32 * row_bytes, (weight.name, sizes)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", VARIANTS)
def test_gpu_gives_the_cpu_bytes(checkpoints, reader, variant):
    for weight in weights_of(checkpoints[variant], reader):
        module = reference_module(weight)
        for out_dtype in (None, *OUT_DTYPES):
            cpu = ours(weight, reader, out_dtype)
            assert torch.equal(bits(ours(weight, reader, out_dtype, device="cuda").cpu()), bits(cpu)), weight.name
            code = weight.dtype if out_dtype is None else BY_NAME[str(out_dtype).removeprefix("torch.")].code
            assert torch.equal(bits(theirs(module, weight, reader, code, device="cuda").cpu()), bits(cpu)), weight.name


def test_format_classes_have_the_source_format_shape():
    """Each format class is a registered formats.base.SourceFormat."""
    import re

    from nf4convert.formats.base import SourceFormat, all_formats

    for cls, method in ((gptq.Gptq, "gptq"), (awq.Awq, "awq"), (compressed_int.CompressedInt, "compressed-tensors")):
        assert issubclass(cls, SourceFormat) and all_formats()[cls.name] is cls
        for field, kind in (
            ("name", str),
            ("family", str),
            ("title", str),
            ("quant_methods", tuple),
            ("name_suffix", str),
            ("plan_reads", re.Pattern),
        ):
            assert isinstance(getattr(cls, field), kind), (cls, field)
        assert cls.quant_methods == (method,)
        re.compile(cls.name_suffix)
        assert "bit for bit" in cls.exactness("bf16", True) and "bf16" in cls.exactness("bf16", False)
    assert gptq.Gptq.reads_config({"quant_method": "gptq", "bits": 4, "group_size": 128})
    assert gptq.Gptq.config_problem({"quant_method": "gptq", "bits": 4, "group_size": 128}) is None
    assert "marlin" in gptq.Gptq.config_problem({"bits": 4, "group_size": 128, "checkpoint_format": "marlin"})
    assert "version" in awq.Awq.config_problem({"bits": 4, "group_size": 128, "version": "gemv_fast"})
    assert gptq.Gptq.is_quantization_key("a.qzeros") and not gptq.Gptq.is_quantization_key("a.weight")
    assert compressed_int.CompressedInt.is_quantization_key("a.weight_packed")
    fp8 = {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "config_groups": {"g": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float"}}},
    }
    # float groups are another format's: a config of them alone is a problem here, which another format may not have
    assert "no config group has integer weights" in compressed_int.CompressedInt.config_problem(fp8)
    assert "frozen" in compressed_int.config_problem({**fp8, "quantization_status": "frozen"})


# Random packed words of every bit pattern, against the references' restated library arithmetic


def random_scales(shape, dtype, generator):
    """Finite scales of every magnitude: ordinary ones, subnormals, huge ones whose products overflow, zeros, negative
    ones, and arbitrary finite bit patterns."""
    scales = (torch.rand(shape, generator=generator) * 0.05).to(dtype)
    kind = torch.randint(0, 5, shape, generator=generator)
    width = {2: torch.int16, 4: torch.int32}[scales.element_size()]
    patterns = random_words(shape, width, generator).view(dtype)
    finite = patterns.isfinite()
    scales[(kind == 1) & finite] = patterns[(kind == 1) & finite]
    scales[kind == 2] = torch.finfo(dtype).smallest_normal / 8  # subnormal (fp16 and bf16 keep them)
    scales[kind == 3] = torch.finfo(dtype).max / 4
    scales[kind == 4] = -scales[kind == 4]
    return scales


def random_words(shape, dtype, generator):
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max + 1, shape, generator=generator, dtype=torch.int64).to(dtype)


@pytest.mark.parametrize("device", DEVICES)
def test_gptq_random_words_equal_gptqmodel_arithmetic(device):
    rng, generator = random.Random(3), torch.Generator().manual_seed(3)
    for _ in range(40):
        bits_ = rng.choice((2, 3, 4, 8))
        word = torch.int32 if bits_ == 3 else rng.choice((torch.int8, torch.int16, torch.int32))
        width = torch.iinfo(word).bits
        out_features = 32 * rng.randrange(1, 5) if bits_ == 3 else rng.randrange(1, 140)
        in_features = rng.randrange(1, 300)
        rows = -(-in_features * bits_ // width)
        if bits_ == 3 and rows % 3:
            rows += 3 - rows % 3
            in_features = min(in_features, rows * 32 // 3)
        group_size = rng.choice((-1, 7, 32, 128))
        groups = 1 if group_size == -1 else -(-in_features // group_size)
        dtype = rng.choice((torch.float16, torch.bfloat16))
        qweight = random_words((rows, out_features), word, generator)
        qzeros = random_words((groups, -(-out_features * bits_ // width)), word, generator)
        scales = random_scales((groups, out_features), dtype, generator)
        g_idx = torch.randint(0, groups, (in_features,), generator=generator, dtype=torch.int32)
        for v1 in (False, True):
            zeros = dequantize_gptq._v1_to_v2(qzeros.clone(), bits_, width) if v1 else qzeros
            expected = dequantize_gptq._dequantize_weight(qweight, zeros, scales, g_idx, bits_).T
            got = gptq.dequantize(
                qweight.to(device), qzeros.to(device), scales.to(device), g_idx.to(device), bits=bits_, v1=v1
            ).cpu()
            assert torch.equal(bits(got), bits(expected)), (bits_, word, v1, in_features, out_features, group_size)


@pytest.mark.parametrize("device", DEVICES)
def test_awq_random_words_equal_gptqmodel_arithmetic(device):
    rng, generator = random.Random(4), torch.Generator().manual_seed(4)
    for _ in range(30):
        group_size = rng.choice((16, 32, 64, 128))
        groups, out_features = rng.randrange(1, 5), 8 * rng.randrange(1, 20)
        in_features = groups * group_size
        dtype = rng.choice((torch.float16, torch.bfloat16))
        qweight = random_words((in_features, out_features // 8), torch.int32, generator)
        qzeros = random_words((groups, out_features // 8), torch.int32, generator)
        scales = random_scales((groups, out_features), dtype, generator)
        expected = dequantize_awq._dequantize_gemm(qweight, qzeros, scales, 4, group_size)
        got = awq.dequantize_gemm(qweight.to(device), qzeros.to(device), scales.to(device), group_size=group_size)
        assert torch.equal(bits(got.cpu()), bits(expected)), (in_features, out_features, group_size)
        width = awq.zeros_width(in_features, group_size)
        gemv = (
            random_words((out_features, in_features // 8), torch.int32, generator),
            random_words((out_features, width), torch.int32, generator),
            random_scales((out_features, width * 8), dtype, generator),
        )
        expected = dequantize_awq._dequantize_gemv(*gemv, 4, group_size)
        got = awq.dequantize_gemv(*(t.to(device) for t in gemv), group_size=group_size)
        assert torch.equal(bits(got.cpu()), bits(expected)), ("gemv", in_features, out_features, group_size)


@pytest.mark.parametrize("device", DEVICES)
def test_compressed_random_words_equal_compressed_tensors(device):
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    rng, generator = random.Random(5), torch.Generator().manual_seed(5)
    for _ in range(30):
        bits_, symmetric = rng.choice((2, 4, 8)), rng.random() < 0.5
        strategy = rng.choice(("group", "channel"))
        group_size = rng.choice((8, 32, 64)) if strategy == "group" else None
        out_features = rng.randrange(1, 100)
        in_features = (group_size or 1) * rng.randrange(1, 9 if group_size else 200)
        columns = in_features // group_size if group_size else 1
        dtype = rng.choice((torch.float16, torch.bfloat16, torch.float32))
        packed = random_words((out_features, -(-in_features * bits_ // 32)), torch.int32, generator)
        state = {
            "weight_packed": packed,
            "weight_scale": random_scales((out_features, columns), dtype, generator),
            "weight_shape": torch.tensor([out_features, in_features]),
        }
        if not symmetric:
            state["weight_zero_point"] = random_words((-(-out_features * bits_ // 32), columns), torch.int32, generator)
        args = QuantizationArgs(num_bits=bits_, symmetric=symmetric, strategy=strategy, group_size=group_size)
        scheme = QuantizationScheme(targets=["Linear"], weights=args, format="pack-quantized")
        expected = BaseCompressor.get_value_from_registry("pack-quantized").decompress(state, scheme)["weight"]
        got = compressed_int.dequantize_packed(
            state["weight_packed"].to(device),
            state["weight_scale"].to(device),
            state.get("weight_zero_point", torch.empty(0)).to(device) if not symmetric else None,
            bits=bits_,
            in_features=in_features,
        )
        assert torch.equal(bits(got.cpu()), bits(expected)), (bits_, symmetric, strategy, in_features, dtype)


def test_unpack_is_the_bit_stream():
    """Code i of a run is bits [i*b, (i+1)*b) of its words end to end, for every width and word size."""
    generator = torch.Generator().manual_seed(6)
    for bits_ in range(1, 9):
        for word in (torch.int8, torch.int16, torch.int32):
            width = torch.iinfo(word).bits
            words = random_words((3, 7), word, generator)
            stream = "".join(format(int(w) & ((1 << width) - 1), f"0{width}b")[::-1] for w in words[1])
            count = 7 * width // bits_
            expected = [int(stream[i * bits_ : (i + 1) * bits_][::-1], 2) for i in range(count)]
            assert unpack(words, bits_, count)[1].tolist() == expected, (bits_, word)
            assert torch.equal(unpack(words.T.contiguous(), bits_, count, dim=0).T, unpack(words, bits_, count))


def test_gptq_v1_zeros_carry_as_gptqmodel_exports_them():
    """GPTQModel writes v1 zeros by one subtraction per packed word (a zero of 0 borrows from the next field) and
    reads them back by one addition per word: the zeros come back exactly. Converting field by field instead (what
    gptqmodel's file-level dequantize_model and llama.cpp's converter do) gets the borrowed fields wrong."""
    zeros = torch.tensor([[0, 5, 15, 0, 3, 0, 0, 9]])
    v1 = pack((zeros.numpy() - 0), 4, 32, axis=1).view("u4").astype("i8") - 0x11111111
    qzeros = torch.tensor(v1 % (1 << 32), dtype=torch.int64).to(torch.int32)
    fixed = gptq._v2_zeros(qzeros, 4)
    assert unpack(fixed, 4, 8).tolist() == zeros.tolist()
    per_field = (unpack(qzeros, 4, 8) + 1) & 15
    assert per_field.tolist() != zeros.tolist()
    assert (unpack(qzeros, 4, 8) + 1).tolist() != zeros.tolist()  # no mask either (llama.cpp)


# Loading: the dense models our weights make


def dense_model(built, weights, reader, make):
    """The checkpoint's model with every quantized layer's weight from ``make(weight)`` (dense config, no
    quantization), in the expected dtype of the weights."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    config = json.loads((built.folder / "config.json").read_text())
    config.pop("quantization_config")
    state = {k: v for k, v in load_file(built.folder / "model.safetensors").items()}
    for weight in weights:
        prefix = weight.name.removesuffix("weight")
        for key in [
            k
            for k in state
            if k.startswith(prefix)
            and k[len(prefix) :]
            in (
                "qweight",
                "qzeros",
                "scales",
                "g_idx",
                "weight_packed",
                "weight_scale",
                "weight_shape",
                "weight_zero_point",
                "weight",
            )
        ]:  # noqa: E501
            del state[key]
        state[weight.name] = make(weight)
    dtype = next(iter(state.values())).dtype if not weights else DTYPES[weights[0].dtype].torch
    state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config), dtype=dtype)
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all("lm_head" in k for k in missing), (missing, unexpected)
    model.tie_weights()
    return model.eval()


def logits(model):
    tokens = torch.tensor([[1, 5, 9, 14, 3, 7, 2, 11]])
    with torch.no_grad():
        return model(tokens).logits


@pytest.mark.parametrize(
    "variant",
    [
        v
        for v in VARIANTS
        if v.startswith(("gptq-llama-3", "gptq-odd-8", "awq-qwen2", "awq-llama-gemv-g32", "ct-llama-mixed"))
    ],
)  # noqa: E501
def test_dense_model_from_ours_gives_the_references_logits(checkpoints, reader, variant):
    built = checkpoints[variant]
    weights = weights_of(built, reader)
    mine = logits(dense_model(built, weights, reader, lambda w: ours(w, reader)))
    reference = logits(dense_model(built, weights, reader, lambda w: theirs(reference_module(w), w, reader, w.dtype)))
    assert torch.isfinite(mine).all() and torch.equal(bits(mine), bits(reference))


@pytest.mark.parametrize(
    "variant", ["ct-llama-w4a16-g32-asym-ignore", "ct-qwen2-w8a16-channel-asym", "ct-llama-naive-w8-g32-asym"]
)  # noqa: E501
def test_compressed_checkpoint_loaded_by_transformers_equals_ours(checkpoints, reader, variant):
    """transformers' own loading (compressed-tensors decompressing on the CPU) holds our weights, bit for bit, and its
    model gives the logits of the dense model built from ours."""
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    built = checkpoints[variant]
    loaded = AutoModelForCausalLM.from_pretrained(
        built.folder, quantization_config=CompressedTensorsConfig(dequantize=True), device_map="cpu"
    ).eval()
    parameters = dict(loaded.named_parameters())
    weights = weights_of(built, reader)
    for weight in weights:
        held = parameters[weight.name]
        assert torch.equal(bits(held), bits(ours(weight, reader, held.dtype))), weight.name
    mine = dense_model(built, weights, reader, lambda w: ours(w, reader, parameters[w.name].dtype))
    assert torch.equal(bits(logits(loaded)), bits(logits(mine)))


# GPTQModel itself (not a dependency: see verification/reference/dequantize_gptq.py), in a child process so that its
# import-time patches (safetensors' save_file, transformers' GPTQ quantizer) stay out of this one

_GPTQMODEL = r"""
import json, sys
from pathlib import Path
import torch
from safetensors.torch import load_file, save_file
from gptqmodel.nn_modules.qlinear.torch import TorchLinear
from gptqmodel.quantization.awq.utils.packing_utils import dequantize_gemm
from gptqmodel.utils.model import convert_gptq_v1_to_v2_format_module

folder, out, device = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
config = json.loads((folder / "config.json").read_text())["quantization_config"]
tensors = load_file(folder / "model.safetensors")
made = {}
for key in sorted(k for k in tensors if k.endswith(".qweight")):
    prefix = key[: -len("qweight")]
    parts = {p: tensors[prefix + p].to(device) for p in ("qweight", "qzeros", "scales", "g_idx")
             if prefix + p in tensors}
    if config["quant_method"] == "awq":
        if (config.get("version") or "gemm").lower() != "gemm":
            continue
        dense = dequantize_gemm(parts["qweight"], parts["qzeros"], parts["scales"], 4, config["group_size"])
    else:
        layer = TorchLinear(bits=config["bits"], group_size=config["group_size"], sym=config["sym"],
                            desc_act=config["desc_act"], in_features=parts["g_idx"].shape[0],
                            out_features=parts["qweight"].shape[1], bias=False, pack_dtype=parts["qweight"].dtype,
                            register_buffers=True).to(device)
        for name, value in parts.items():
            getattr(layer, name).data = value.clone()
        if (config.get("checkpoint_format") or config.get("format") or "gptq") == "gptq":
            convert_gptq_v1_to_v2_format_module(layer, bits=config["bits"], pack_dtype=layer.pack_dtype)
        layer.optimized = not made  # the first layer through torch.compile (as post_init does), the rest eager
        layer.post_init()
        layer.eval()
        dense = layer.dequantize_weight()
    made[prefix + "weight"] = dense.T.contiguous().cpu()
save_file(made, out)
"""


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("variant", [v for v in VARIANTS if v.startswith(("gptq", "awq"))])
def test_gptqmodel_itself_agrees(checkpoints, reader, tmp_path, variant, device):
    """Our weights equal gptqmodel's own dequantization (its torch kernel after its v1 conversion; AWQ's
    dequantize_gemm): skipped where gptqmodel is not installed (it needs torch >= 2.14.1)."""
    if importlib.util.find_spec("gptqmodel") is None:
        pytest.skip("gptqmodel is not installed")
    from safetensors.torch import load_file

    built = checkpoints[variant]
    out = tmp_path / "gptqmodel.safetensors"
    run = subprocess.run(
        [sys.executable, "-c", _GPTQMODEL, str(built.folder), str(out), device],
        env=package_env(),
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    theirs_ = load_file(out)
    weights = {w.name: w for w in weights_of(built, reader)}
    assert theirs_ or VARIANTS[variant][3].get("layout") == "gemv"
    for name, dense in theirs_.items():
        assert torch.equal(bits(dense), bits(ours(weights[name], reader))), name


_TRANSFORMERS = r"""
import sys
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, GPTQConfig

folder, out, device, method = sys.argv[1:5]
extra = dict(quantization_config=GPTQConfig(bits=int(sys.argv[5]), backend="torch")) if method == "gptq" else {}
model = AutoModelForCausalLM.from_pretrained(folder, device_map=device, dtype=torch.float16, **extra)
made = {}
for name, module in model.named_modules():
    if hasattr(module, "qweight"):
        if method == "gptq":
            dense = module.dequantize_weight()
        else:
            from gptqmodel.quantization.awq.utils.packing_utils import dequantize_gemm
            dense = dequantize_gemm(module.qweight, module.qzeros, module.scales, 4, module.group_size)
        made[name + ".weight"] = dense.T.contiguous().cpu()
save_file(made, out)
"""


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("variant", ["gptq-llama-4bit-g32-v1-asym-descact", "gptq-llama-3bit-g32-v1-descact",
                                     "gptq-llama-4bit-g32-v1-sym", "awq-llama-gemm-g32"])  # fmt: skip
def test_transformers_loading_through_gptqmodel_holds_our_weights(checkpoints, reader, tmp_path, variant, device):
    """transformers' own loading (optimum and gptqmodel, torch kernels, v1 zeros converted as it converts them) holds
    our weights bit for bit: skipped where gptqmodel and optimum are not installed."""
    if importlib.util.find_spec("gptqmodel") is None or importlib.util.find_spec("optimum") is None:
        pytest.skip("gptqmodel and optimum are not installed")
    from safetensors.torch import load_file

    built, out = checkpoints[variant], tmp_path / "loaded.safetensors"
    method, _, _, settings = VARIANTS[variant]
    command = [sys.executable, "-c", _TRANSFORMERS, str(built.folder), str(out), device, method,
               str(settings.get("bits", 4))]  # fmt: skip
    run = subprocess.run(command, env=package_env(), capture_output=True, text=True, timeout=1200)
    assert run.returncode == 0, run.stderr[-3000:]
    loaded = load_file(out)
    weights = {w.name: w for w in weights_of(built, reader)}
    assert set(loaded) == set(weights)
    for name, dense in loaded.items():
        assert torch.equal(bits(dense), bits(ours(weights[name], reader))), name


# Checks: one line naming the file and tensor


def rewrite(built, tmp_path, change, config_change=None):
    """A copy of a checkpoint with its tensors passed through ``change(dict)`` (and its quantization_config through
    ``config_change``); its folder and quantization_config."""
    from safetensors.torch import load_file, save_file

    folder = tmp_path / built.folder.name
    folder.mkdir()
    tensors = load_file(built.folder / "model.safetensors")
    change(tensors)
    save_file({k: v.contiguous() for k, v in tensors.items()}, folder / "model.safetensors")
    quantization = dict(built.quantization)
    if config_change:
        config_change(quantization)
    return folder, quantization


LAYER = "model.layers.0.mlp.down_proj."


def _set(key, value):
    return lambda tensors: tensors.__setitem__(LAYER + key, value(tensors[LAYER + key]))


def _forty_columns(tensors):
    """A 3-bit layer of 40 input columns: 4 packed rows, a block of 3 words and one word of the next."""
    tensors[LAYER + "qweight"] = tensors[LAYER + "qweight"][:4].clone()
    tensors[LAYER + "g_idx"] = tensors[LAYER + "g_idx"][:40].clone()


BROKEN = [
    ("gptq-llama-4bit-g32-v1-sym", _set("qweight", lambda t: t[:-1]), None, "qweight' has shape"),
    ("gptq-llama-4bit-g32-v1-sym", _set("g_idx", lambda t: t.clone().index_fill_(0, torch.tensor([3]), 10)), None,
     "g_idx' holds groups 0..10, outside 0..9"),
    ("gptq-llama-4bit-g32-v1-sym", _set("g_idx", lambda t: t.clone().index_fill_(0, torch.tensor([0]), -1)), None,
     "outside 0..9"),
    ("gptq-llama-4bit-g32-v1-sym", _set("qzeros", lambda t: t[:, :-1]), None, "qzeros' has shape"),
    ("gptq-llama-4bit-g32-v1-sym", _set("scales", lambda t: t[:-1]), None, "scales' has shape"),
    ("gptq-llama-4bit-g32-v1-sym", _set("scales", lambda t: t.float()), None, "scales) is F32"),
    ("gptq-llama-4bit-g32-v1-sym", lambda t: t.pop(LAYER + "g_idx"), None, "has no '" + LAYER + "g_idx'"),
    ("gptq-llama-4bit-g32-v1-sym", lambda t: t.pop(LAYER + "qweight"), None, "is GPTQ data but"),
    ("gptq-llama-4bit-g32-v1-sym", lambda t: None, lambda c: c.update(checkpoint_format="marlin"), "'marlin' is not"),
    ("gptq-llama-4bit-g32-v1-sym", lambda t: None, lambda c: c.update(bits=5), "bits=5"),
    ("gptq-llama-4bit-g32-v1-sym", lambda t: None, lambda c: c.update(group_size=40), "GPTQModel loads groups of"),
    ("gptq-llama-4bit-g32-v1-sym", lambda t: None, lambda c: c.update(dynamic={"-:.*down": {}}), "'dynamic'"),
    ("gptq-llama-3bit-gnone-v2", _set("qweight", lambda t: t[:-1]), None, "qweight' has shape"),
    ("gptq-llama-3bit-gnone-v2", _forty_columns, None, "ends inside a 3-word block"),
    ("awq-llama-gemm-g32", _set("qweight", lambda t: t[:, :-1]), None, "qweight' has shape"),
    ("awq-llama-gemm-g32", _set("qzeros", lambda t: t[:-1]), None, "qzeros' has shape"),
    ("awq-llama-gemm-g32", _set("qweight", lambda t: t[:-3]), None, "not whole groups of 32"),
    ("awq-llama-gemm-g32", lambda t: None, lambda c: c.update(version="gemv_fast"), "'gemv_fast' is not an AWQ"),
    ("awq-llama-gemm-g32", lambda t: t.__setitem__("model.layers.0.mlp.act.scales", torch.ones(320)), None,
     "ScaledActivation"),
    ("awq-llama-gemv-g32", _set("scales", lambda t: t[:, :-8]), None, "scales' has shape"),
    ("ct-llama-w2a16-g64-asym", _set("weight_packed", lambda t: t[:, :-1]), None, "weight_packed' has shape"),
    ("ct-llama-w2a16-g64-asym", _set("weight_zero_point", lambda t: t[:-1]), None, "weight_zero_point' has shape"),
    ("ct-llama-w2a16-g64-asym", _set("weight_scale", lambda t: t[:, :-1]), None, "weight_scale' has shape"),
    ("ct-llama-w2a16-g64-asym", _set("weight_zero_point", lambda t: t.to(torch.int8)), None, "is I8, I32 expected"),
    ("ct-llama-w2a16-g64-asym", _set("weight_shape", lambda t: torch.tensor([128, 330])), None,
     "weight_packed' has shape"),
    ("ct-llama-w2a16-g64-asym", lambda t: t.__setitem__(LAYER + "weight_g_idx", torch.zeros(320, dtype=torch.int32)),
     None, "activation-ordered groups"),
    ("ct-llama-w4a16-g32-sym", lambda t: None, lambda c: c["config_groups"]["group_0"]["weights"].update(num_bits=3),
     "3-bit weights"),
    ("ct-llama-w4a16-g32-sym", lambda t: None, lambda c: c.update(ignore=["lm_head", "re:.*mlp.*"]),
     "no integer config group targets"),
]  # fmt: skip


@pytest.mark.parametrize("variant, change, config_change, message", BROKEN)
def test_bad_checkpoints_are_one_line_naming_the_tensor(
    checkpoints, reader, tmp_path, variant, change, config_change, message
):
    folder, quantization = rewrite(checkpoints[variant], tmp_path, change, config_change)
    built = dataclasses.replace(checkpoints[variant], folder=folder, quantization=quantization)
    with pytest.raises(CheckpointError) as caught:
        tensors = read_tensors(folder)
        method = VARIANTS[variant][0]
        if method == "gptq":
            gptq.find_weights(tensors, reader, built.quantization)
        elif method == "awq":
            awq.find_weights(tensors, built.quantization, "llama")
        else:
            compressed_int.find_weights(tensors, reader, built.quantization)
    text = str(caught.value)
    assert message in text and "\n" not in text
    assert "config.json" in text or str(folder) in text, text
