"""compressed-tensors NVFP4 (``nvfp4-pack-quantized``), alone and in mixed-precision checkpoints (NVFP4 beside FP8
beside int4 beside dense layers), made by compressed-tensors' own compressors: every output tensor bit for bit the
library's decompression in every dtype, through pieces that cut the rows; random codes, scales and global scales
against the library; the device computation the host's; transformers' ``dequantize=True`` load and logits; a LoRA
merged as peft merges it on the library's dense base; GGUF; and bad input refused in one line, nothing written."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from test_float_convert import HostAsDevice

from nf4convert.dtypes import output_dtype
from nf4convert.formats import nvfp4
from nf4convert.pipeline.routes.cpu import CpuRoute
from nf4convert.plan import make_plan
from nf4convert.safetensors_io.read import TensorReader
from nf4convert.sinks.safetensors import write_shards

from fixtures import float_checkpoints as fc
from fixtures import nvfp4_checkpoints as nc
from fixtures.cli import cli, one_error_line

pytest.importorskip("compressed_tensors")
OUT = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(BITS[a.dtype]), b.view(BITS[b.dtype]))


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("nvfp4-sources")
    return {variant: nc.build(root / variant, variant, seed=index) for index, variant in enumerate(nc.VARIANTS)}


@pytest.mark.parametrize("flag", list(OUT))
@pytest.mark.parametrize("variant", list(nc.VARIANTS))
def test_every_tensor_equals_compressed_tensors(sources, variant, flag, tmp_path, monkeypatch):
    monkeypatch.setattr(CpuRoute, "piece_bytes", 3000)  # pieces of a few rows
    source, dtype = sources[variant], OUT[flag]
    out = tmp_path / "out"
    cli(source, "-o", out, "--dtype", flag, "--device", "cpu", "-q")
    got, state = fc.read_state(out), fc.read_state(source)
    reference = nc.reference_weights(source, dtype)
    nvfp4_layers = {k.rsplit(".", 1)[0] + ".weight" for k in state if k.endswith(".weight_global_scale")}
    assert nvfp4_layers and nvfp4_layers <= reference.keys()
    for name, value in reference.items():
        assert same_bits(got[name], value), name
    plain = {k: v for k, v in state.items() if k.rsplit(".", 1)[0] + ".weight" not in reference}
    assert got.keys() == reference.keys() | plain.keys()
    for name, value in plain.items():
        assert same_bits(got[name], value.to(dtype)), name
    assert "NVFP4" in (out / "README.md").read_text()


def test_verify_and_dry_run(sources, tmp_path):
    source = sources["qwen3-ct-mixed"]
    output = cli(source, "-o", tmp_path / "out", "--device", "cpu", "--verify")
    assert "NVFP4PackedCompressor" in output and "OK: bit-exact" in output
    plan = cli(source, "--dry-run")
    assert "dequantized from NVFP4" in plan and "dequantized from FP8" in plan and "integers" in plan


def _random_weight(generator, rows: int, groups: int):
    packed = torch.randint(0, 256, (rows, groups * 8), dtype=torch.uint8, generator=generator)
    packed.view(-1)[:256] = torch.arange(256, dtype=torch.uint8)[: packed.numel()]
    scales = torch.randint(0, 256, (rows, groups), dtype=torch.uint8, generator=generator)
    scales[torch.isin(scales, torch.tensor(nvfp4.NAN_SCALES, dtype=torch.uint8))] = 0x3F
    scales.view(-1)[:8] = torch.tensor([0, 1, 7, 8, 0x7E, 0x80, 0x81, 0xFE], dtype=torch.uint8)  # 0, subnormal, max
    return packed, scales.view(torch.float8_e4m3fn)


@pytest.mark.parametrize("flag", list(OUT))
def test_random_codes_and_scales_against_the_library(flag):
    """Every code byte, every finite E4M3 scale (zero, subnormal, negative, the largest), global scales tiny and huge,
    odd rows and odd numbers of groups, cut into pieces; on the torch function and the CPU route's host."""
    import numpy as np
    from compressed_tensors.quantization import QuantizationArgs

    dtype = OUT[flag]
    args = QuantizationArgs(**nc.NVFP4)
    generator = torch.Generator().manual_seed(11)
    for global_value in (448.0 * 6 / 0.37, 1.0, 3.0e-30, 7.5e30, -2.0):
        rows, groups = (int(v) for v in torch.randint(1, 40, (2,), generator=generator))
        packed, scales = _random_weight(generator, rows, groups)
        global_scale = torch.tensor([global_value], dtype=torch.float32)
        reference = nc.library_nvfp4(packed, scales, global_scale, args, dtype)
        cut = int(torch.randint(1, rows + 1, (1,), generator=generator))
        ours = torch.cat(
            [
                nvfp4.dequantize(packed[f : f + cut], scales[f : f + cut], global_scale, dtype)
                for f in range(0, rows, cut)
            ]
        )
        assert same_bits(ours, reference), global_value
        out = np.empty(rows * groups * 16 * dtype.itemsize, dtype=np.uint8)
        code = {"bf16": "BF16", "fp16": "F16", "fp32": "F32"}[flag]
        bytes_ = scales.view(torch.uint8).numpy()
        nvfp4.host(packed.numpy().reshape(-1), out, scales=bytes_, global_scale=global_value, out_code=code)
        assert same_bits(torch.from_numpy(out).view(dtype).view(rows, -1), reference)


