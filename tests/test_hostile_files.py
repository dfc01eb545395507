"""Files and names a hostile (or unlucky) user puts in front of nf4convert, beyond the weights: a FIFO where
config.json, the index or an adapter's config is expected (it held the run forever), seeded fuzzing of config.json
and the index through the command line, and the smaller findings of the same trial: a single flipped bit is not
"merged with an adapter", a missing base says it came from the adapter's config, an adapter folder is called so, an
8-bit scale of 0 is taken (as the docs now say)."""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import subprocess
import sys
import traceback
from pathlib import Path

import pytest
from click.testing import CliRunner

from nf4convert.cli.commands import main

from fixtures.processes import package_env

pytest.importorskip("bitsandbytes")
ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "tiny-llama-bnb-4bit"
FUZZ_CASES = 200


def run(*args, code=0):
    result = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
    assert result.exit_code == code, result.output + result.stderr
    return result


def one_error_line(text: str) -> str:
    lines = text.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), text
    return lines[0]


@pytest.fixture
def source(tmp_path):
    copy = tmp_path / "src"
    shutil.copytree(EXAMPLE, copy)
    return copy


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
@pytest.mark.parametrize("name", ["config.json", "model.safetensors.index.json", "adapter_config.json"])
def test_a_fifo_where_a_json_file_is_expected_is_refused_not_waited_on(tmp_path, source, name):
    # the shards and the carried files were refused as "not a regular file"; these were opened blindly, and waited on
    args = [source, "-o", tmp_path / "out", "--dry-run", "-q"]
    folder = source
    if name == "adapter_config.json":
        folder = tmp_path / "adapter"
        folder.mkdir()
        args += ["--adapter", folder]
    (folder / name).unlink(missing_ok=True)
    os.mkfifo(folder / name)
    try:
        done = subprocess.run(
            [sys.executable, "-m", "nf4convert", *map(str, args)],
            env=package_env(),
            capture_output=True,
            text=True,
            timeout=60,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"the run waited on the FIFO {folder / name}")
    line = one_error_line(done.stderr)
    assert done.returncode == 1 and line == f"Error: {folder / name}: not a regular file (a pipe, socket or device)"


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
def test_a_fifo_given_as_verifys_gguf_is_named_as_such(tmp_path):
    os.mkfifo(tmp_path / "out.gguf")
    line = one_error_line(run("verify", tmp_path / "out.gguf", EXAMPLE, "-q", code=1).stderr)
    assert line == f"Error: {tmp_path / 'out.gguf'}: not a regular file"


# ---- config.json and the index, fuzzed through the command line ----------------------------------------------------

ODD_VALUES = [None, True, False, 0, -1, 2**70, 1e308, -0.0, "", "x", "../x", [], [None], {}, {"a": []}, "\x00"]


def _mutate_json(rng: random.Random, value, log: list[str]):
    """``value`` with one random place changed: replaced by an odd value, deleted, wrapped, or emptied."""
    if not isinstance(value, (dict, list)) or not value or rng.random() < 0.05:
        log.append("whole replaced")
        return rng.choice(ODD_VALUES)
    node, trail = value, []
    while True:
        key = rng.choice(sorted(node)) if isinstance(node, dict) else rng.randrange(len(node))
        child = node[key]
        if isinstance(child, (dict, list)) and child and rng.random() < 0.6:
            node, trail = child, [*trail, key]
            continue
        choice = rng.randrange(4)
        if choice == 0:
            node[key] = rng.choice(ODD_VALUES)
        elif choice == 1:
            del node[key]
        elif choice == 2:
            node[key] = [child]
        else:
            node[key] = {"nested": child}
        log.append(f"{[*trail, key]} {('odd', 'deleted', 'listed', 'nested')[choice]}"[:80])
        return value


