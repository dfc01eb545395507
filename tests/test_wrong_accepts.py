"""Checkpoints that once converted into a wrong model with exit 0: each is kept right, or refused in one line naming
the tensor (or the setting), exit 1, nothing written, on every route (convert, a dry run, a GGUF output, batch, the
Hub); and verify of an output planted with the wrong values fails. Tiny checkpoints, built once, then each changed
in one way in a test's own folder."""

from __future__ import annotations

import contextlib
import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from fixtures.cli import cli, invoke, one_error_line
from fixtures.int_checkpoints import build

pytest.importorskip("compressed_tensors")

QWEN2_GPTQ = "gptq-qwen2-4bit-g64-v2-bf16"


FLOAT_BUILDS = {"fp8": "llama-fp8-block-small-f16", "ct-fp8": "qwen3-ct-fp8-block"}


def _build(folder: Path, variant: str) -> Path:
    """``variant``: one of int_checkpoints' variants, "fp8" or "ct-fp8" (float_checkpoints') or "mxfp4"."""
    from fixtures import float_checkpoints

    if variant == "mxfp4":
        return float_checkpoints.build_mxfp4(folder)
    if variant == "fp8":
        return float_checkpoints.build_fp8(folder, FLOAT_BUILDS[variant])
    if variant == "ct-fp8":
        return float_checkpoints.build_compressed(folder, FLOAT_BUILDS[variant])
    return build(folder, variant).folder


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """variant -> its checkpoint's folder, built on first use (read only: a test changes its own copy)."""
    root, folders = tmp_path_factory.mktemp("wrong-accepts"), {}

    def folder(variant: str) -> Path:
        if variant not in folders:
            folders[variant] = _build(root / variant, variant)
        return folders[variant]

    return folder


def copy_of(built, variant: str, into: Path) -> Path:
    """A copy of ``variant``'s checkpoint in ``into``, for a test to change."""
    shutil.copytree(built(variant), into)
    return into


def edit_config(folder: Path, change) -> None:
    config = json.loads((folder / "config.json").read_text())
    change(config)
    (folder / "config.json").write_text(json.dumps(config))


def edit_quantization(folder: Path, change) -> None:
    edit_config(folder, lambda config: change(config["quantization_config"]))


def edit_tensors(folder: Path, change) -> None:
    """``change`` (of a dict name -> tensor: every shard's) applied to the checkpoint: each tensor stays in its
    shard, a new one goes in the first, the index follows."""
    files = sorted(folder.glob("*.safetensors"))
    shard_of, tensors = {}, {}
    for file in files:
        for name, value in load_file(file).items():
            shard_of[name], tensors[name] = file, value
    change(tensors)
    for file in files:
        kept = {k: v.contiguous() for k, v in tensors.items() if shard_of.get(k, files[0]) == file}
        save_file(kept, file, metadata={"format": "pt"})
    index = folder / "model.safetensors.index.json"
    if index.exists():
        data = json.loads(index.read_text())
        data["weight_map"] = {name: shard_of.get(name, files[0]).name for name in tensors}
        index.write_text(json.dumps(data))


# --- GPTQ biases -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("architectures", [True, False], ids=["architectures", "no-architectures"])
def test_gptq_q_k_v_biases_are_kept(built, tmp_path, architectures):
    """Qwen2's q/k/v projections have biases: every one is written as it is, with or without ``architectures`` in
    config.json (without it transformers builds the base model, whose layer names lack the head's prefix)."""
    source = copy_of(built, QWEN2_GPTQ, tmp_path / "source")
    if not architectures:
        edit_config(source, lambda config: config.pop("architectures"))
    biases = {name: value for name, value in load_file(source / "model.safetensors").items() if name.endswith(".bias")}
    assert len(biases) == 6  # q, k and v of two layers
    out = tmp_path / "out"
    cli(source, "-o", out, "-q", "--device", "cpu")
    made = load_file(out / "model.safetensors")
    for name, value in biases.items():
        assert name in made and torch.equal(made[name], value), name
    assert "OK: bit-exact" in cli("verify", out, source, "--device", "cpu", "-q")


