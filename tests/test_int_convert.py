"""GPTQ, AWQ and compressed-tensors integer checkpoints through the whole tool: converted on each route in pieces
(several per weight, gathered from codes packed transposed), every tensor bit for bit what the quantization means and
what verify's references compute; the output loads in transformers with no missing or unexpected keys and gives the
references' logits; what a dense model has no place for is left out; bad checkpoints are one line and write nothing;
verify names its references and catches a flipped byte and a wrong zero point; dry runs, batches, the Hub, pushes."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from nf4convert import convert
from nf4convert.cli.commands import main
from nf4convert.dtypes import OUTPUT_DTYPES
from nf4convert.formats import base as formats_base
from nf4convert.pipeline.routes.cpu import CpuRoute
from nf4convert.plan import make_plan
from nf4convert.safetensors_io.read import read_tensors
from nf4convert.verification.reference import dequantize_awq as reference_awq
from nf4convert.verification.reference import dequantize_gptq as reference_gptq

from fixtures.cli import cli
from fixtures.int_checkpoints import VARIANTS, build, reference_state
from fixtures.no_triton import VERIFIED_WITHOUT, run_without
from fixtures.processes import package_env
from fixtures.weights import bits

pytest.importorskip("compressed_tensors")

KINDS = {"gptq": "dequantize_gptq", "awq": "dequantize_awq", "ct": "dequantize_compressed_int"}
# a dtype besides auto for each variant, in turn: every one is the reference's output cast
OTHER_DTYPE = ["fp32", "bf16", "fp16"]
ROUTES = ["threads", "processes", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("int-sources")
    return {variant: build(root / variant, variant, seed=index) for index, variant in enumerate(VARIANTS)}


def tensors_of(folder: Path) -> dict[str, torch.Tensor]:
    found = {}
    for shard in sorted(folder.glob("*.safetensors")):
        found.update(load_file(shard))
    return found


# --- every variant, on every route, bit for bit ------------------------------------------------------------------


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_every_tensor_is_the_quantizations_meaning_on_each_route(checkpoints, variant, route, tmp_path, monkeypatch):
    """Pieces of a few hundred bytes: every weight is many pieces, each gathering its columns of codes packed
    transposed; on worker processes too. Auto keeps the scales' dtype; another dtype is that result cast."""
    built = checkpoints[variant]
    if route == "threads":  # pieces of a few rows (a piece is whole packed words of rows: 32 for GPTQ)
        monkeypatch.setattr(CpuRoute, "piece_bytes", 1000 if variant.startswith("gptq-odd") else 3000)
        monkeypatch.setenv("NF4CONVERT_PROCESSES", "0")
    elif route == "processes":  # pieces that fit the workers' slots, so that the workers make them
        monkeypatch.setattr(CpuRoute, "piece_bytes", 48 << 10)
        monkeypatch.setenv("NF4CONVERT_PROCESSES", "2")
    other = OTHER_DTYPE[list(VARIANTS).index(variant) % 3]
    source = {name: value for name, value in load_file(built.folder / "model.safetensors").items()}
    for dtype in ("auto", other):
        out = tmp_path / dtype
        convert(built.folder, out, dtype=dtype, device="cpu" if route != "cuda" else "cuda", progress=False)
        made = tensors_of(out)
        meant = next(iter(built.expected.values())).dtype if dtype == "auto" else OUTPUT_DTYPES_BY_FLAG[dtype]
        assert set(built.expected) <= set(made)
        for name, tensor in made.items():
            expected = built.expected.get(name)  # in the scales' dtype: the reference's output, then its cast
            if expected is None:  # a tensor the quantization left alone: its own values
                expected = source[name]
            expected = expected.to(meant) if expected.is_floating_point() else expected
            assert tensor.dtype == expected.dtype and tensor.shape == expected.shape, name
            assert torch.equal(bits(tensor), bits(expected)), (name, dtype)
        config = json.loads((out / "config.json").read_text())
        assert "quantization_config" not in json.dumps(config) and config["dtype"] == str(meant).removeprefix("torch.")


