"""nf4convert SOURCE --adapter ADAPTER end to end: a real 4-bit base, peft adapters of several kinds; the merged
output equals peft's merge_and_unload() on the dense conversion bit for bit, and verify --adapter (bitsandbytes
and peft, not our merge code) accepts it."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings

import pytest
import torch
from click.testing import CliRunner

from nf4convert.cli.commands import main
from nf4convert.safetensors_io.read import read_tensors
from nf4convert.verification.reference.dequantize_4bit import CPU_REFERENCE

from fixtures.adapters import KINDS, make_adapter, peft_merged
from fixtures.checkpoints import _configs, build
from fixtures.weights import bits

pytest.importorskip("peft")
pytest.importorskip("bitsandbytes")
warnings.filterwarnings("ignore", module="peft")


def run(*args, code=0):
    result = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
    assert result.exit_code == code, result.output
    return result.output


def _base_and_dense(tmp_path_factory, variant: str, seed: int):
    """A real 4-bit checkpoint of ``variant`` and its dense conversion (no adapter)."""
    root = tmp_path_factory.mktemp(f"adapter-{variant}")
    source = build(root / f"{variant}-bnb-4bit", variant, seed=seed)
    run(source, "-o", root / "dense", "-q", "--device", "cpu")
    return source, root / "dense"


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """Llama."""
    return _base_and_dense(tmp_path_factory, "llama-nf4-dq", seed=3)


@pytest.fixture(scope="module")
def gpt2_base(tmp_path_factory):
    """GPT-2: Conv1D layers, which transformers quantizes transposed."""
    return _base_and_dense(tmp_path_factory, "gpt2-conv1d-nf4-dq", seed=4)


@pytest.mark.parametrize("kind", list(KINDS))
def test_merge_while_converting_equals_peft(kind, base, gpt2_base, tmp_path):
    from safetensors.torch import load_file

    arch = "gpt2" if kind.startswith("conv1d") else "llama"
    source, dense = gpt2_base if arch == "gpt2" else base
    adapter = make_adapter(tmp_path / "adapter", kind, seed=list(KINDS).index(kind) + 20, arch=arch)
    out = tmp_path / "merged"
    summary = run(source, "--adapter", adapter, "-o", out, "--device", "cpu", "--max-shard-size", "400KB")
    # the summary counts the tensors by kind as the plan does (it said "29 dequantized" for 20 and 9 merged)
    planned = run(source, "--adapter", adapter, "-o", tmp_path / "planned", "--dry-run").splitlines()
    kinds = next(line for line in planned if line.startswith("tensors: ")).split(" ", 2)[2]
    assert "merged with the adapter" in kinds and f"tensors {kinds}, " in summary, (kinds, summary)
    merged = {}
    for shard in out.glob("*.safetensors"):
        merged.update(load_file(shard))
    assert not [k for k in merged if "lora_" in k or "modules_to_save" in k or "base_layer" in k]
    assert not (out / "adapter_config.json").exists() and not (out / "adapter_model.safetensors").exists()
    reference = peft_merged(dense, adapter)
    expected = reference.state_dict()
    dense_tensors = {}
    for shard in dense.glob("*.safetensors"):
        dense_tensors.update(load_file(shard))
    changed = 0
    for name, tensor in merged.items():
        assert torch.equal(bits(tensor), bits(expected[name].contiguous())), name
        changed += not torch.equal(bits(tensor), bits(dense_tensors[name]))
    assert changed >= 2  # the adapter did change weights
    assert "OK: bit-exact" in run("verify", out, source, "--adapter", adapter, "--device", "cpu", "-q")
    # The merged model loads in transformers and its logits are peft's merged model's.
    from transformers import AutoModelForCausalLM

    ids = torch.randint(0, 512, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = AutoModelForCausalLM.from_pretrained(out).eval()(input_ids=ids).logits
        assert torch.equal(ours, reference.eval()(input_ids=ids).logits)


def test_adapter_as_source_and_verify_catches_a_wrong_merge(base, tmp_path):
    source, dense = base
    adapter = make_adapter(tmp_path / "my-adapter", "linear", seed=41, base_model=str(source))
    out = tmp_path / "out"
    run(adapter, "-o", out, "-q", "--device", "cpu")  # SOURCE is the adapter: its base is named in its config
    card = (out / "README.md").read_text()
    assert "my-adapter" in card and "# test model" in card  # the base's card, saying which adapter was merged
    assert "OK: bit-exact" in run("verify", out, adapter, "-q", "--device", "cpu")
    # Verified against another adapter (same shapes, other values), the merged weights are named.
    other = make_adapter(tmp_path / "other", "linear", seed=43)
    output = run("verify", out, source, "--adapter", other, "-q", "--device", "cpu", code=1)
    assert "q_proj.weight: " in output and f"differ from {CPU_REFERENCE} + peft" in output


def test_verify_with_an_adapter_keeps_peft_quiet_and_knows_out_from_source(base, tmp_path):
    # peft's warnings (a config key it does not know) came through verify's report, 26 lines; OUT given as SOURCE too
    # listed hundreds of "quantization key remains" lines; a file as OUT was "no such folder"
    source, dense = base
    adapter = make_adapter(tmp_path / "adapter", "linear", seed=47, base_model=str(source))
    config = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps({**config, "a_key_from_a_later_peft": 1}))
    run(source, "--adapter", adapter, "-o", tmp_path / "out", "-q", "--device", "cpu")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "nf4convert",
            "verify",
            str(tmp_path / "out"),
            str(source),
            "--adapter",
            str(adapter),
            "-q",
            "--device",
            "cpu",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    lines = (result.stdout + result.stderr).strip().splitlines()
    assert result.returncode == 0 and len(lines) == 2, lines
    assert lines[-1] == f"OK: bit-exact with {CPU_REFERENCE} and peft", lines
    assert run("verify", source, source, "-q", code=2).strip() == (
        f"Error: {source} is given as both OUT and SOURCE: the order is the converted checkpoint, "
        "then the bitsandbytes one"
    )
    (tmp_path / "a-file").write_text("x")
    assert (
        run("verify", tmp_path / "a-file", source, "-q", code=1).strip()
        == f"Error: {tmp_path / 'a-file'}: a file, not a folder"
    )


@pytest.mark.parametrize(
    "case",
    [
        "ia3",
        "shape",
        "missing-target",
        "truncated",
        "layers-to-transform",
        "exclude",
        "pattern-misses",
        "pattern-invalid",
        "no-targets",
        "olora-any-case",
        "corda-prefix",
        "dora-lora-bias",
        "targeted-without-tensors",
        "lora-and-saved",
        "one-layer-index",
        "embedding-style-on-linear",
        "linear-style-on-embedding",
        "modules-to-save-str",
        "bias-int",
        "init-int",
    ],
)
def test_bad_adapters_are_one_line_and_write_nothing(case, base, tmp_path):
    source, dense = base
    adapter = make_adapter(tmp_path / "adapter", "linear", seed=5)
    config = json.loads((adapter / "adapter_config.json").read_text())
    expected = {
        "ia3": "IA3",
        "shape": "do not fit the base's",
        "missing-target": "which the base checkpoint does not have",
        "truncated": "adapter_model.safetensors",
        "layers-to-transform": "layers_to_transform is set",
        "exclude": "exclude_modules is set",
        "pattern-misses": "which target_modules",
        "pattern-invalid": "is not a valid pattern",
        "no-targets": "target_modules is None",
        "olora-any-case": "init_lora_weights is 'OLoRA'",
        "corda-prefix": "init_lora_weights is 'corda_x'",
        "dora-lora-bias": "lora_bias with use_dora: peft refuses",
        "lora-and-saved": "in modules_to_save too",
        "targeted-without-tensors": "names 'model.layers.0.self_attn.v_proj', but the adapter has no LoRA",
        "one-layer-index": "layers_to_transform is set (0)",
        "modules-to-save-str": "modules_to_save is 'lm_head'",
        "embedding-style-on-linear": "'model.layers.0.self_attn.q_proj' are embedding-style (lora_embedding_A/B)",
        "linear-style-on-embedding": (
            "'model.embed_tokens' are linear-style (lora_A/B), but 'model.embed_tokens' is an embedding"
        ),
        "bias-int": "bias is 1",
        "init-int": "init_lora_weights is 3",
    }[case]
    if case == "ia3":
        config["peft_type"] = "IA3"
    elif case == "layers-to-transform":  # peft would give LoRA layers to layer 0 only and ignore the others' tensors
        config["layers_to_transform"] = [0]
    elif case == "exclude":
        config["exclude_modules"] = ["q_proj"]
    elif case == "pattern-misses":
        config["target_modules"] = r".*\.(k_proj|v_proj)"
    elif case == "pattern-invalid":
        config["target_modules"] = "([unclosed"
    elif case == "no-targets":
        config["target_modules"] = None
    elif case == "olora-any-case":  # peft tests "olora" without case
        config["init_lora_weights"] = "OLoRA"
    elif case == "corda-prefix":  # and "corda" as a prefix
        config["init_lora_weights"] = "corda_x"
    elif case == "dora-lora-bias":  # LoraConfig refuses the pair
        config["use_dora"] = config["lora_bias"] = True
    elif case == "lora-and-saved":
        config["modules_to_save"] = ["q_proj"]
    elif case == "one-layer-index":  # peft gives LoRA layers to layer 0 only, for an int as for [0]
        config["layers_to_transform"] = 0
    elif case == "modules-to-save-str":  # peft fails loading these three
        config["modules_to_save"] = "lm_head"
    elif case == "bias-int":
        config["bias"] = 1
    elif case == "init-int":
        config["init_lora_weights"] = 3
    elif case in ("embedding-style-on-linear", "linear-style-on-embedding"):  # peft would load none of them there
        from safetensors.torch import load_file, save_file

        tensors = load_file(adapter / "adapter_model.safetensors")
        if case == "embedding-style-on-linear":  # q_proj is square: the shapes fit either way
            prefix = "base_model.model.model.layers.0.self_attn.q_proj."
            tensors[prefix + "lora_embedding_A"] = tensors.pop(prefix + "lora_A.weight")
            tensors[prefix + "lora_embedding_B"] = tensors.pop(prefix + "lora_B.weight")
        else:
            llama = _configs()["llama"]()
            generator = torch.Generator().manual_seed(6)
            prefix = "base_model.model.model.embed_tokens."
            tensors[prefix + "lora_A.weight"] = torch.randn(4, llama.hidden_size, generator=generator)
            tensors[prefix + "lora_B.weight"] = torch.randn(llama.vocab_size, 4, generator=generator)
            config["target_modules"].append("embed_tokens")
        save_file(tensors, adapter / "adapter_model.safetensors")
    elif case == "targeted-without-tensors":  # peft would give v_proj fresh LoRA layers and merge them
        from safetensors.torch import load_file, save_file

        tensors = load_file(adapter / "adapter_model.safetensors")
        save_file(
            {k: v for k, v in tensors.items() if ".layers.0.self_attn.v_proj." not in k},
            adapter / "adapter_model.safetensors",
        )
    elif case in ("shape", "missing-target"):
        from safetensors.torch import load_file, save_file

        tensors = load_file(adapter / "adapter_model.safetensors")
        key = next(k for k in sorted(tensors) if k.endswith("q_proj.lora_A.weight"))
        if case == "shape":
            tensors[key] = torch.randn(tensors[key].shape[0], 7)
        else:
            tensors[key.replace("layers.0", "layers.9")] = tensors[key].clone()
            tensors[key.replace("layers.0", "layers.9").replace("lora_A", "lora_B")] = tensors[
                key.replace("lora_A", "lora_B")
            ].clone()
        save_file(tensors, adapter / "adapter_model.safetensors")
    else:
        path = adapter / "adapter_model.safetensors"
        path.write_bytes(path.read_bytes()[:-64])
    (adapter / "adapter_config.json").write_text(json.dumps(config))
    result = CliRunner().invoke(main, [str(source), "--adapter", str(adapter), "-o", str(tmp_path / "out"), "-q"])
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code == 1 and len(lines) == 1 and lines[0].startswith("Error: ") and expected in lines[0], (
        result.output
    )
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out*"))
    if case.endswith(("-on-linear", "-on-embedding")):  # and verify --adapter does not call such a merge OK
        line = run("verify", dense, source, "--adapter", adapter, "-q", "--device", "cpu", code=1).strip()
        assert line.startswith("Error: ") and expected in line and "\n" not in line


def test_adapter_files_beside_the_weights_never_reach_the_output(base, tmp_path):
    import shutil

    source, _ = base
    both = tmp_path / "both"
    shutil.copytree(source, both)
    (both / "model.safetensors.index.json").unlink()  # no index: every .safetensors file is looked at
    adapter = make_adapter(tmp_path / "adapter", "linear", seed=7)
    shutil.copy(adapter / "adapter_config.json", both)
    shutil.copy(adapter / "adapter_model.safetensors", both)
    out = tmp_path / "out"
    run(both, "--adapter", adapter, "-o", out, "-q", "--device", "cpu")
    keys = read_tensors(out)
    assert not [k for k in keys if "lora_" in k] and not (out / "adapter_config.json").exists()
    assert len(keys) == len(read_tensors(base[1]))


def test_tied_lm_head_and_deep_config_are_refused(base, tmp_path):
    import shutil

    source, _ = base
    tied = tmp_path / "tied"
    shutil.copytree(source, tied)
    config = json.loads((tied / "config.json").read_text())
    config["tie_word_embeddings"] = True
    (tied / "config.json").write_text(json.dumps(config))
    adapter = make_adapter(tmp_path / "adapter", "modules_to_save", seed=8)
    line = run(tied, "--adapter", adapter, "-o", tmp_path / "out", "-q", code=1).strip()
    assert line.startswith("Error: ") and "ties to its input embeddings" in line
    (adapter / "adapter_config.json").write_text('{"peft_type": "LORA", "x": ' + "[" * 100000 + "]" * 100000 + "}")
    line = run(source, "--adapter", adapter, "-o", tmp_path / "out", "-q", code=1).strip()
    assert line.startswith("Error: ") and "adapter_config.json" in line and "\n" not in line
    assert not (tmp_path / "out").exists()


def test_modules_to_save_on_tied_embeddings_unties_the_head(tmp_path):
    # peft swaps in the saved embeddings and the head keeps the old ones: the output holds both (test_adapter_tied.py)
    source = build(tmp_path / "qwen2-tied", "qwen2-tied-fp4", seed=2)
    adapter = make_adapter(tmp_path / "adapter", "embeddings_to_save", seed=9, arch="qwen2")
    run(source, "--adapter", adapter, "-o", tmp_path / "out", "-q", "--device", "cpu")
    assert "lm_head.weight" in read_tensors(tmp_path / "out")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["tie_word_embeddings"] is False


def test_all_linear_in_any_case_merges_as_peft(base, tmp_path):
    # peft reads target_modules "all-linear" without case; the "linear" kind targets every linear layer but the head
    source, _ = base
    adapter = make_adapter(tmp_path / "adapter", "linear", seed=12)
    run(source, "--adapter", adapter, "-o", tmp_path / "listed", "-q", "--device", "cpu")
    config = json.loads((adapter / "adapter_config.json").read_text())
    config["target_modules"] = "ALL-LINEAR"
    (adapter / "adapter_config.json").write_text(json.dumps(config))
    run(source, "--adapter", adapter, "-o", tmp_path / "all-linear", "-q", "--device", "cpu")
    for shard in (tmp_path / "listed").glob("*.safetensors"):
        assert shard.read_bytes() == (tmp_path / "all-linear" / shard.name).read_bytes()


def test_model_card_names_a_local_adapter_as_a_folder(base, tmp_path):
    source, _ = base
    make_adapter(tmp_path / "adapters" / "my-lora", "linear", seed=9)
    out = tmp_path / "out"
    import os

    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        run(source, "--adapter", "adapters/my-lora", "-o", out, "-q", "--device", "cpu")
    finally:
        os.chdir(cwd)
    card = (out / "README.md").read_text()
    assert "`my-lora` (a local folder)" in card and "huggingface.co/adapters" not in card and str(tmp_path) not in card


def _hub_snapshot(adapter, root):
    """``adapter``'s files laid out as huggingface_hub's cache keeps a repo: snapshots/<commit>/<file> are relative
    links to ../../blobs/<hash>."""
    import hashlib
    import os

    repo = root / "hub" / "models--someone--my-adapter"
    snapshot = repo / "snapshots" / ("0123456789abcdef" * 3)[:40]
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for path in sorted(adapter.iterdir()):
        blob = hashlib.sha256(path.read_bytes()).hexdigest()
        path.rename(repo / "blobs" / blob)
        os.symlink(f"../../blobs/{blob}", snapshot / path.name)
    return snapshot


@pytest.mark.parametrize("file", ["adapter_model.safetensors", "adapter_config.json"])
@pytest.mark.parametrize("route", ["--adapter", "adapter-as-source", "other-repo-blobs"])
def test_adapter_files_linked_from_outside_its_folder_are_refused(file, route, base, tmp_path):
    """The checkpoint's rule for links (checkpoint.inside) holds for an adapter's files: a link out of the folder is
    refused by name, where the adapter is --adapter or SOURCE; a Hub cache snapshot reads its own repo's blobs only."""
    import os
    import shutil

    source, _ = base
    adapter = make_adapter(tmp_path / "adapter", "linear", seed=9, base_model=str(source))
    if route == "other-repo-blobs":
        adapter = _hub_snapshot(adapter, tmp_path)
        other = tmp_path / "hub" / "models--someone--else" / "blobs"
        other.mkdir(parents=True)
        blob = (adapter / file).resolve()
        blob.rename(other / blob.name)
        (adapter / file).unlink()
        os.symlink(f"../../../models--someone--else/blobs/{blob.name}", adapter / file)
        target = other / blob.name
    else:
        target = tmp_path / "elsewhere" / file
        target.parent.mkdir()
        shutil.move(adapter / file, target)
        os.symlink(target, adapter / file)
    args = [adapter] if route == "adapter-as-source" else [source, "--adapter", adapter]
    result = CliRunner().invoke(main, [*map(str, args), "-o", str(tmp_path / "out"), "-q", "--device", "cpu"])
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code == 1 and len(lines) == 1, result.output
    assert (
        lines[0] == f"Error: {adapter / file}: is a link to {target.resolve()}, outside the adapter folder; "
        "copy the file into the folder instead"
    )
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out*"))


