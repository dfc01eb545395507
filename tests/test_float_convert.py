"""FP8, compressed-tensors FP8 and MXFP4 checkpoints converted end to end: every dequantized tensor of the output bit
for bit the reference library's (called here directly, in every output dtype, through pieces that cut blocks and
experts), the device computation the host's, the output loaded by transformers as the dense model (no missing or
unexpected keys, no quantization_config) with the logits of transformers' own ``dequantize=True`` load, the scales
found in any shard and under either name, and bad input refused in one line with nothing written."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from nf4convert.dtypes import output_dtype
from nf4convert.pipeline.routes import cpu as cpu_route
from nf4convert.pipeline.routes.cpu import CpuRoute
from nf4convert.plan import make_plan
from nf4convert.safetensors_io.read import TensorReader
from nf4convert.sinks.safetensors import write_shards

from fixtures import float_checkpoints as fc
from fixtures.cli import cli, one_error_line
from fixtures.no_triton import VERIFIED_WITHOUT, run_without

needs_compressed_tensors = pytest.mark.skipif(
    importlib.util.find_spec("compressed_tensors") is None,
    reason="needs compressed-tensors (pip install compressed-tensors)",
)
OUT = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}
VARIANTS = ["gpt-oss", *fc.FP8_VARIANTS, *fc.COMPRESSED_VARIANTS]


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(BITS[a.dtype]), b.view(BITS[b.dtype]))


def build(folder: Path, variant: str, seed: int = 0) -> Path:
    if variant == "gpt-oss":
        return fc.build_mxfp4(folder, seed=seed)
    if variant in fc.FP8_VARIANTS:
        return fc.build_fp8(folder, variant, seed=seed)
    return fc.build_compressed(folder, variant, seed=seed)


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("float-sources")
    have = importlib.util.find_spec("compressed_tensors") is not None  # the fixtures quantize FP8 with it
    return {variant: build(root / variant, variant) for variant in VARIANTS if have or variant == "gpt-oss"}


def source_of(sources, variant: str) -> Path:
    if variant not in sources:
        pytest.skip("needs compressed-tensors (pip install compressed-tensors)")
    return sources[variant]


@pytest.fixture
def small_pieces(monkeypatch):
    """Pieces of a few kilobytes: FP8 pieces of a few rows of one block row, MXFP4 pieces of a few groups of one
    expert, so that every cut the producers make is exercised."""
    monkeypatch.setattr(CpuRoute, "piece_bytes", 3000)


@pytest.mark.parametrize("flag", list(OUT))
@pytest.mark.parametrize("variant", VARIANTS)
def test_every_tensor_equals_the_reference_in_every_dtype(sources, variant, flag, tmp_path, small_pieces):
    source = source_of(sources, variant)
    out = tmp_path / "out"
    cli(source, "-o", out, "--dtype", flag, "--device", "cpu", "-q")
    got = fc.read_state(out)
    want = fc.reference_weights(source, OUT[flag])
    assert want and set(want) <= set(got)
    for name, value in want.items():
        assert same_bits(got[name], value), name
    state = fc.read_state(source)
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in json.dumps(config) and config["dtype"] == str(OUT[flag]).split(".")[1]
    for name, value in got.items():  # every other tensor is its source's, cast to the output dtype
        if name not in want:
            kept = state[name].dtype == torch.float32 and variant in fc.FP8_VARIANTS  # an FP8 release's fp32 stays
            assert same_bits(value, state[name] if kept else state[name].to(OUT[flag])), name
    assert not [name for name in got if name.endswith(("_scale", "_scale_inv", "_blocks", "_scales"))]


# --- both routes: the device computation gives the host's bytes ---------------------------------------------------


class HostAsDevice(CpuRoute):
    """A GPU route whose device is the CPU: each piece is made by the kind's device computation, on CPU tensors."""

    gpu = True
    piece_bytes = 5000

    def __init__(self):
        super().__init__(processes=0)
        self.device = torch.device("cpu")
        self.on_device = 0  # pieces given a device computation

    def make(self, host, device=None):
        if device is None:  # a cast: on the host on every route
            return host
        self.on_device += 1

        def made(read, out):
            result = device(torch.from_numpy(read), torch.from_numpy(out))
            torch.from_numpy(out).copy_(result)

        return made