OUTPUT_DTYPES_BY_FLAG = {dtype.short: dtype.torch for dtype in OUTPUT_DTYPES.values()}


@pytest.mark.parametrize(
    "variant",
    ["gptq-llama-4bit-g32-v1-asym-descact", "gptq-qwen2-4bit-g64-v2-bf16", "gptq-odd-8bit-g64-v1-descact-lmhead",
     "awq-qwen2-gemm-g64-bf16-skip", "awq-llama-gemv-g64", "ct-llama-w4a16-g32-asym-ignore", "ct-llama-mixed-groups"],
)  # fmt: skip
def test_the_output_loads_with_no_stray_keys_and_gives_the_references_logits(checkpoints, variant, tmp_path):
    from transformers import AutoModelForCausalLM

    built = checkpoints[variant]
    out = tmp_path / "out"
    cli(built.folder, "-o", out, "-q", "--device", "cpu", "--max-shard-size", "300KB")
    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info.values()), info  # missing, unexpected, mismatched keys, errors
    reference = AutoModelForCausalLM.from_config(model.config, dtype=model.dtype)
    missing, unexpected = reference.load_state_dict(reference_state(built.folder), strict=False)
    assert not unexpected and all(name == "lm_head.weight" for name in missing)  # a tied head is the embeddings
    reference.tie_weights()
    ids = torch.randint(0, 160, (2, 9), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ours, theirs = model.eval()(input_ids=ids).logits, reference.eval()(input_ids=ids).logits
    assert torch.isfinite(ours).all() and torch.equal(bits(ours), bits(theirs))


def test_the_plan_names_each_weights_kind_and_source_format(checkpoints):
    for variant, built in checkpoints.items():
        plan = make_plan(built.folder)
        kinds = {tensor.name: tensor.recipe.innermost().kind for tensor in plan.tensors}
        assert {name for name, kind in kinds.items() if kind != "copy"} == set(built.expected), variant
        assert set(kinds.values()) == {"copy", KINDS[VARIANTS[variant][0]]}, variant
        method = VARIANTS[variant][0]
        assert plan.source_formats and all(
            fmt.startswith({"gptq": "gptq int", "awq": "awq gem", "ct": "compressed-int int"}[method])
            for fmt in plan.source_formats
        ), plan.source_formats


# --- what the dense model has no place for ------------------------------------------------------------------------


def rewritten(built, folder: Path, change, config_change=None):
    """A copy of a checkpoint with its tensors passed through ``change`` and its quantization_config through
    ``config_change``."""
    folder.mkdir(parents=True)
    tensors = load_file(built.folder / "model.safetensors")
    change(tensors)
    save_file({k: v.contiguous() for k, v in tensors.items()}, folder / "model.safetensors")
    config = json.loads((built.folder / "config.json").read_text())
    if config_change:
        config_change(config["quantization_config"])
    (folder / "config.json").write_text(json.dumps(config))
    return dataclasses.replace(built, folder=folder, quantization=config["quantization_config"])


def test_autogptq_zero_biases_are_left_out_where_the_dense_model_has_none(checkpoints, tmp_path):
    """AutoGPTQ saved a zero bias beside every quantized layer; Llama's projections have none (transformers' GPTQ
    layers never load them), Qwen2's q/k/v have real ones: the first are left out, the second kept."""
    from transformers import AutoModelForCausalLM

    built = checkpoints["gptq-llama-4bit-g32-v1-sym"]

    def zero_biases(tensors):
        for name in [n for n in tensors if n.endswith(".qweight")]:
            tensors[name.replace(".qweight", ".bias")] = torch.zeros(tensors[name].shape[1], dtype=torch.float16)

    source = rewritten(built, tmp_path / "with-biases", zero_biases)
    out = tmp_path / "out"
    cli(source.folder, "-o", out, "-q", "--device", "cpu")
    made = tensors_of(out)
    assert not [name for name in made if name.endswith(".bias")] and set(built.expected) <= set(made)
    _, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info.values()), info
    assert "OK: bit-exact" in cli("verify", out, source.folder, "--device", "cpu", "-q")
    qwen = make_plan(checkpoints["gptq-qwen2-4bit-g64-v2-bf16"].folder)
    assert {t.name for t in qwen.tensors if t.name.endswith(".bias")} == {
        f"model.layers.{layer}.self_attn.{proj}_proj.bias" for layer in (0, 1) for proj in "qkv"
    }