def test_autogptq_zero_biases_of_layers_without_bias_are_still_left_out(built, tmp_path):
    """AutoGPTQ's zero biases beside Llama's projections (which have none) are not written, also where config.json
    has no ``architectures``."""
    source = copy_of(built, "gptq-llama-4bit-g32-v1-sym", tmp_path / "source")
    edit_config(source, lambda config: config.pop("architectures"))

    def add_zero_biases(tensors):
        for name in [name for name in tensors if name.endswith(".qweight")]:
            tensors[name.removesuffix("qweight") + "bias"] = torch.zeros(tensors[name].shape[1], dtype=torch.float16)

    edit_tensors(source, add_zero_biases)
    out = tmp_path / "out"
    cli(source, "-o", out, "-q", "--device", "cpu")
    assert not [name for name in load_file(out / "model.safetensors") if name.endswith(".bias")]


def test_verify_names_a_bias_the_output_lacks_that_the_source_holds(built, tmp_path, monkeypatch):
    """Where a conversion leaves out biases the source holds (planted: a plan that drops them, for the conversion
    and verify alike), verify says the source holds them and the output lacks them."""
    from nf4convert.formats import gptq

    source = built(QWEN2_GPTQ)

    def every_bias(weights, tensors, config):
        return {weight.name.removesuffix("weight") + "bias" for weight in weights} & set(tensors)

    monkeypatch.setattr(gptq, "unused_biases", every_bias)
    out = tmp_path / "out"
    cli(source, "-o", out, "-q", "--device", "cpu")
    report = cli("verify", out, source, "--device", "cpu", "-q", code=1)
    assert (
        "model.layers.0.self_attn.q_proj.bias: transformers' Qwen2ForCausalLM has this parameter and the source "
        "holds it ('model.layers.0.self_attn.q_proj.bias'), but the output lacks it" in report
    ), report
    assert "the source and the output lack" not in report


# --- refused in one line, nothing written, on every route ----------------------------------------------------------

CT_INT4, CT_NAIVE = "ct-llama-w4a16-g32-sym", "ct-llama-naive-w8-g32-asym"
CT_NAIVE_SYM, GPTQ = "ct-llama-naive-w8-channel-sym", "gptq-llama-4bit-g32-v1-sym"
Q = "model.layers.0.self_attn.q_proj."
AWQ_GEMM, AWQ_GEMV = "awq-llama-gemm-g32", "awq-llama-gemv-g32"


def _fp8_instead_of_gptq(tensors):
    for part in ("qweight", "qzeros", "scales", "g_idx"):
        tensors.pop(Q + part)
    tensors[Q + "weight"] = torch.randn(128, 128).to(torch.float8_e4m3fn)


def _poison(tensors, name, value):
    """One scale made ``value``, in the first row's first group (the GEMV layout's padding is past its groups)."""
    tensors[name] = tensors[name].clone()
    tensors[name][0, 0] = value


def _recoded(tensors, dtype):
    tensors[Q + "weight"] = (tensors[Q + "weight"].to(torch.int16) + 128).to(dtype)


def _gptq_layer(tensors):
    prefix = "model.layers.0.mlp.extra."
    tensors.update({prefix + "qweight": torch.zeros(4, 32, dtype=torch.int32),
                    prefix + "qzeros": torch.zeros(1, 4, dtype=torch.int32),
                    prefix + "scales": torch.ones(1, 32, dtype=torch.float16),
                    prefix + "g_idx": torch.zeros(32, dtype=torch.int32)})  # fmt: skip


def _float4_group(quantization):
    quantization["config_groups"]["group_1"] = {
        "targets": ["re:.*mlp.*"],
        "weights": {"num_bits": 4, "type": "float", "strategy": "group", "group_size": 16, "symmetric": True},
        "format": "float-quantized",
    }


def _int_as_float_group(quantization):
    _float4_group(quantization)
    quantization["config_groups"]["group_1"]["weights"]["type"] = "int"