@pytest.mark.parametrize(
    "variant", ["gpt-oss", "qwen3-fp8-block128-bf16", "qwen3-ct-fp8-channel", "llama-ct-fp8-tensor"]
)
def test_the_device_computation_gives_the_host_bytes(sources, variant, tmp_path, monkeypatch):
    source = source_of(sources, variant)
    monkeypatch.setattr(cpu_route, "PROCESS_MIN_CORES", 1)  # the host computations in worker processes too
    for flag in OUT:
        plan = make_plan(source, dtype=output_dtype(flag))
        (tmp_path / f"device-{flag}").mkdir()
        (tmp_path / f"host-{flag}").mkdir()
        with TensorReader() as reader:
            with HostAsDevice() as route:
                write_shards(plan, tmp_path / f"device-{flag}", reader, route, progress=lambda n: None)
                assert route.on_device > plan.n_dequantized  # several pieces per dequantized tensor
            with CpuRoute(processes=1) as route:
                route.piece_bytes = 7000
                write_shards(plan, tmp_path / f"host-{flag}", reader, route, progress=lambda n: None)
        device, host = fc.read_state(tmp_path / f"device-{flag}"), fc.read_state(tmp_path / f"host-{flag}")
        assert device.keys() == host.keys()
        for name in host:
            assert same_bits(device[name], host[name]), (flag, name)


# --- the dense model transformers loads ---------------------------------------------------------------------------


def _logits(model) -> torch.Tensor:
    ids = torch.tensor([[1, 5, 77, 300, 2, 9, 120, 45, 8, 3, 250, 17]])
    with torch.no_grad():
        return model(ids).logits


def reference_model(source: Path, variant: str):
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig, FineGrainedFP8Config, Mxfp4Config

    if variant == "gpt-oss":
        config = Mxfp4Config(dequantize=True)
    elif variant in fc.FP8_VARIANTS:
        config = FineGrainedFP8Config(dequantize=True)
    else:
        config = CompressedTensorsConfig(dequantize=True)
    return AutoModelForCausalLM.from_pretrained(source, quantization_config=config, dtype=torch.bfloat16).eval()


# The FP8 checkpoints with ragged blocks are left out: transformers' dequantize=True refuses them (or mis-blocks them:
# test_float_formats shows both); their weights are checked against compressed-tensors and DeepSeek's rule above.
@pytest.mark.parametrize(
    "variant",
    ["gpt-oss", "qwen3-fp8-block32-f32", "llama-fp8-tensor-static", "deepseek-fp8-block16-whole-f32",
     "deepseek-fp8-ue8m0-whole-f32",
     "qwen3-ct-fp8-block-whole", "qwen3-ct-fp8-channel", "llama-ct-fp8-tensor", "qwen3-ct-fp8-block"],
)  # fmt: skip
def test_the_output_loads_as_the_dense_model_with_the_reference_logits(sources, variant, tmp_path):
    from transformers import AutoModelForCausalLM

    source = source_of(sources, variant)
    out = tmp_path / "out"
    cli(source, "-o", out, "--device", "cpu", "-q")
    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert model.dtype == torch.bfloat16 and getattr(model.config, "quantization_config", None) is None
    assert all(not keys for keys in info.values()), info
    if variant in fc.FP8_VARIANTS and fc.FP8_VARIANTS[variant][3] == "weight_scale":
        # transformers' FP8 loader reads '*.weight_scale_inv' only: it would load these codes unscaled
        source = edited(source, tmp_path / "renamed", _renamed_scales)
    reference = reference_model(source, variant)
    loaded = model.state_dict()
    for name, value in reference.state_dict().items():  # parameters and buffers (DeepSeek's fp32 router bias)
        assert same_bits(loaded[name], value), name
    assert torch.equal(_logits(model.eval()), _logits(reference))
    card = (out / "README.md").read_text()
    title = {"gpt-oss": "MXFP4", "qwen3-fp8": "FP8 (e4m3", "llama-fp8": "FP8 (e4m3"}.get(
        variant[:9], "compressed-tensors"
    )
    assert title in card and "bit for bit" in card


# --- scales anywhere; bad input refused in one line, nothing written ---------------------------------------------


def edited(source: Path, folder: Path, edit) -> Path:
    """A copy of ``source`` whose shards are rewritten after ``edit(state, config)`` (tensors by name, config.json);
    each tensor stays in its shard (a new one goes into the last)."""
    shutil.copytree(source, folder)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    config = json.loads((folder / "config.json").read_text())
    state = fc.read_state(folder)
    edit(state, config)
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


def _renamed_scales(state, config) -> None:
    """'*.weight_scale' renamed '*.weight_scale_inv', or back (the same multiplier under its two names)."""
    for name in [k for k in state if k.endswith((".weight_scale", ".weight_scale_inv"))]:
        other = name.removesuffix("_inv") if name.endswith("_inv") else name + "_inv"
        state[other] = state.pop(name)