def test_activation_and_kv_cache_scales_are_left_out_and_the_card_says_so(checkpoints, tmp_path):
    """A W8A8-style scheme's input scales and zero points and the KV cache's scales: quantization of activations,
    which a dense model does not do."""
    built = checkpoints["ct-llama-w4a16-g32-sym"]

    def activations(tensors):
        for name in [n for n in tensors if n.endswith(".weight_packed")]:
            module = name.removesuffix(".weight_packed")
            tensors[module + ".input_scale"] = torch.tensor([0.02], dtype=torch.bfloat16)
            tensors[module + ".input_zero_point"] = torch.tensor([3], dtype=torch.int8)
        for layer in (0, 1):
            for part in ("k_scale", "v_scale"):
                tensors[f"model.layers.{layer}.self_attn.{part}"] = torch.tensor(0.5, dtype=torch.bfloat16)

    def kv_cache(quantization):
        quantization["kv_cache_scheme"] = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}

    source = rewritten(built, tmp_path / "w4a8", activations, kv_cache)
    out = tmp_path / "out"
    cli(source.folder, "-o", out, "-q", "--device", "cpu")
    made = tensors_of(out)
    assert set(made) == set(tensors_of_plain(built)) | set(built.expected)
    assert all(formats_base.quantization_key(name) is None for name in made)
    assert "Activation quantization" in (out / "README.md").read_text()
    assert "OK: bit-exact" in cli("verify", out, source.folder, "--device", "cpu", "-q")
    for name in ("model.layers.0.mlp.up_proj.input_scale", "model.layers.1.self_attn.v_scale"):
        assert formats_base.quantization_key(name) is not None


def tensors_of_plain(built) -> list[str]:
    """The source tensors that are no quantized layer's part: what passes through."""
    names = read_tensors(built.folder)
    return [name for name in names if formats_base.quantization_key(name) is None and name not in built.expected]


def test_compressed_tensors_layers_of_a_float_group_are_another_formats(checkpoints, tmp_path):
    """One config, an integer group (ours) and a float group (fp8, another format's): each layer goes to its group's
    format, the integer ones here, and nothing is refused because the other group is there."""
    built = checkpoints["ct-llama-w4a16-g32-sym"]
    attention = [f"model.layers.{layer}.self_attn.{p}_proj" for layer in (0, 1) for p in "qkvo"]

    def fp8_attention(tensors):
        for module in attention:
            packed = tensors.pop(module + ".weight_packed")
            tensors.pop(module + ".weight_shape")
            scale = tensors.pop(module + ".weight_scale")
            tensors[module + ".weight"] = torch.randn(packed.shape[0], 128).to(torch.float8_e4m3fn)
            tensors[module + ".weight_scale"] = scale[:, :1].float()

    def float_group(quantization):
        quantization["format"] = "mixed-precision"
        quantization["config_groups"]["group_0"]["targets"] = ["re:.*mlp.*"]
        quantization["config_groups"]["group_1"] = {
            "targets": ["re:.*self_attn.*"],
            "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False},
            "format": "float-quantized",
        }

    source = rewritten(built, tmp_path / "mixed", fp8_attention, float_group)
    plan = make_plan(source.folder)
    kinds = {tensor.name: tensor.recipe.innermost().kind for tensor in plan.tensors}
    ours = {name for name, kind in kinds.items() if kind == "dequantize_compressed_int"}
    assert ours == {name for name in built.expected if ".mlp." in name}
    assert not {f"{module}.weight" for module in attention} & ours


# --- bad checkpoints: one line, nothing written -------------------------------------------------------------------

LAYER = "model.layers.0.mlp.down_proj."


def _set(key, value):
    return lambda tensors: tensors.__setitem__(LAYER + key, value(tensors[LAYER + key]))