# name -> (variant, change(folder), what the error line says)
CASES = {
    # compressed-tensors settings that say the weights are no compressed ones, for every source
    "ct-int-frozen": (CT_INT4, lambda f: edit_quantization(f, lambda q: q.update(quantization_status="frozen")),
                      "quantization_status is 'frozen'"),
    "ct-fp8-frozen": ("ct-fp8", lambda f: edit_quantization(f, lambda q: q.update(quantization_status="frozen")),
                      "quantization_status is 'frozen'"),
    "ct-int-sparse": (CT_INT4, lambda f: edit_quantization(
        f, lambda q: q.update(sparsity_config={"format": "sparse-24-bitmask", "targets": ["Linear"]})),
        "sparsity_config format 'sparse-24-bitmask'"),
    "ct-fp8-transform": ("ct-fp8", lambda f: edit_quantization(
        f, lambda q: q.update(transform_config={"config_groups": {"u": {"type": "hadamard"}}})),
        "transform_config (online rotations)"),
    "ct-naive-transform": (CT_NAIVE, lambda f: edit_quantization(
        f, lambda q: q.update(transform_config={"config_groups": {"u": {"type": "hadamard"}}})),
        "transform_config (online rotations)"),
    # config shapes compressed-tensors never writes
    "ct-groups-a-list": (CT_INT4, lambda f: edit_quantization(
        f, lambda q: q.update(config_groups=list(q["config_groups"].values()))), "config_groups is [{"),
    "ct-fp8-groups-a-list": ("ct-fp8", lambda f: edit_quantization(
        f, lambda q: q.update(config_groups=list(q["config_groups"].values()))), "config_groups is [{"),
    "ct-group-a-string": (CT_INT4, lambda f: edit_quantization(f, lambda q: q["config_groups"].update(group_0="x")),
                          "config group 'group_0' is 'x', not a mapping"),
    "ct-targets-a-number": (CT_INT4, lambda f: edit_quantization(
        f, lambda q: q["config_groups"]["group_0"].update(targets=3)), "targets is 3, not a list"),
    "ct-target-a-bad-regex": (CT_INT4, lambda f: edit_quantization(
        f, lambda q: q["config_groups"]["group_0"].update(targets=["re:("])), "not a valid regular expression"),
    "ct-weights-a-string": (CT_INT4, lambda f: edit_quantization(
        f, lambda q: q["config_groups"]["group_0"].update(weights="w4a16")), "weights is 'w4a16', not a dict"),
    "ct-group-size-a-string": (CT_INT4, lambda f: edit_quantization(
        f, lambda q: q["config_groups"]["group_0"]["weights"].update(group_size="32")),
        "weights group_size is '32', not a int"),
    "ct-ignore-a-number": (CT_INT4, lambda f: edit_quantization(f, lambda q: q.update(ignore=3)),
                           "ignore is 3, not a list"),
    "ct-ignore-of-numbers": (CT_INT4, lambda f: edit_quantization(f, lambda q: q.update(ignore=[1])),
                             "ignore holds 1"),
    "ct-sparsity-a-string": (CT_INT4, lambda f: edit_quantization(f, lambda q: q.update(sparsity_config="x")),
                             "sparsity_config is 'x'"),
    # a group whose weights no format reads
    "ct-float4-group": (CT_INT4, lambda f: edit_quantization(f, _float4_group),
                        "config group 'group_1' quantizes 4-bit float weights, not read yet"),
    "ct-int-as-float-group": (CT_INT4, lambda f: edit_quantization(f, _int_as_float_group),
                              "config group 'group_1' stores 4-bit 'int' weights as 'float-quantized'"),
    # quantized codes with no scale, copied raw as a dense weight
    "ct-naive-scale-missing": (CT_NAIVE_SYM, lambda f: edit_tensors(f, lambda t: t.pop(Q + "weight_scale")),
                               f"tensor '{Q}weight' is I8: quantized codes"),
    "gptq-fp8-weight-no-scale": (GPTQ, lambda f: edit_tensors(f, _fp8_instead_of_gptq),
                                 f"tensor '{Q}weight' is F8_E4M3: quantized codes"),
    # quantization tensors no reader claimed
    "ct-packed-missing": (CT_INT4, lambda f: edit_tensors(f, lambda t: t.pop(Q + "weight_packed")),
                          "is compressed-tensors quantization data that no quantized weight"),
    "ct-naive-as-uint8": (CT_NAIVE_SYM, lambda f: edit_tensors(f, lambda t: _recoded(t, torch.uint8)), f"'{Q}weight"),
    "ct-naive-as-int16": (CT_NAIVE_SYM, lambda f: edit_tensors(f, lambda t: _recoded(t, torch.int16)), f"'{Q}weight"),
    "gptq-layer-in-ct": (CT_INT4, lambda f: edit_tensors(f, _gptq_layer),
                         "tensor 'model.layers.0.mlp.extra.g_idx' is GPTQ quantization data"),
    # a layer stored dense beside its quantized codes
    "gptq-dense-beside": (GPTQ, lambda f: edit_tensors(
        f, lambda t: t.__setitem__(Q + "weight", torch.zeros(128, 128, dtype=torch.float16))),
        f"tensor '{Q}weight' and tensor '{Q}qweight' (a quantized weight) both make '{Q}weight'"),
    # non-finite scales
    "gptq-nan-scale": (GPTQ, lambda f: edit_tensors(f, lambda t: _poison(t, Q + "scales", math.nan)),
                       f"tensor '{Q}scales' (GPTQ scales) holds a NaN or infinite scale"),
    "gptq-bf16-inf-scale": (QWEN2_GPTQ, lambda f: edit_tensors(f, lambda t: _poison(t, Q + "scales", -math.inf)),
                            f"tensor '{Q}scales' (GPTQ scales) holds a NaN or infinite scale"),
    "awq-gemm-nan-scale": (AWQ_GEMM, lambda f: edit_tensors(f, lambda t: _poison(t, Q + "scales", math.nan)),
                           f"tensor '{Q}scales' (AWQ scales) holds a NaN or infinite scale"),
    "awq-gemv-inf-scale": (AWQ_GEMV, lambda f: edit_tensors(f, lambda t: _poison(t, Q + "scales", math.inf)),
                           f"tensor '{Q}scales' (AWQ scales) holds a NaN or infinite scale"),
    "ct-packed-nan-scale": (CT_INT4, lambda f: edit_tensors(f, lambda t: _poison(t, Q + "weight_scale", math.nan)),
                            f"tensor '{Q}weight_scale' (scales) holds a NaN or infinite scale"),
    "ct-naive-inf-scale": (CT_NAIVE, lambda f: edit_tensors(f, lambda t: _poison(t, Q + "weight_scale", math.inf)),
                           f"tensor '{Q}weight_scale' (scales) holds a NaN or infinite scale"),
}  # fmt: skip
ROUTES = ["convert", "dry-run", "gguf"]