def test_scales_in_another_shard_and_under_either_name(sources, tmp_path):
    source = source_of(sources, "qwen3-fp8-block32-f32")
    index = json.loads((source / "model.safetensors.index.json").read_text())["weight_map"]
    alone = [name for name, file in index.items() if list(index.values()).count(file) == 1]
    assert alone and alone[0].endswith("weight_scale_inv") and index[alone[0][: -len("_scale_inv")]] != index[alone[0]]

    other = edited(source, tmp_path / "renamed", _renamed_scales)  # vLLM's name of the same multiplier
    cli(source, "-o", tmp_path / "a", "--device", "cpu", "-q")
    cli(other, "-o", tmp_path / "b", "--device", "cpu", "-q")
    first, second = fc.read_state(tmp_path / "a"), fc.read_state(tmp_path / "b")
    assert first.keys() == second.keys() and alone[0].removesuffix("_scale_inv") in first
    for name, value in first.items():
        assert same_bits(value, second[name]), name
    want = fc.reference_weights(source, torch.bfloat16)[alone[0].removesuffix("_scale_inv")]
    assert same_bits(first[alone[0].removesuffix("_scale_inv")], want)


def _first(state, suffix: str) -> str:
    return next(name for name in sorted(state) if name.endswith(suffix))


def _refused(source: Path, tmp_path: Path, edit, *expected: str) -> str:
    bad = edited(source, tmp_path / "bad", edit)
    out = tmp_path / "out"
    line = one_error_line(cli(bad, "-o", out, "--device", "cpu", "-q", code=1))
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name not in ("bad",)], list(tmp_path.iterdir())
    for text in expected:
        assert text in line, line
    return line


def test_a_weight_without_its_scale(sources, tmp_path):
    source = source_of(sources, "qwen3-fp8-block128-bf16")
    name = _first(fc.read_state(source), "_scale_inv")

    def edit(state, config):
        del state[name]

    weight = name.removesuffix("_scale_inv")
    _refused(source, tmp_path, edit, f"tensor '{weight}' is F8_E4M3 without its scale '{name}'")


def test_a_scale_of_the_wrong_shape(sources, tmp_path):
    source = source_of(sources, "qwen3-ct-fp8-channel")

    def edit(state, config):
        name = _first(state, ".weight_scale")
        state[name] = state[name][:-1]

    _refused(source, tmp_path, edit, ".weight_scale' has shape", "(channel)")


def test_a_block_size_that_does_not_tile_as_the_config_says(sources, tmp_path):
    source = source_of(sources, "qwen3-fp8-block32-f32")

    def edit(state, config):
        config["quantization_config"]["weight_block_size"] = [64, 32]

    _refused(source, tmp_path, edit, "weight_block_size", "_scale_inv' has shape")


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_nan_and_infinite_scales(sources, tmp_path, value):
    source = source_of(sources, "llama-fp8-block-small-f16")

    def edit(state, config):
        name = _first(state, "_scale_inv")
        state[name] = state[name].clone()
        state[name][0, -1] = value

    _refused(source, tmp_path, edit, "NaN or infinite scale", "_scale_inv'")


def test_the_mxfp4_nan_scale_byte(sources, tmp_path):
    source = sources["gpt-oss"]

    def edit(state, config):
        name = _first(state, "down_proj_scales")
        state[name] = state[name].clone()
        state[name][-1, 3, -1] = 255

    _refused(source, tmp_path, edit, "down_proj_scales' holds the E8M0 NaN scale (255)")


def test_fp8_weights_without_an_fp8_config(sources, tmp_path):
    source = source_of(sources, "qwen3-fp8-block32-f32")

    def edit(state, config):
        del config["quantization_config"]

    _refused(source, tmp_path, edit, "no FP8 quantization_config")


def test_a_malformed_fp8_config(sources, tmp_path):
    source = source_of(sources, "qwen3-fp8-block32-f32")

    def edit(state, config):
        config["quantization_config"]["scale_fmt"] = "ue4m3"

    _refused(source, tmp_path, edit, f"{tmp_path / 'bad'}: scale_fmt 'ue4m3'")


def test_ue8m0_scales_that_are_not_powers_of_two(sources, tmp_path):
    # the F32 scales of a real FP8 release, under a config that says each is a power of two
    source = source_of(sources, "qwen3-fp8-block32-f32")

    def edit(state, config):
        config["quantization_config"]["scale_fmt"] = "ue8m0"

    _refused(source, tmp_path, edit, "_scale_inv' holds a scale that is not a power of two", "'ue8m0'")


