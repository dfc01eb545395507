"""A checkpoint at odds with its config.json is refused before anything is written, naming the tensor: every output
tensor is checked against the model transformers builds from the config (its shape there, every parameter given),
on convert, --dry-run, a GGUF output, batch and the Hub stream alike; verify of a GGUF checks the same shapes and the
file's size against its layout."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fixtures.cli import invoke, one_error_line

pytest.importorskip("compressed_tensors")
FIT = "the checkpoint does not fit the model of its config.json"


def state_of(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    state = {}
    for file in sorted(folder.glob("*.safetensors")):
        state.update(load_file(file))
    return state


def rewrite(folder: Path, state: dict[str, torch.Tensor]) -> Path:
    """The checkpoint's weights replaced by ``state``, in one file."""
    from safetensors.torch import save_file

    for file in [*folder.glob("*.safetensors"), *folder.glob("*.safetensors.index.json")]:
        file.unlink()
    save_file({k: v.contiguous() for k, v in state.items()}, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def renamed(state: dict, first: str, second: str) -> dict:
    """``state`` with every tensor of layer ``first`` and of layer ``second`` swapped by name."""
    swap = {first + ".": second + ".", second + ".": first + "."}

    def name(key):
        return next((swap[p] + key[len(p) :] for p in swap if key.startswith(p)), key)

    return {name(key): value for key, value in state.items()}


@pytest.fixture(scope="module")
def gptq(tmp_path_factory):
    from fixtures.int_checkpoints import build

    return build(tmp_path_factory.mktemp("gptq") / "tiny-GPTQ", "gptq-llama-4bit-g32-v1-sym").folder


@pytest.fixture(scope="module")
def mxfp4(tmp_path_factory):
    from fixtures.float_checkpoints import build_mxfp4

    return build_mxfp4(tmp_path_factory.mktemp("mxfp4") / "tiny-mxfp4")


def _copy(source: Path, tmp_path: Path, name: str = "src") -> Path:
    return Path(shutil.copytree(source, tmp_path / name))


ATTENTION = "model.layers.0.self_attn"
MLP = "model.layers.1.mlp"


def _short_g_idx(state):
    state[f"{ATTENTION}.q_proj.g_idx"] = state[f"{ATTENTION}.q_proj.g_idx"][:-1]
    return state


def _absent(state):
    return {k: v for k, v in state.items() if not k.startswith(f"{MLP}.down_proj.")}


GPTQ_CASES = {
    # the group index one entry short: q_proj written [128, 127]
    "g_idx short": (_short_g_idx, f"{ATTENTION}.q_proj.weight: [128, 127] from the checkpoint"),
    "q and k swapped": (
        lambda s: renamed(s, f"{ATTENTION}.q_proj", f"{ATTENTION}.k_proj"),
        f"{ATTENTION}.k_proj.weight: [128, 128] from the checkpoint, transformers' LlamaForCausalLM loads [64, 128]",
    ),
    "gate and down swapped": (
        lambda s: renamed(s, f"{MLP}.gate_proj", f"{MLP}.down_proj"),
        f"{MLP}.down_proj.weight: [320, 128] from the checkpoint, transformers' LlamaForCausalLM loads [128, 320]",
    ),
    "a quantized layer absent": (_absent, f"{MLP}.down_proj.weight: transformers' LlamaForCausalLM has this parameter"),
}


def _refused(source: Path, out: Path, *extra) -> str:
    line = one_error_line(invoke(source, "-o", out, "-q", "--device", "cpu", *extra, code=1).output)
    assert not out.exists() and not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}")]
    return line


@pytest.mark.parametrize("case", list(GPTQ_CASES))
def test_a_gptq_checkpoint_at_odds_with_its_config_is_refused(gptq, tmp_path, case):
    change, named = GPTQ_CASES[case]
    source = rewrite(_copy(gptq, tmp_path), change(state_of(gptq)))
    for out, extra in ((tmp_path / "out", ()), (tmp_path / "out", ("--dry-run",)), (tmp_path / "out.gguf", ())):
        line = _refused(source, out, *extra)
        assert line.startswith(f"Error: {source}: {named}") and line.endswith(FIT), line