def planted(built, case: str, folder: Path) -> Path:
    variant, change, _ = CASES[case]
    change(copy_of(built, variant, folder))
    return folder


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("case", list(CASES))
def test_refused_in_one_line_naming_it_and_nothing_written(built, tmp_path, case, route):
    source = planted(built, case, tmp_path / "source")
    out = tmp_path / ("out.gguf" if route == "gguf" else "out")
    line = one_error_line(cli(source, "-o", out, "-q", "--device", "cpu", *(["--dry-run"] * (route == "dry-run")),
                              code=1))  # fmt: skip
    assert CASES[case][2] in line, line
    assert sorted(path.name for path in tmp_path.iterdir()) == ["source"]


def _rows(output: str) -> dict[str, dict]:
    return {Path(row["source"]).name: row for row in map(json.loads, output.splitlines())}


@pytest.fixture(scope="module")
def planted_all(built, tmp_path_factory):
    """Every case's checkpoint, each in a folder of its name."""
    root = tmp_path_factory.mktemp("planted")
    return {case: planted(built, case, root / case) for case in CASES}


def test_a_batch_refuses_each_in_its_row(planted_all, tmp_path):
    for dry_run in ([], ["--dry-run"]):
        result = invoke("batch", *planted_all.values(), "-o", tmp_path / "root", "-q", "--device", "cpu", "--json",
                        *dry_run, code=1)  # fmt: skip
        rows = _rows(result.stdout)
        for case, (_, _, says) in CASES.items():
            assert rows[case]["status"] == "failed" and says in rows[case]["error"], (case, rows[case])
        assert not (tmp_path / "root").exists() or not list((tmp_path / "root").iterdir())