@pytest.mark.parametrize("stored", ["F8_E8M0", "U8"])
def test_the_e8m0_nan_byte_in_fp8_block_scales(sources, tmp_path, stored):
    source = source_of(sources, "qwen3-fp8-ue8m0-e8m0-ragged")
    name = _first(fc.read_state(source), "down_proj.weight_scale_inv")

    def edit(state, config):
        bytes_ = state[name].view(torch.uint8).clone()
        bytes_[-1, -1] = 255
        state[name] = bytes_ if stored == "U8" else bytes_.view(torch.float8_e8m0fnu)

    _refused(source, tmp_path, edit, f"tensor '{name}' holds the E8M0 byte 255 (NaN)")


def test_u8_e8m0_scales_convert_as_transformers_views_them(sources, tmp_path):
    source = source_of(sources, "qwen3-fp8-ue8m0-e8m0-ragged")
    as_bytes = edited(source, tmp_path / "bytes", _scales_as_u8)
    cli(source, "-o", tmp_path / "a", "--device", "cpu", "-q")
    cli(as_bytes, "-o", tmp_path / "b", "--device", "cpu", "-q")
    first, second = fc.read_state(tmp_path / "a"), fc.read_state(tmp_path / "b")
    assert first.keys() == second.keys()
    assert all(same_bits(first[name], second[name]) for name in first)

    def without_ue8m0(state, config):
        _scales_as_u8(state, config)
        del config["quantization_config"]["scale_fmt"]

    (tmp_path / "refused").mkdir()
    _refused(source, tmp_path / "refused", without_ue8m0, "(FP8 scales) is U8, not one of F32, BF16, F16")


def _scales_as_u8(state, config) -> None:
    for name in [k for k in state if k.endswith("_scale_inv")]:
        state[name] = state[name].view(torch.uint8)


def test_activation_scales_are_dropped_and_the_rest_kept(sources, tmp_path):
    source = source_of(sources, "llama-fp8-tensor-static")
    out = tmp_path / "out"
    cli(source, "-o", out, "--device", "cpu", "-q")
    got, state = fc.read_state(out), fc.read_state(source)
    assert any(name.endswith("input_scale") for name in state)
    dense = {name for name in state if not name.endswith(("input_scale", "weight_scale"))}
    assert set(got) == dense
    for name in dense:
        if state[name].dtype not in (torch.float8_e4m3fn,):
            assert same_bits(got[name], state[name]), name
    assert np.all([got[name].dtype == torch.bfloat16 for name in got])


# --- verify: what each tensor is compared against; a flipped byte and a wrong scale caught ------------------------