def _forty_columns(tensors):
    """A 3-bit layer of 40 input columns: 4 packed rows, a block of 3 words and one word of the next."""
    tensors[LAYER + "qweight"] = tensors[LAYER + "qweight"][:4].clone()
    tensors[LAYER + "g_idx"] = tensors[LAYER + "g_idx"][:40].clone()


BAD = [
    ("gptq-llama-4bit-g32-v1-sym", _set("qweight", lambda t: t[:-1]), None, f"{LAYER}qweight' has shape"),
    ("gptq-llama-4bit-g32-v1-asym-descact", _set("g_idx", lambda t: t.clone().index_fill_(0, torch.tensor([7]), 10)),
     None, f"{LAYER}g_idx' holds groups 0..10, outside 0..9"),
    ("gptq-llama-4bit-g32-v1-sym", _set("qzeros", lambda t: t[:, :-1]), None, f"{LAYER}qzeros' has shape"),
    ("gptq-llama-4bit-g32-v1-sym", _set("scales", lambda t: t[:-1]), None, f"{LAYER}scales' has shape"),
    ("gptq-llama-4bit-g32-v1-sym", lambda t: None, lambda c: c.update(checkpoint_format="marlin"),
     "checkpoint_format 'marlin' is not a GPTQ layout"),
    ("gptq-llama-3bit-gnone-v2", _forty_columns, None, f"{LAYER}qweight' ends inside a 3-word block"),
    ("awq-llama-gemm-g32", _set("qweight", lambda t: t[:, :-1]), None, f"{LAYER}qweight' has shape"),
    ("awq-llama-gemm-g32", _set("qzeros", lambda t: t[:-1]), None, f"{LAYER}qzeros' has shape"),
    ("awq-llama-gemv-g32", _set("scales", lambda t: t[:, :-8]), None, f"{LAYER}scales' has shape"),
    ("awq-llama-gemm-g32", lambda t: None, lambda c: c.update(version="gemv_fast"), "version 'gemv_fast' is not"),
    ("ct-llama-w2a16-g64-asym", _set("weight_packed", lambda t: t[:, :-1]), None, f"{LAYER}weight_packed' has shape"),
    ("ct-llama-w2a16-g64-asym", _set("weight_zero_point", lambda t: t[:-1]), None,
     f"{LAYER}weight_zero_point' has shape"),
    ("ct-llama-w2a16-g64-asym", _set("weight_scale", lambda t: t[:, :-1]), None, f"{LAYER}weight_scale' has shape"),
    ("ct-llama-w4a16-g32-sym", lambda t: None, lambda c: c.update(format="marlin-24", config_groups={
        "group_0": {**c["config_groups"]["group_0"], "format": None}}), "no config group has integer weights"),
]  # fmt: skip


@pytest.mark.parametrize("variant, change, config_change, message", BAD)
def test_a_bad_checkpoint_is_one_line_naming_the_tensor_and_nothing_is_written(
    checkpoints, tmp_path, variant, change, config_change, message
):
    source = rewritten(checkpoints[variant], tmp_path / "source" / variant, change, config_change)
    out = tmp_path / "out"
    result = subprocess.run(
        [sys.executable, "-m", "nf4convert", str(source.folder), "-o", str(out), "-q", "--device", "cpu"],
        capture_output=True,
        text=True,
        env=package_env(),
        timeout=300,
    )
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 1 and len(lines) == 1, result.stderr
    assert lines[0].startswith("Error: ") and message in lines[0], lines[0]
    assert not result.stdout and sorted(path.name for path in tmp_path.iterdir()) == ["source"]


# --- verify -------------------------------------------------------------------------------------------------------

VERIFIED = "model.layers.0.mlp.up_proj."  # a layer every variant below quantizes
# the versions verify names: the gptqmodel a reference restates (its own constant), the compressed-tensors installed
AGAINST = {
    "gptq": f"gptqmodel {reference_gptq.VERSION} (its torch kernel's arithmetic, restated)",
    "awq": f"gptqmodel {reference_awq.VERSION} (its AWQ dequantize_gemm arithmetic, restated)",
    "ct": f"compressed-tensors {metadata.version('compressed-tensors')}",
}