@contextlib.contextmanager
def _hub(folders: dict[str, Path]):
    """The fake Hub serving each folder as ``test-org/<name>``: the endpoint's environment."""
    import threading
    from http.server import ThreadingHTTPServer

    from test_hub import FakeHub

    class PlantedHub(FakeHub):
        repos = {
            f"test-org/{name}": {path.name: path.read_bytes() for path in folder.iterdir() if path.is_file()}
            for name, folder in folders.items()
        }
        requested, ranges = [], []

    server = ThreadingHTTPServer(("127.0.0.1", 0), PlantedHub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield {"HF_ENDPOINT": f"http://127.0.0.1:{server.server_address[1]}", "HF_HUB_DISABLE_XET": "1"}
    finally:
        server.shutdown()


def _hub_batch_refuses(folders: dict[str, Path], says: dict[str, str], tmp_path: Path, *options) -> None:
    from test_hub import cli as hub_cli

    with _hub(folders) as env:
        result = hub_cli("batch", *(f"test-org/{name}" for name in folders), "-o", tmp_path / "root", "-q",
                         "--device", "cpu", "--json", "--cache-dir", tmp_path / "cache", *options, env=env,
                         cwd=tmp_path)  # fmt: skip
    assert result.returncode == 1, result.stderr
    rows = _rows(result.stdout)
    for name, text in says.items():
        assert rows[name]["status"] == "failed" and text in rows[name]["error"], (name, rows[name])
    assert not (tmp_path / "root").exists() or not list((tmp_path / "root").iterdir())


def test_from_the_hub_each_is_refused_streamed_and_in_a_dry_run(planted_all, tmp_path):
    says = {case: text for case, (_, _, text) in CASES.items()}
    for dry_run in ([], ["--dry-run"]):
        _hub_batch_refuses(planted_all, says, tmp_path, *dry_run)


@pytest.mark.parametrize("plant", ["nan-weight", "raw-codes"])
def test_verify_fails_on_a_planted_wrong_output(built, tmp_path, plant):
    """An output whose weight holds a NaN, or the source's raw codes in its place, fails verify, naming it."""
    source = built(CT_NAIVE_SYM)
    out = tmp_path / "out"
    cli(source, "-o", out, "-q", "--device", "cpu")
    codes = load_file(source / "model.safetensors")[Q + "weight"]

    def change(tensors):
        if plant == "raw-codes":
            tensors[Q + "weight"] = codes
        else:
            tensors[Q + "weight"] = tensors[Q + "weight"].clone()
            tensors[Q + "weight"][3, 5] = math.nan

    edit_tensors(out, change)
    report = cli("verify", out, source, "--device", "cpu", "-q", code=1)
    assert f"{Q}weight" in report and "FAILED" in report, report


def _nan_code(byte: int):
    def change(tensors):
        weight = tensors[Q + "weight"].clone()
        weight.view(torch.uint8)[1, 2] = byte
        tensors[Q + "weight"] = weight

    return change


@pytest.mark.parametrize("processes", ["0", "2"], ids=["threads", "processes"])
@pytest.mark.parametrize("variant, byte", [("fp8", 0x7F), ("ct-fp8", 0xFF)])
def test_fp8_nan_codes_are_refused_as_the_weight_is_made(built, tmp_path, monkeypatch, variant, byte, processes):
    """E4M3's NaN code in an FP8 weight: refused in one line naming the tensor as its codes are read (a plan reads
    no codes), nothing written, on threads and worker processes."""
    monkeypatch.setenv("NF4CONVERT_PROCESSES", processes)
    source = copy_of(built, variant, tmp_path / "source")
    edit_tensors(source, _nan_code(byte))
    line = one_error_line(cli(source, "-o", tmp_path / "out", "-q", "--device", "cpu", code=1))
    assert f"tensor '{Q}weight' holds 1 F8_E4M3 NaN or infinite codes" in line, line
    assert sorted(path.name for path in tmp_path.iterdir()) == ["source"]


MX = "model.layers.0.mlp.experts.gate_up_proj"


def _mx_group(scale: int):
    """The first group of expert 0's first row: scale byte ``scale``, every value 6 (code 7 in both nibbles)."""

    def change(tensors):
        scales, blocks = tensors[MX + "_scales"].clone(), tensors[MX + "_blocks"].clone()
        scales[0, 0, 0], blocks[0, 0, 0] = scale, 0x77
        tensors[MX + "_scales"], tensors[MX + "_blocks"] = scales, blocks

    return change


@pytest.mark.parametrize("processes", ["0", "2"], ids=["threads", "processes"])
@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
def test_mxfp4_values_beyond_every_dtype_are_refused(built, tmp_path, monkeypatch, dtype, processes):
    """Scale byte 254 times 6 is past fp32's (and bf16's) range: refused in one line naming the tensor, whatever the
    output dtype, nothing written."""
    monkeypatch.setenv("NF4CONVERT_PROCESSES", processes)
    source = copy_of(built, "mxfp4", tmp_path / "source")
    edit_tensors(source, _mx_group(254))
    out = tmp_path / "out"
    line = one_error_line(cli(source, "-o", out, "-q", "--device", "cpu", "--dtype", dtype, code=1))
    assert f"tensor '{MX}' holds 32 values beyond every output dtype's range" in line, line
    assert sorted(path.name for path in tmp_path.iterdir()) == ["source"]


def test_mxfp4_values_beyond_fp16_alone_are_the_fp16_warning_and_bf16_keeps_them(built, tmp_path):
    """Scale byte 143 times 6 (393216) is past fp16's range only: fp16 warns, naming the tensor, with advice that
    holds (bf16 keeps the values finite, as its output shows)."""
    source = copy_of(built, "mxfp4", tmp_path / "source")
    edit_tensors(source, _mx_group(143))
    said = cli(source, "-o", tmp_path / "fp16", "-q", "--device", "cpu", "--dtype", "fp16")
    assert MX in said and "--dtype bf16 or fp32 keeps them finite" in said, said
    cli(source, "-o", tmp_path / "bf16", "-q", "--device", "cpu", "--dtype", "bf16")
    made = load_file(tmp_path / "bf16" / "model.safetensors")
    assert bool(torch.isfinite(made[MX].float()).all()) and float(made[MX].float().abs().max()) == 6 * 2**16


def test_what_is_refused_as_it_is_made_is_refused_in_a_batch_and_from_the_hub(built, tmp_path):
    """An FP8 NaN code and an MXFP4 value beyond every dtype: failed rows naming the tensor, locally and streamed
    from the Hub, nothing written."""
    folders = {
        "fp8-nan": copy_of(built, "fp8", tmp_path / "fp8-nan"),
        "mx-inf": copy_of(built, "mxfp4", tmp_path / "mx-inf"),
    }
    edit_tensors(folders["fp8-nan"], _nan_code(0x7F))
    edit_tensors(folders["mx-inf"], _mx_group(254))
    says = {"fp8-nan": f"tensor '{Q}weight' holds 1 F8_E4M3 NaN", "mx-inf": f"tensor '{MX}' holds 32 values beyond"}
    result = invoke("batch", *folders.values(), "-o", tmp_path / "root", "-q", "--device", "cpu", "--json", code=1)
    rows = _rows(result.stdout)
    for name, text in says.items():
        assert rows[name]["status"] == "failed" and text in rows[name]["error"], (name, rows[name])
    assert not (tmp_path / "root").exists() or not list((tmp_path / "root").iterdir())
    (tmp_path / "hub").mkdir()
    _hub_batch_refuses(folders, says, tmp_path / "hub")