def test_the_device_computation_gives_the_host_bytes(sources, tmp_path):
    for variant, source in sources.items():
        for flag in OUT:
            plan = make_plan(source, dtype=output_dtype(flag))
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


def test_transformers_loads_the_output_with_the_logits_of_its_own_dequantization(sources, tmp_path):
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    source = sources["qwen3-ct-nvfp4"]
    out = tmp_path / "out"
    cli(source, "-o", out, "--device", "cpu", "-q")
    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert all(not keys for keys in info.values()), info
    config = CompressedTensorsConfig(dequantize=True)
    reference = AutoModelForCausalLM.from_pretrained(source, quantization_config=config, dtype=torch.bfloat16).eval()
    loaded = model.state_dict()
    for name, value in reference.state_dict().items():
        assert same_bits(loaded[name], value), name
    assert torch.equal(_logits(model.eval()), _logits(reference))


@pytest.mark.parametrize("flag", ["bf16", "fp32"])
def test_lora_merges_as_peft_on_the_library_dense_base(sources, tmp_path, flag):
    pytest.importorskip("peft")
    from peft import PeftModel

    source, dtype = sources["qwen3-ct-mixed"], OUT[flag]
    adapter = nc.make_adapter(
        tmp_path / "adapter", 5, r=4, lora_alpha=8, target_modules=["q_proj", "up_proj", "o_proj"]
    )
    out = tmp_path / "out"
    assert "OK: bit-exact" in cli(
        source, "--adapter", adapter, "-o", out, "--dtype", flag, "--device", "cpu", "--verify"
    )
    base = nc.dense_model(0).to(dtype)
    parameters = dict(base.named_parameters())
    state = fc.read_state(source)
    with torch.no_grad():
        for name, value in {**state, **nc.reference_weights(source, dtype)}.items():
            if name in parameters:
                parameters[name].copy_(value)
    merged = PeftModel.from_pretrained(base, adapter).merge_and_unload().state_dict()
    ours = fc.read_state(out)
    assert ours.keys() == merged.keys()
    for name, value in merged.items():
        assert same_bits(ours[name], value), name


def test_gguf(sources, tmp_path, monkeypatch):
    pytest.importorskip("conversion")
    from test_gguf import assert_same_gguf, converter, dense, pre_tokenizer

    from fixtures.trained_tokenizers import byte_bpe_tokenizer

    source = tmp_path / "tiny-qwen3-ct-mixed"
    shutil.copytree(sources["qwen3-ct-mixed"], source)
    byte_bpe_tokenizer(source, vocab_size=384)
    pre_tokenizer(monkeypatch, "gpt-2")
    expected = converter(dense(source, tmp_path / "dense", "bf16"), "bf16", tmp_path / "expected.gguf", monkeypatch)
    ours = tmp_path / "ours.gguf"
    cli(source, "-o", ours, "--gguf-type", "bf16", "-q", "--device", "cpu")
    assert_same_gguf(expected, ours)


# --- bad input: one line naming the tensor or group, nothing written ---------------------------------------------


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


LAYER = "model.layers.0.mlp.up_proj"