def test_a_batch_refuses_it_in_its_row(gptq, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    good = _copy(gptq, tmp_path, "good-GPTQ")
    bad = rewrite(_copy(gptq, tmp_path, "bad-GPTQ"), _short_g_idx(state_of(gptq)))
    result = invoke("batch", good.name, bad.name, "-o", "root", "-q", "--device", "cpu", "--json", code=1)
    rows = {Path(row["source"]).name: row for row in map(json.loads, result.stdout.splitlines())}
    assert rows["good-GPTQ"]["status"] == "ok" and rows["bad-GPTQ"]["status"] == "failed", rows
    assert f"{ATTENTION}.q_proj.weight: [128, 127] from the checkpoint" in rows["bad-GPTQ"]["error"]
    assert sorted(p.name for p in (tmp_path / "root").iterdir()) == [rows["good-GPTQ"]["output"].rpartition("/")[2]]


def test_the_hub_stream_refuses_it(gptq, tmp_path):
    from fixtures.fake_hub import READ_TOKEN, client_env, serve

    bad = rewrite(_copy(gptq, tmp_path, "bad"), _short_g_idx(state_of(gptq)))
    files = {p.relative_to(bad).as_posix(): p.read_bytes() for p in sorted(bad.rglob("*")) if p.is_file()}
    with serve(lifetime=600) as (endpoint, state):
        state.publish("org/bad-GPTQ", files)
        environ = client_env(endpoint, tmp_path / "home", HF_HUB_DISABLE_XET="1", HF_TOKEN=READ_TOKEN)
        for extra in ((), ("--dry-run",)):
            done = subprocess.run(
                [sys.executable, "-m", "nf4convert", "org/bad-GPTQ", "-o", str(tmp_path / "out"), "-q", *extra],
                capture_output=True,
                text=True,
                env=environ,
                timeout=600,
            )
            lines = [line for line in done.stderr.splitlines() if line.strip()]
            assert done.returncode == 1 and len(lines) == 1, done.stderr
            assert f"{ATTENTION}.q_proj.weight: [128, 127] from the checkpoint" in lines[0] and FIT in lines[0]
            assert not (tmp_path / "out").exists()


def test_a_compressed_tensors_weight_shape_that_fits_its_packing_but_not_the_model(tmp_path):
    from fixtures.int_checkpoints import build

    source = build(tmp_path / "ct", "ct-qwen2-w8a16-channel-asym").folder  # 4 codes a word, a scale a row
    state = state_of(source)
    shape = state[f"{ATTENTION}.q_proj.weight_shape"]
    state[f"{ATTENTION}.q_proj.weight_shape"] = shape - torch.tensor([0, 1], dtype=shape.dtype)
    rewrite(source, state)
    rows, columns = shape.tolist()
    line = _refused(source, tmp_path / "out")
    named = f"{ATTENTION}.q_proj.weight: [{rows}, {columns - 1}] from the checkpoint, transformers' Qwen2ForCausalLM"
    assert line.startswith(f"Error: {source}: {named} loads [{rows}, {columns}] there"), line


def _experts(state, name, change):
    for part in ("_blocks", "_scales"):
        state[f"model.layers.0.mlp.experts.{name}{part}"] = change(state[f"model.layers.0.mlp.experts.{name}{part}"])
    return state


def _as_mxfp4(state):
    from fixtures.float_checkpoints import quantize_mxfp4

    weight = state.pop(f"{ATTENTION}.q_proj.weight")
    blocks, scales = quantize_mxfp4(weight.t()[None])
    state[f"{ATTENTION}.q_proj.weight_blocks"], state[f"{ATTENTION}.q_proj.weight_scales"] = blocks, scales
    return state


MXFP4_CASES = {
    "a bias missing": (
        lambda s: {k: v for k, v in s.items() if k != "model.layers.0.mlp.experts.gate_up_proj_bias"},
        "model.layers.0.mlp.experts.gate_up_proj_bias: transformers' GptOssForCausalLM has this parameter",
    ),
    "a non-expert weight stored as MXFP4": (_as_mxfp4, f"{ATTENTION}.q_proj.weight: [1, "),
    "an expert dropped": (
        lambda s: _experts(s, "down_proj", lambda t: t[:-1]),
        "model.layers.0.mlp.experts.down_proj: [",
    ),
    "a wider gate_up": (
        lambda s: _experts(s, "gate_up_proj", lambda t: torch.cat([t, t[:, :2]], dim=1)),
        "model.layers.0.mlp.experts.gate_up_proj: [",
    ),
}


@pytest.mark.parametrize("case", list(MXFP4_CASES))
def test_an_mxfp4_checkpoint_at_odds_with_its_config_is_refused(mxfp4, tmp_path, case):
    change, named = MXFP4_CASES[case]
    source = rewrite(_copy(mxfp4, tmp_path), change(state_of(mxfp4)))
    for extra in ((), ("--dry-run",)):
        line = _refused(source, tmp_path / "out", *extra)
        assert line.startswith(f"Error: {source}: {named}") and line.endswith(FIT), line


def test_a_model_transformers_does_not_know_is_checked_by_its_config(gptq, tmp_path):
    source = rewrite(_copy(gptq, tmp_path), _short_g_idx(state_of(gptq)))
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**config, "model_type": "no-such-model", "architectures": ["X"]}))
    line = _refused(source, tmp_path / "out", "--dry-run")
    assert (
        f"{ATTENTION}.q_proj.weight: [128, 127] from the checkpoint, config.json's dimensions make [128, 128]" in line
    )
    good = _copy(gptq, tmp_path, "good")
    (good / "config.json").write_text(json.dumps({**config, "model_type": "no-such-model", "architectures": ["X"]}))
    assert "tensors: " in invoke(good, "-o", tmp_path / "out", "--device", "cpu", "--dry-run").output