@pytest.mark.parametrize(
    "variant,against",
    [
        ("gpt-oss", "against transformers"),
        ("qwen3-fp8-block128-bf16", "against compressed-tensors (FP8BlockDequantizer)"),
        ("llama-fp8-tensor-static", "against transformers"),
        ("qwen3-ct-fp8-channel", "against compressed-tensors"),
    ],
)
def test_verify_names_its_references_and_catches_a_flipped_byte_and_a_wrong_scale(sources, variant, against, tmp_path):
    from safetensors.torch import load_file

    source = source_of(sources, variant)
    out = tmp_path / "out"
    cli(source, "-o", out, "--device", "cpu", "-q")
    report = cli("verify", out, source, "--device", "cpu")
    assert "OK: bit-exact" in report and against in report, report
    weight = sorted(fc.reference_weights(source, torch.bfloat16))[1]

    flipped = tmp_path / "flipped"
    shutil.copytree(out, flipped)
    state = load_file(flipped / "model.safetensors")
    raw = state[weight].view(torch.uint8).reshape(-1).clone()
    raw[raw.numel() // 3] ^= 0x01  # the lowest mantissa bit of one value
    state[weight] = raw.view(torch.bfloat16).reshape(state[weight].shape)
    save_file(state, flipped / "model.safetensors", metadata={"format": "pt"})
    report = cli("verify", flipped, source, "--device", "cpu", code=1)
    assert f"{weight}: 1 of " in report and "FAILED: 1 problem" in report, report

    names = (weight + "_scales", weight + "_scale", weight + "_scale_inv")  # MXFP4's, and FP8's under either name
    scale = next(name for name in fc.read_state(source) if name in names)

    def doubled(state, config):
        state[scale] = state[scale].clone()
        state[scale].view(-1)[0] += 1 if state[scale].dtype == torch.uint8 else state[scale].view(-1)[0]

    wrong = edited(source, tmp_path / "wrong-scale", doubled)
    report = cli("verify", out, wrong, "--device", "cpu", code=1)
    assert f"MISMATCH {weight}" in report or f"{weight}: " in report, report
    assert "FAILED: 1 problem" in report, report


@pytest.mark.parametrize(
    "name,stem",
    [
        ("openai/gpt-oss-20b", "gpt-oss-20b"),
        ("someone/gpt-oss-20b-mxfp4", "gpt-oss-20b"),
        ("Qwen/Qwen3-30B-A3B-FP8", "Qwen3-30B-A3B"),
        ("RedHatAI/Qwen3-8B-FP8-dynamic", "Qwen3-8B"),
        ("RedHatAI/Llama-3.1-8B-Instruct-FP8-Dynamic", "Llama-3.1-8B-Instruct"),
        ("deepseek-ai/DeepSeek-V3-0324", "DeepSeek-V3-0324"),
        ("someone/Model-fp8_block", "Model"),
    ],
)
def test_the_default_output_name_drops_the_quantization_suffix(name, stem):
    from nf4convert.hub.names import model_stem

    assert model_stem(name) == stem


def test_a_batch_of_each_format(sources, tmp_path):
    chosen = [
        variant for variant in ("gpt-oss", "qwen3-fp8-block128-bf16", "llama-ct-fp8-tensor") if variant in sources
    ]
    output = cli("batch", *(sources[variant] for variant in chosen), "-o", tmp_path / "root", "--device", "cpu", "-q")
    for variant in chosen:
        folder = tmp_path / "root" / f"{variant}-bf16"
        assert (folder / "model.safetensors").is_file(), output
        want = fc.reference_weights(sources[variant], torch.bfloat16)
        got = fc.read_state(folder)
        assert all(same_bits(got[name], value) for name, value in want.items())


def test_verify_of_an_fp8_output_needs_no_bitsandbytes(sources, tmp_path):
    """bitsandbytes is the reference of its own checkpoints' weights only: an FP8 output verifies without it."""
    source = source_of(sources, "qwen3-fp8-block32-f32")
    cli(source, "-o", tmp_path / "out", "--device", "cpu", "-q")
    result = run_without(("bitsandbytes",), ["-c", VERIFIED_WITHOUT, str(tmp_path / "out"), str(source),
                                             "bitsandbytes"], timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stderr
    verdict, _, dequantized = result.stdout.split()
    assert verdict == "ok" and int(dequantized) > 0, result.stdout


def test_verify_in_slices_smaller_than_an_expert_or_a_block_row(sources, tmp_path, monkeypatch, small_pieces):
    from nf4convert.verification import stream

    monkeypatch.setattr(stream, "CPU_SLICE_BYTES", 2500)  # MXFP4: a few groups of one expert; FP8: single rows
    for variant in ("gpt-oss", "qwen3-fp8-block128-bf16"):
        if variant not in sources:
            continue
        out = tmp_path / variant
        cli(sources[variant], "-o", out, "--device", "cpu", "-q", "--dtype", "fp32")
        assert "OK: bit-exact" in cli("verify", out, sources[variant], "--device", "cpu")


# --- the GPU route ------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("variant", VARIANTS)
def test_the_cuda_route_writes_the_cpu_routes_bytes_and_verifies_on_the_gpu(sources, variant, tmp_path):
    source = source_of(sources, variant)
    for flag in OUT:
        cuda, cpu = tmp_path / f"cuda-{flag}", tmp_path / f"cpu-{flag}"
        cli(source, "-o", cuda, "--dtype", flag, "--device", "cuda", "-q")
        cli(source, "-o", cpu, "--dtype", flag, "--device", "cpu", "-q")
        assert (cuda / "model.safetensors").read_bytes() == (cpu / "model.safetensors").read_bytes(), flag
        assert "OK: bit-exact" in cli("verify", cuda, source, "--device", "cuda")


@pytest.mark.gpu
def test_an_adapter_on_gpt_oss_experts_merged_on_the_gpu_verifies_with_peft_there(sources, tmp_path):
    adapter = fc.make_adapter(
        tmp_path / "adapter",
        "gpt-oss",
        seed=0,
        r=4,
        target_modules=["q_proj"],
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
    )
    out = tmp_path / "out"
    cli(sources["gpt-oss"], "--adapter", adapter, "-o", out, "--device", "cuda", "-q")
    report = cli("verify", out, sources["gpt-oss"], "--adapter", adapter, "--device", "cuda")
    assert "OK: bit-exact" in report and "+ peft" in report