@pytest.mark.parametrize("variant", ["gptq-llama-4bit-g32-v1-asym-descact", "awq-llama-gemm-g32",
                                     "ct-llama-w4a16-g32-asym-ignore"])  # fmt: skip
def test_verify_names_its_reference_and_catches_a_flipped_byte_and_a_wrong_zero_point(checkpoints, variant, tmp_path):
    built = checkpoints[variant]
    method = VARIANTS[variant][0]
    out = tmp_path / "out"
    cli(built.folder, "-o", out, "-q", "--device", "cpu")
    report = cli("verify", out, built.folder, "--device", "cpu")
    count = len(built.expected)
    assert f"({count} against {AGAINST[method]}, " in report and f"OK: bit-exact with {AGAINST[method]}" in report

    # one byte of one dequantized weight flipped
    name = f"{VERIFIED}weight"
    tensors = tensors_of(out)
    flipped = tensors[name].clone()
    flipped.view(-1).view(torch.int16)[33] ^= 0x0100
    save_file({**tensors, name: flipped}, out / "model.safetensors", metadata={"format": "pt"})
    failed = cli("verify", out, built.folder, "--device", "cpu", code=1)
    assert f"{name}: 1 of" in failed and f"differ from {AGAINST[method]}" in failed and "FAILED: 1 problem" in failed

    # an output made with one zero point wrong (the first group's zero of the layer's first output row, plus one)
    zeros = {"gptq": "qzeros", "awq": "qzeros", "ct": "weight_zero_point"}[method]

    def wrong_zero(tensors):
        tensors[VERIFIED + zeros] = tensors[VERIFIED + zeros].clone()
        tensors[VERIFIED + zeros].view(-1)[0] ^= 1  # the first field of the first word: row 0's first group

    wrong = rewritten(built, tmp_path / "wrong-zero", wrong_zero)
    cli(wrong.folder, "-o", tmp_path / "wrong-out", "-q", "--device", "cpu")
    failed = cli("verify", tmp_path / "wrong-out", built.folder, "--device", "cpu", code=1)
    assert f"{name}: " in failed and f"differ from {AGAINST[method]}" in failed and "FAILED: 1 problem" in failed


def test_verify_without_compressed_tensors_says_what_to_install(checkpoints, tmp_path):
    built = checkpoints["ct-llama-w4a16-g32-sym"]
    cli(built.folder, "-o", tmp_path / "out", "-q", "--device", "cpu")
    blocker = tmp_path / "blocker"
    blocker.mkdir()
    (blocker / "compressed_tensors.py").write_text("raise ImportError('not here')\n")
    result = subprocess.run(
        [sys.executable, "-m", "nf4convert", "verify", str(tmp_path / "out"), str(built.folder), "--device", "cpu"],
        capture_output=True,
        text=True,
        env=package_env(PYTHONPATH=f"{Path(__file__).resolve().parents[1]}:{blocker}"),
        timeout=300,
    )
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode != 0 and len(lines) == 1, result.stderr
    assert "compressed_tensors, which cannot be imported" in lines[0] and "pip install compressed-tensors" in lines[0]