def test_an_adapter_in_the_hub_cache_layout_merges_and_verifies(base, tmp_path):
    """A Hub-fetched adapter is a snapshot of links into its repo's blobs: merged exactly as the same files in a plain
    folder, and verified."""
    import shutil

    source, _ = base
    plain = make_adapter(tmp_path / "adapter", "linear", seed=11)
    shutil.copytree(plain, tmp_path / "cached")
    snapshot = _hub_snapshot(tmp_path / "cached", tmp_path)
    assert (snapshot / "adapter_model.safetensors").is_symlink() and (snapshot / "adapter_config.json").is_symlink()
    run(source, "--adapter", plain, "-o", tmp_path / "from-plain", "-q", "--device", "cpu")
    run(source, "--adapter", snapshot, "-o", tmp_path / "from-cache", "-q", "--device", "cpu")
    weights = sorted(p.name for p in (tmp_path / "from-plain").glob("*.safetensors*"))
    assert weights and weights == sorted(p.name for p in (tmp_path / "from-cache").glob("*.safetensors*"))
    for name in weights:
        assert (tmp_path / "from-plain" / name).read_bytes() == (tmp_path / "from-cache" / name).read_bytes(), name
    assert "OK: bit-exact" in run(
        "verify", tmp_path / "from-cache", source, "--adapter", snapshot, "-q", "--device", "cpu"
    )


def test_an_adapter_as_source_with_another_adapter_is_a_usage_error(tmp_path):
    # it said "no .safetensors files (only safetensors checkpoints can be converted)"
    from click.testing import CliRunner

    from nf4convert.cli.commands import main

    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text('{"peft_type": "LORA"}')
    (adapter / "adapter_model.safetensors").write_bytes(b"")
    for command in (
        ["convert", str(adapter), "--adapter", str(adapter), "-o", str(tmp_path / "out")],
        ["verify", str(tmp_path), str(adapter), "--adapter", str(adapter)],
    ):
        result = CliRunner().invoke(main, command)
        assert result.exit_code == 2, result.output
        assert result.output.strip().startswith(
            f"Error: {adapter} is a peft adapter (it has adapter_config.json and no model weights) "
            "and an adapter is given too: give the base checkpoint as SOURCE"
        )