def _set(part: str, value):
    def edit(state, quantization):
        state[f"{LAYER}.{part}"] = value(state[f"{LAYER}.{part}"])

    return edit


def _nan_scale(scale):
    scale = scale.view(torch.uint8).clone()
    scale[3, 2] = 0x7F
    return scale.view(torch.float8_e4m3fn)


def _group(name: str, **changes):
    def edit(state, quantization):
        quantization["config_groups"][name].update(changes)

    return edit


def _ignored(state, quantization):
    quantization["ignore"].append(LAYER)


CASES = {
    "packed of the wrong size": (_set("weight_packed", lambda v: v[:, :-8]), f"'{LAYER}.weight_scale' is F8_E4M3"),
    "packed of part groups": (_set("weight_packed", lambda v: v[:, :-1]), "holds 78 values a row, not whole groups"),
    "packed not U8": (_set("weight_packed", lambda v: v.view(torch.int8)), f"'{LAYER}.weight_packed' is I8"),
    "scale of the wrong shape": (_set("weight_scale", lambda v: v[:-1]), "takes F8_E4M3 [176, 5]"),
    "scale of the wrong dtype": (_set("weight_scale", lambda v: v.to(torch.bfloat16)), "is BF16 [176, 5]"),
    "NaN scale": (_set("weight_scale", _nan_scale), f"'{LAYER}.weight_scale' holds a NaN scale"),
    "NaN global": (_set("weight_global_scale", lambda v: v * float("nan")), "global scale must be finite and nonzero"),
    "inf global": (_set("weight_global_scale", lambda v: v * float("inf")), "global scale must be finite and nonzero"),
    "zero global": (_set("weight_global_scale", lambda v: v * 0), f"'{LAYER}.weight_global_scale' is 0.0"),
    "0-dim global": (_set("weight_global_scale", lambda v: v.reshape(())), "is F32 [], not F32 [1]"),
    "missing global": (
        lambda state, q: state.pop(f"{LAYER}.weight_global_scale"),
        f"has no '{LAYER}.weight_global_scale'",
    ),
    "unread group format": (_group("group_2", format="mxfp4-pack-quantized"), "'group_2' stores its weights as"),
    "shared target": (
        _group("group_1", targets=["re:.*self_attn\\.[qkv]_proj$", "re:.*mlp\\.down_proj$"]),
        "config groups 'group_0' and 'group_1' both target",
    ),
    "ambiguous regexes": (
        _group("group_1", targets=["re:.*self_attn\\.[qkv]_proj$", "re:.*mlp\\.up_proj$"]),
        f"layer '{LAYER}' is matched by the regexes of config groups 'group_0' and 'group_1'",
    ),
    "a group matching nothing": (_group("group_2", targets=["re:.*cross_attn.*"]), "match no layer"),
    "codes no group targets": (_ignored, f"tensor '{LAYER}.weight_packed' holds NVFP4 codes, but no config group"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_refused_in_one_line(sources, tmp_path, case):
    edit, expected = CASES[case]
    bad = edited(sources["qwen3-ct-mixed"], tmp_path / "bad", edit)
    out = tmp_path / "out"
    line = one_error_line(cli(bad, "-o", out, "--device", "cpu", "-q", code=1))
    assert expected in line, line
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["bad"]


@pytest.mark.gpu
def test_cuda_bytes_equal_the_host_and_the_library():
    from compressed_tensors.quantization import QuantizationArgs

    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    args = QuantizationArgs(**nc.NVFP4)
    generator = torch.Generator().manual_seed(3)
    for global_value in (448.0 * 6 / 0.37, 3.0e-30, 7.5e30):
        packed, scales = _random_weight(generator, 301, 37)
        global_scale = torch.tensor([global_value], dtype=torch.float32)
        for dtype in BITS:
            cpu = nvfp4.dequantize(packed, scales, global_scale, dtype)
            gpu = nvfp4.dequantize(packed.cuda(), scales.view(torch.uint8).cuda(), global_scale.cuda(), dtype)
            assert same_bits(gpu.cpu(), cpu)
            on_gpu = nc.library_nvfp4(packed.cuda(), scales.cuda(), global_scale.cuda(), args, dtype)
            assert same_bits(gpu, on_gpu)