def test_verify_of_a_gptq_output_needs_no_bitsandbytes(checkpoints, tmp_path):
    """bitsandbytes is the reference of its own checkpoints' weights only, as compressed-tensors is of its own."""
    built = checkpoints["gptq-llama-4bit-g32-v1-asym-descact"]
    cli(built.folder, "-o", tmp_path / "out", "-q", "--device", "cpu")
    result = run_without(("bitsandbytes",), ["-c", VERIFIED_WITHOUT, str(tmp_path / "out"), str(built.folder),
                                             "bitsandbytes"], timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.split()[:1] == ["ok"] and int(result.stdout.split()[2]) == len(built.expected), result.stdout


# --- names, dry runs, batches, the card ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name,stem",
    [
        ("Qwen/Qwen2.5-7B-Instruct-GPTQ-Int4", "Qwen/Qwen2.5-7B-Instruct"),
        ("Qwen2.5-7B-Instruct-GPTQ-Int8", "Qwen2.5-7B-Instruct"),
        ("TheBloke/Llama-2-7B-GPTQ", "TheBloke/Llama-2-7B"),
        ("vicuna-13B-1.1-GPTQ-4bit-128g", "vicuna-13B-1.1"),
        ("TheBloke/Mistral-7B-v0.1-AWQ", "TheBloke/Mistral-7B-v0.1"),
        ("Qwen2.5-7B-Instruct-awq", "Qwen2.5-7B-Instruct"),
        ("RedHatAI/Meta-Llama-3.1-8B-Instruct-quantized.w4a16", "RedHatAI/Meta-Llama-3.1-8B-Instruct"),
        ("Llama-3.1-8B-Instruct-W4A16", "Llama-3.1-8B-Instruct"),
        ("Qwen3-8B-W8A8", "Qwen3-8B"),
        ("m-w4a16-asym", "m"),
        ("m-gptqx", "m-gptqx"),
        ("m-awqward", "m-awqward"),
        ("my-w4a16x", "my-w4a16x"),
    ],
)
def test_a_quantization_suffix_is_dropped_from_the_default_name(name, stem):
    assert formats_base.name_suffix().sub("", name) == stem


def test_dry_run_batch_and_card(checkpoints, tmp_path, monkeypatch):
    import shutil

    monkeypatch.chdir(tmp_path)
    names = {"gptq-llama-4bit-g32-v1-sym": "a-GPTQ-Int4", "awq-llama-gemm-g32": "b-AWQ",
             "ct-llama-w4a16-g32-sym": "c-W4A16"}  # fmt: skip
    for variant, name in names.items():
        shutil.copytree(checkpoints[variant].folder, tmp_path / name)
    for name, label in zip(names.values(), ("GPTQ", "AWQ", "compressed-tensors integers")):
        planned = cli(name, "-o", "root", "--dry-run")
        assert f"tensors: 21 (7 copied, 14 dequantized from {label})" in planned, planned
    assert not (tmp_path / "root").exists()
    rows = CliRunner().invoke(main, ["batch", *names.values(), "-o", "root", "-q", "--device", "cpu", "--verify",
                                     "--json"], catch_exceptions=False)  # fmt: skip
    assert rows.exit_code == 0, rows.output
    found = {Path(row["source"]).name: row for row in map(json.loads, rows.stdout.splitlines())}
    assert {row["status"] for row in found.values()} == {"verified"}
    assert sorted(path.name for path in (tmp_path / "root").iterdir()) == ["a-fp16", "b-fp16", "c-bf16"]
    cards = {name: (tmp_path / "root" / name / "README.md").read_text() for name in ("a-fp16", "b-fp16", "c-bf16")}
    assert "a local GPTQ INT4 checkpoint" in cards["a-fp16"] and "GPTQModel's torch kernel" in cards["a-fp16"]
    assert "a local AWQ GEMM checkpoint" in cards["b-fp16"] and "dequantize_gemm" in cards["b-fp16"]
    assert "a local compressed-tensors INT4 checkpoint" in cards["c-bf16"]
    assert "decompression gives" in cards["c-bf16"] and "is not kept" in cards["c-bf16"]


# --- the Hub: downloaded, dry runs that read only what a plan reads, pushes ----------------------------------------