def _mutate_bytes(rng: random.Random, raw: bytes, log: list[str]) -> bytes:
    choice = rng.randrange(4)
    log.append(("truncated", "bytes flipped", "emptied", "garbage")[choice])
    if choice == 0:
        return raw[: rng.randrange(len(raw))]
    if choice == 1:
        data = bytearray(raw)
        for _ in range(rng.randint(1, 6)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        return bytes(data)
    return b"" if choice == 2 else bytes(rng.randrange(256) for _ in range(rng.randint(1, 200)))


def fuzz_config_and_index(seed: int, root: Path) -> str | None:
    """One case: the example with its config.json and/or index mutated, planned through the CLI (a dry run, and a
    conversion for one case in ten); None where it ends in a plan, an output, or one Error line."""
    rng = random.Random(seed)
    case = root / f"case-{seed}"
    shutil.copytree(EXAMPLE, case)
    log: list[str] = []
    try:
        for name in rng.sample(["config.json", "model.safetensors.index.json"], rng.choice([1, 1, 2])):
            path = case / name
            log.append(name)
            if rng.random() < 0.8:
                value = json.loads(path.read_bytes())
                for _ in range(rng.choice([1, 1, 2, 3])):
                    value = _mutate_json(rng, value, log)
                path.write_text(json.dumps(value))
            else:
                path.write_bytes(_mutate_bytes(rng, path.read_bytes(), log))
        extra = [] if seed % 10 == 0 else ["--dry-run"]
        out = root / f"out-{seed}"
        result = CliRunner().invoke(
            main, [str(case), "-o", str(out), "-q", "--device", "cpu", "--allow-no-config", *extra]
        )
        problem = None
        if result.exception is not None and not isinstance(result.exception, SystemExit):
            problem = "a traceback: " + "".join(traceback.format_exception(result.exception)[-2:])[-300:]
        elif result.exit_code not in (0, 1):
            problem = f"exit {result.exit_code}"
        elif result.exit_code == 1:
            lines = result.stderr.strip().splitlines()
            if len(lines) != 1 or not lines[0].startswith("Error: "):
                problem = f"not one error line: {result.stderr[-300:]!r}"
            elif out.exists():
                problem = "an output was left after an error"
        return f"seed {seed} ({'; '.join(log)}): {problem}" if problem else None
    finally:
        shutil.rmtree(case, ignore_errors=True)
        shutil.rmtree(root / f"out-{seed}", ignore_errors=True)


def test_fuzz_config_and_index(tmp_path):
    failures = [failure for seed in range(FUZZ_CASES) if (failure := fuzz_config_and_index(seed, tmp_path))]
    assert not failures, f"{len(failures)} of {FUZZ_CASES} cases went wrong:\n" + "\n".join(failures[:8])


# ---- the smaller findings --------------------------------------------------------------------------------------------


def test_a_single_flipped_bit_is_a_mismatch_not_a_merge(tmp_path):
    # verify said the output "looks merged with an adapter" for one flipped bit
    from nf4convert.safetensors_io.read import read_tensors

    out = tmp_path / "out"
    run(EXAMPLE, "-o", out, "-q", "--device", "cpu")
    info = read_tensors(out)["model.layers.0.self_attn.q_proj.weight"]
    with open(info.path, "r+b") as file:
        file.seek(info.begin + 101)
        byte = file.read(1)[0]
        file.seek(info.begin + 101)
        file.write(bytes([byte ^ 0x04]))
    output = run("verify", out, EXAMPLE, "-q", "--device", "cpu", code=1).stdout
    assert "MISMATCH model.layers.0.self_attn.q_proj.weight: 1 of " in output and "looks merged" not in output, output


def test_differences_look_merged_when_a_good_part_of_a_weight_changed():
    from nf4convert.verification.hints import looks_merged

    def differ(count, total):
        return [f"model.layers.0.mlp.up_proj.weight: {count} of {total} elements differ from bitsandbytes"]

    assert not looks_merged(differ(1, 65536)) and not looks_merged(differ(2048, 65536))
    assert looks_merged(differ(40000, 65536)) and looks_merged(differ(6554, 65536))
    assert not looks_merged(["model.norm.bias: 1 of 2 elements differ from the source tensor"])
    assert looks_merged(["lm_head.weight: in the output, not in the source"])


def test_a_missing_base_says_it_came_from_the_adapters_config(tmp_path):
    pytest.importorskip("peft")
    from fixtures.adapters import make_adapter

    missing = tmp_path / "no-such-base"
    adapter = make_adapter(tmp_path / "adapter", "linear", seed=2, base_model=str(missing))
    line = one_error_line(run(adapter, "-o", tmp_path / "out", "-q", code=1).stderr)
    assert line.startswith(f"Error: {missing}: no such folder"), line
    assert f"the base that {adapter / 'adapter_config.json'} names in base_model_name_or_path" in line, line


def test_an_output_inside_the_adapter_folder_says_the_adapters(tmp_path):
    pytest.importorskip("peft")
    from fixtures.adapters import make_adapter
    from fixtures.checkpoints import build

    base = build(tmp_path / "base-bnb-4bit", "llama-nf4-dq", seed=2)
    adapter = make_adapter(tmp_path / "adapter", "linear", seed=2)
    for args in ([base, "--adapter", adapter], [adapter]):  # the adapter given as SOURCE, its base named in it
        line = one_error_line(run(*args, "-o", adapter / "out", "-q", code=1).stderr)
        assert line == (
            f"Error: {adapter / 'out'}: is inside the adapter's folder {adapter.resolve()}; choose another output"
        )


def test_an_8bit_scale_of_zero_is_taken_as_the_docs_say(tmp_path):
    # bitsandbytes writes a 0 scale (and 0 codes) for an all-zero row; the docs said a scale must be positive
    import torch
    from safetensors.torch import load_file, save_file

    from fixtures.checkpoints8 import build

    source = build(tmp_path / "src", "llama-8bit-bf16", seed=3)
    index = json.loads((source / "model.safetensors.index.json").read_text())["weight_map"]
    weight = "model.layers.0.mlp.up_proj.weight"
    for name, row_value in ((weight, 0), (weight.replace(".weight", ".SCB"), 0.0)):
        tensors = load_file(source / index[name])
        tensors[name][1] = row_value
        save_file(tensors, source / index[name], metadata={"format": "pt"})
    run(source, "-o", tmp_path / "out", "-q", "--device", "cpu")
    from nf4convert.safetensors_io.read import TensorReader, read_tensors

    with TensorReader() as reader:
        made = reader.tensor(read_tensors(tmp_path / "out")[weight])
    assert torch.equal(made[1], torch.zeros_like(made[1])) and made[0].abs().sum() > 0
    assert "OK: bit-exact" in run("verify", tmp_path / "out", source, "-q", "--device", "cpu").stdout
    refusals = (ROOT / "docs" / "cli.md").read_text().split("**8-bit weights**", 1)[1].split("**Output**", 1)[0]
    assert "positive" not in refusals and re.search(r"a scale of 0 is taken", " ".join(refusals.split()))