@pytest.fixture(scope="module")
def with_tokenizer(gptq, tmp_path_factory):
    from fixtures.trained_tokenizers import sentencepiece_tokenizer

    pytest.importorskip("conversion")  # the "gguf" extra: llama.cpp's converter
    folder = Path(shutil.copytree(gptq, tmp_path_factory.mktemp("gguf") / "tiny-GPTQ"))
    sentencepiece_tokenizer(folder)
    return folder


def _verified(out: Path, source: Path, code: int) -> str:
    return invoke("verify", out, source, "-q", "--device", "cpu", code=code).output


def test_gguf_verify_checks_the_files_size_against_its_layout(with_tokenizer, tmp_path):
    out = tmp_path / "tiny.gguf"
    invoke(with_tokenizer, "-o", out, "-q", "--device", "cpu")
    assert "OK: bit-exact" in _verified(out, with_tokenizer, 0)
    size = out.stat().st_size
    with open(out, "ab") as file:
        file.write(bytes(64))
    said = _verified(out, with_tokenizer, 1)
    assert f"tiny.gguf: {size + 64} bytes, its layout ends at byte {size} (64 bytes more)" in said, said


def test_gguf_verify_checks_each_tensors_shape_against_the_model(with_tokenizer, tmp_path, monkeypatch):
    # made as a conversion without its check of the model would: the converter writes attn_q [127, 128]
    from nf4convert import plan

    source = rewrite(_copy(with_tokenizer, tmp_path, "tiny-GPTQ"), _short_g_idx(state_of(with_tokenizer)))
    out = tmp_path / "tiny.gguf"
    with monkeypatch.context() as patched:
        patched.setattr(plan, "check_fits", lambda *args: None, raising=False)
        invoke(source, "-o", out, "-q", "--device", "cpu")
    said = _verified(out, source, 1)
    named = f"{ATTENTION}.q_proj.weight: [128, 127] from the source, transformers' model loads [128, 128] there"
    assert f"  MISMATCH {named}" in said.splitlines(), said
    out.unlink()
    assert FIT in _refused(source, out)