@pytest.fixture(scope="module")
def int_hub(checkpoints):
    import threading
    from http.server import ThreadingHTTPServer

    from test_hub import FakeHub

    class IntHub(FakeHub):
        repos = {
            f"test-org/tiny-{variant}": {
                path.name: path.read_bytes() for path in checkpoints[variant].folder.iterdir() if path.is_file()
            }
            for variant in ("gptq-llama-4bit-g32-v1-asym-descact", "awq-llama-gemv-g32", "ct-llama-w2a16-g64-asym")
        }
        requested, ranges = [], []

    server = ThreadingHTTPServer(("127.0.0.1", 0), IntHub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", IntHub
    server.shutdown()


@pytest.mark.parametrize("variant", ["gptq-llama-4bit-g32-v1-asym-descact", "awq-llama-gemv-g32",
                                     "ct-llama-w2a16-g64-asym"])  # fmt: skip
def test_from_the_hub_a_dry_run_reads_only_what_a_plan_reads_and_the_conversion_is_the_local_one(
    checkpoints, int_hub, variant, tmp_path
):
    from test_hub import SMALL_LIMITS
    from test_hub import cli as hub_cli

    endpoint, hub = int_hub
    repo = f"test-org/tiny-{variant}"
    env = {"HF_ENDPOINT": endpoint, "HF_HUB_DISABLE_XET": "1"}
    hub.ranges.clear()
    dry = hub_cli(repo, "--dry-run", "-q", "--cache-dir", tmp_path / "cache", env=env, cwd=tmp_path, patch=SMALL_LIMITS)
    assert dry.returncode == 0 and "no weights downloaded" in dry.stdout, dry.stderr
    tensors = read_tensors(checkpoints[variant].folder)
    header_end = min(info.begin for info in tensors.values())
    wanted = [info for info in tensors.values() if formats_base.plan_reads().search(info.name)]
    for _, _, first, end in hub.ranges:  # the header, or the tensors a plan reads (g_idx, weight_shape)
        assert end <= max(header_end, 1024) or all(
            any(info.begin <= byte < info.end for info in wanted) for byte in (first, end - 1)
        ), (first, end)
    done = hub_cli(repo, "-q", "-o", tmp_path / "hub-out", "--cache-dir", tmp_path / "cache", env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    local = tmp_path / "local-out"
    cli(checkpoints[variant].folder, "-o", local, "-q", "--device", "cpu")
    assert (tmp_path / "hub-out" / "model.safetensors").read_bytes() == (local / "model.safetensors").read_bytes()


def test_converted_verified_and_pushed(checkpoints, tmp_path):
    from fixtures.fake_hub import WRITE_TOKEN, client_env, serve

    built = checkpoints["awq-qwen2-gemm-g64-bf16-skip"]
    out = tmp_path / "out"
    with serve() as (endpoint, state):
        env = client_env(endpoint, tmp_path / "home", HF_XET_XORB_COMPRESSION_POLICY="none", HF_HUB_DISABLE_XET="1")
        command = [sys.executable, "-m", "nf4convert", str(built.folder), "-o", str(out), "--device", "cpu", "-q",
                   "--verify", "--push-to-hub", "me/tiny-awq-bf16", "--token", WRITE_TOKEN]  # fmt: skip
        result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
        assert result.returncode == 0, result.stderr
        assert f"OK: bit-exact with {AGAINST['awq']}" in result.stdout
        pushed = state.repos["me/tiny-awq-bf16"]["branches"]["main"]
        files = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
        assert {name: pushed[name] for name in files} == files


# --- the GPU route against GPTQModel itself -----------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("variant", [v for v in VARIANTS if v.startswith(("gptq", "awq-llama-gemm", "awq-qwen2"))])
def test_the_cuda_route_equals_gptqmodel_on_cuda(checkpoints, variant, tmp_path):
    """The conversion on a GPU, every weight, against GPTQModel's own kernels run on that GPU (its TorchLinear after
    its v1 conversion, the first layer through torch.compile; AWQ's dequantize_gemm)."""
    pytest.importorskip("gptqmodel")
    from test_int_formats import _GPTQMODEL

    built = checkpoints[variant]
    out = tmp_path / "out"
    cli(built.folder, "-o", out, "-q", "--device", "cuda")
    theirs = tmp_path / "gptqmodel.safetensors"
    run = subprocess.run(
        [sys.executable, "-c", _GPTQMODEL, str(built.folder), str(theirs), "cuda"],
        env=package_env(),
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    made, reference = tensors_of(out), load_file(theirs)
    assert set(reference) == set(built.expected)
    for name, dense in reference.items():
        assert torch.equal(bits(made[name]), bits(dense.to(made[name].dtype))), name
