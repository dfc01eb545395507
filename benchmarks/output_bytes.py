"""What the tool puts out, case by case, to hold a refactoring to: a fixed list of command lines and API calls on the
example checkpoint (examples/tiny-llama-bnb-4bit), each recorded as its exit code (an API call: its exception's type),
the sha256 of every file it wrote, and its standard output and error with the temporary folder, timings and free space
normalized. Run it before a change with ``--save`` and after it with ``--compare``: the cases that differ are printed.

    python benchmarks/output_bytes.py --save before.json
    python benchmarks/output_bytes.py --compare before.json      # exit 1 if any case differs
    python benchmarks/output_bytes.py --compare before.json -k gguf   # only the cases whose name holds "gguf"

Every case runs in a fresh process (``python -m nf4convert``; the API cases in one process of their own), on the CPU,
offline (HF_HUB_OFFLINE=1, a Hub cache of its own), in one scratch folder. A few minutes on one core.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "tiny-llama-bnb-4bit"
SRC = "src/tiny-llama-bnb-4bit"  # the example, copied into the scratch folder (names are relative to it)
CPU = ["--device", "cpu"]

# (name, arguments of ``nf4convert``, environment additions); a name is unique. "files": the outputs whose bytes count.
CLI_CASES: list[tuple[str, list[str], dict]] = [
    ("help", ["--help"], {}),
    ("help-convert", ["convert", "--help"], {}),
    ("help-verify", ["verify", "--help"], {}),
    ("help-batch", ["batch", "--help"], {}),
    ("no-arguments", [], {}),
    ("convert-auto", [SRC, "-o", "out/auto", *CPU, "-q"], {}),
    ("convert-bf16", [SRC, "-o", "out/bf16", "--dtype", "bf16", *CPU, "-q"], {}),
    ("convert-fp16", [SRC, "-o", "out/fp16", "--dtype", "fp16", *CPU, "-q"], {}),
    ("convert-fp32-shards", [SRC, "-o", "out/fp32", "--dtype", "float32", "--max-shard-size", "2MB", *CPU, "-q"], {}),
    ("convert-named", ["convert", SRC, "--dtype", "FP16", *CPU, "-q"], {}),  # ./<name>-fp16
    ("convert-adapter", [SRC, "--adapter", "src/lora", "-o", "out/merged", *CPU, "-q"], {}),
    ("convert-adapter-as-source", ["src/lora", "-o", "out/merged2", *CPU, "-q"], {}),
    ("convert-verify", [SRC, "-o", "out/verified", *CPU, "-q", "--verify"], {}),
    ("gguf-f16", [SRC, "-o", "out/m-f16.gguf", *CPU, "-q", "--dtype", "fp16"], {}),
    ("gguf-bf16", [SRC, "-o", "out/m-bf16.gguf", *CPU, "-q"], {}),
    ("gguf-q8_0", [SRC, "-o", "out/m-q8_0.gguf", "--gguf-type", "q8_0", *CPU, "-q"], {}),
    ("gguf-named", [SRC, "--gguf-type", "F16", *CPU, "-q"], {}),  # ./<name>-f16.gguf
    ("dry-run", [SRC, "-o", "out/dry", "--dry-run", *CPU], {}),
    ("dry-run-gguf", [SRC, "-o", "out/dry.gguf", "--gguf-type", "q8_0", "--dry-run", *CPU], {}),
    ("dry-run-adapter", [SRC, "--adapter", "src/lora", "--dry-run", *CPU], {}),
    ("verify-folder", ["verify", "out/bf16", SRC, *CPU, "-q"], {}),
    ("verify-gguf", ["verify", "out/m-q8_0.gguf", SRC, *CPU, "-q"], {}),
    ("verify-adapter", ["verify", "out/merged", SRC, "--adapter", "src/lora", *CPU, "-q"], {}),
    ("verify-fp16", ["verify", "out/fp16", SRC, *CPU, "-q"], {}),
    ("batch", ["batch", SRC, "src/second-bnb-4bit", "-o", "out/batch", *CPU, "-q"], {}),
    ("batch-json-gguf", ["batch", SRC, "-o", "out/batchg", "--gguf-type", "q8_0", "--json", *CPU], {}),
    ("batch-dry-run", ["batch", SRC, "src/second-bnb-4bit", "-o", "out/batchd", "--dry-run", *CPU], {}),
    ("batch-skip-existing", ["batch", SRC, "src/second-bnb-4bit", "-o", "out/batch", "--skip-existing", *CPU], {}),
    ("batch-again", ["batch", SRC, "-o", "out/batch", *CPU, "-q"], {}),  # its output is there: refused, the hint
    # refusals
    ("bad-dtype", [SRC, "-o", "out/x", "--dtype", "int3", *CPU], {}),
    ("bad-gguf-type", [SRC, "-o", "out/x.gguf", "--gguf-type", "q3_k_xxl", *CPU], {}),
    ("bad-shard-size", [SRC, "-o", "out/x", "--max-shard-size", "lots", *CPU], {}),
    ("zero-shard-size", [SRC, "-o", "out/x", "--max-shard-size", "0"], {}),
    ("bad-device", [SRC, "-o", "out/x", "--device", "tpu"], {}),
    ("bad-revision", [SRC, "-o", "out/x", "--revision", "a..b"], {}),
    ("missing-source", ["src/nothing-here", "-o", "out/x", *CPU], {}),
    ("missing-hub-source", ["nobody-org/no-such-model", "-o", "out/x", *CPU], {}),
    ("out-exists", [SRC, "-o", "out/bf16", *CPU, "-q"], {}),
    ("out-is-source", [SRC, "-o", SRC, "--overwrite", *CPU, "-q"], {}),
    ("out-inside-source", [SRC, "-o", f"{SRC}/inside", *CPU, "-q"], {}),
    ("out-a-file", [SRC, "-o", "src/a-file", *CPU, "-q"], {}),
    ("adapter-twice", [SRC, "--adapter", "src/lora", "--adapter", "src/lora", *CPU], {}),
    ("missing-adapter", [SRC, "--adapter", "src/no-lora", "-o", "out/x", *CPU], {}),
    ("private-alone", [SRC, "--private", *CPU], {}),
    ("dry-run-verify", [SRC, "--dry-run", "--verify", *CPU], {}),
    ("push-bad-repo", [SRC, "--push-to-hub", "not a repo", *CPU], {}),
    ("unknown-option", [SRC, "--colour", "red"], {}),
    ("mistyped-command", ["verfy", "out/bf16", SRC], {}),
    ("bad-env-stream", [SRC, "-o", "out/x", *CPU], {"NF4CONVERT_STREAM_MEMORY": "lots"}),
    ("bad-env-writers", [SRC, "-o", "out/x", "--dry-run", *CPU], {"NF4CONVERT_WRITERS": "0"}),
    ("verify-missing-output", ["verify", "out/nothing", SRC, *CPU], {}),
    ("verify-swapped", ["verify", SRC, "out/bf16", *CPU], {}),
    ("verify-bad-device", ["verify", "out/bf16", SRC, "--device", "tpu"], {}),
    ("verify-bad-env", ["verify", "out/bf16", SRC, *CPU, "-q"], {"NF4CONVERT_STREAM_MEMORY": "lots"}),
    ("batch-no-sources", ["batch", "-o", "out/b"], {}),
    ("batch-skip-overwrite", ["batch", SRC, "-o", "out/b", "--skip-existing", "--overwrite"], {}),
    ("batch-bad-dtype", ["batch", SRC, "-o", "out/b", "--dtype", "fp8"], {}),
    ("batch-missing-source", ["batch", "src/nothing-here", SRC, "-o", "out/batchm", *CPU, "-q"], {}),
]

# API calls, run in one process: (name, Python source of the call, with ``nf4convert`` imported as ``api``)
API_CASES: list[tuple[str, str]] = [
    ("api-convert-fp16", f"api.convert({SRC!r}, 'out/api-fp16', dtype='fp16', device='cpu', progress=False)"),
    ("api-convert-gguf", f"api.convert({SRC!r}, 'out/api.gguf', gguf_type='q8_0', device='cpu', progress=False)"),
    ("api-bad-dtype", f"api.convert({SRC!r}, 'out/y', dtype='int3')"),
    ("api-bad-size", f"api.convert({SRC!r}, 'out/y', max_shard_size='lots')"),
    ("api-bad-gguf-type", f"api.convert({SRC!r}, 'out/y.gguf', gguf_type='zz', device='cpu')"),
    ("api-output-and-dir", f"api.convert({SRC!r}, 'out/y', output_dir='out')"),
    ("api-bad-stem", f"api.convert({SRC!r}, stem='a/b')"),
    ("api-bad-revision", f"api.convert({SRC!r}, 'out/y', revision='a..b')"),
    ("api-unknown-keyword", f"api.convert({SRC!r}, 'out/y', colour='red')"),
    ("api-bad-device", f"api.convert({SRC!r}, 'out/y', device='tpu')"),
    ("api-verify", f"api.verify('out/api-fp16', {SRC!r}, device='cpu')"),
    ("api-verify-bad-device", f"api.verify('out/api-fp16', {SRC!r}, device='tpu')"),
    ("api-verify-bad-dtype", f"api.verify('out/api-fp16', {SRC!r}, dtype='int3')"),
    ("api-verify-unknown-keyword", f"api.verify('out/api-fp16', {SRC!r}, colour='red')"),
]

API_RUNNER = r"""
import json, sys
import nf4convert as api
cases = json.loads(sys.argv[1])
results = {}
for name, call in cases:
    try:
        value = eval(call)
        results[name] = {"raised": None, "message": None, "value": repr_of(value)}
    except BaseException as error:
        results[name] = {"raised": type(error).__name__, "message": str(error), "value": None}
print(json.dumps(results))
"""

API_PRELUDE = r"""
def repr_of(value):
    if hasattr(value, "ok") and hasattr(value, "problems"):
        return {"ok": value.ok, "checked": value.checked, "problems": list(value.problems), "notes": list(value.notes)}
    if hasattr(value, "tensors") and hasattr(value, "dtype"):
        return {"output": str(value.output), "dtype": value.dtype, "tensors": value.tensors, "bytes": value.bytes,
                "warnings": list(value.warnings), "made": value.made, "gguf_type": value.gguf_type}
    return repr(value)
"""


def _scratch(work: Path) -> None:
    """The scratch folder: the example (twice, under two names), a LoRA adapter for it, a file."""
    (work / "src").mkdir(parents=True)
    shutil.copytree(EXAMPLE, work / SRC)
    shutil.copytree(EXAMPLE, work / "src" / "second-bnb-4bit")
    (work / "src" / "a-file").write_text("not a folder\n")
    (work / "out").mkdir()
    _adapter(work / "src" / "lora", base=SRC)


def _adapter(folder: Path, base: str) -> None:
    """A small peft LoRA adapter for the example, random values from a fixed seed (peft starts lora_B at zero)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = json.loads((EXAMPLE / "config.json").read_text())
    config.pop("quantization_config")
    torch.manual_seed(7)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**config))
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
    get_peft_model(model, lora).save_pretrained(folder)
    generator = torch.Generator().manual_seed(7)
    path = folder / "adapter_model.safetensors"
    tensors = {
        key: (0.05 * torch.randn(saved.shape, generator=generator)).to(torch.bfloat16).contiguous()
        for key, saved in sorted(load_file(path).items())
    }
    save_file(tensors, path)
    adapter_config = json.loads((folder / "adapter_config.json").read_text())
    adapter_config["base_model_name_or_path"] = base
    (folder / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2, sort_keys=True))


def _normalized(text: str, work: Path) -> str:
    for spelled in {str(work), str(work.resolve())}:
        text = text.replace(spelled, "<WORK>")
    text = text.replace(str(ROOT), "<REPO>")
    text = re.sub(r"\b\d+(\.\d+)? s\b", "<T> s", text)  # a run's seconds
    text = re.sub(r'"seconds": [0-9.]+', '"seconds": <T>', text)
    text = re.sub(r"free where it goes: [0-9.]+ [KMGT]?B", "free where it goes: <FREE>", text)
    text = re.sub(r"(?m)(?<=  )\d+\.\d(?=  |$)", "<T>", text)  # a batch table's seconds column
    text = re.sub(r"only [0-9.]+ [KMGT]?B free", "only <FREE> free", text)
    return text


def _files(work: Path, before: set[Path]) -> dict[str, str]:
    """sha256 of every file under ``work`` that was not there before (or changed), by its path relative to ``work``."""
    found = {}
    for path in sorted(work.rglob("*")):
        if path.is_file() and not path.is_symlink():
            relative = str(path.relative_to(work))
            found[relative] = hashlib.sha256(path.read_bytes()).hexdigest()
    return found


def _environment(home: Path, extra: dict) -> dict:
    environment = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("NF4CONVERT_", "HF_")) and key not in ("COLUMNS", "LINES")
    }
    environment.update(
        HF_HUB_OFFLINE="1",
        HF_HOME=str(home / "hf"),
        HF_HUB_DISABLE_TELEMETRY="1",
        PYTHONPATH=str(ROOT) + os.pathsep + environment.get("PYTHONPATH", ""),
        COLUMNS="120",
        TERM="dumb",
        PYTHONHASHSEED="0",
    )
    environment.update(extra)
    return environment


def run_cases(only: str | None = None) -> dict:
    results = {}
    with tempfile.TemporaryDirectory(prefix="nf4-bytes-") as scratch:
        home = Path(scratch)
        work = home / "work"
        _scratch(work)
        for name, arguments, extra in CLI_CASES:
            if only and only not in name:
                continue
            seen = _files(work, set())
            ran = subprocess.run(
                [sys.executable, "-m", "nf4convert", *arguments],
                cwd=work,
                env=_environment(home, extra),
                capture_output=True,
                text=True,
                timeout=600,
            )
            now = _files(work, set())
            results[name] = {
                "argv": arguments,
                "env": extra,
                "exit": ran.returncode,
                "stdout": _normalized(ran.stdout, work),
                "stderr": _normalized(ran.stderr, work),
                "files": {path: digest for path, digest in now.items() if seen.get(path) != digest},
            }
            print(f"{name}: exit {ran.returncode}", file=sys.stderr, flush=True)
        api = [(name, call) for name, call in API_CASES if not only or only in name]
        if api:
            seen = _files(work, set())
            ran = subprocess.run(
                [sys.executable, "-c", API_PRELUDE + API_RUNNER, json.dumps(api)],
                cwd=work,
                env=_environment(home, {}),
                capture_output=True,
                text=True,
                timeout=600,
            )
            now = _files(work, set())
            try:
                answers = json.loads(ran.stdout.strip().splitlines()[-1])
            except (json.JSONDecodeError, IndexError):
                raise SystemExit(f"the API cases failed to run:\n{ran.stderr[-4000:]}") from None
            written = {path: digest for path, digest in now.items() if seen.get(path) != digest}
            for name, _ in api:
                answer = answers[name]
                results[name] = {
                    "call": dict(API_CASES)[name],
                    "raised": answer["raised"],
                    "message": _normalized(answer["message"] or "", work),
                    "value": json.loads(_normalized(json.dumps(answer["value"]), work)),
                }
                print(f"{name}: {answer['raised'] or 'returned'}", file=sys.stderr, flush=True)
            results["api-files"] = {"files": written}
    return results


def differences(before: dict, after: dict) -> list[str]:
    lines = []
    for name in sorted(set(before) | set(after)):
        if name not in after or name not in before:
            lines.append(f"{name}: only in the {'saved' if name in before else 'new'} run")
            continue
        for key in sorted(set(before[name]) | set(after[name])):
            old, new = before[name].get(key), after[name].get(key)
            if old != new:
                if isinstance(old, dict) and isinstance(new, dict):
                    changed = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
                    lines.append(f"{name}: {key} differ: {', '.join(changed)}")
                elif isinstance(old, str) and isinstance(new, str):
                    import difflib

                    diff = difflib.unified_diff(old.splitlines(), new.splitlines(), "saved", "now", lineterm="", n=0)
                    lines.append(f"{name}: {key} differs:\n    " + "\n    ".join(list(diff)[2:]))
                else:
                    lines.append(f"{name}: {key}: saved {old!r}, now {new!r}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--save", metavar="FILE", help="write the results to FILE (JSON)")
    parser.add_argument("--compare", metavar="FILE", help="compare with FILE's results; exit 1 if any case differs")
    parser.add_argument("-k", metavar="TEXT", help="only the cases whose name holds TEXT")
    arguments = parser.parse_args()
    results = run_cases(arguments.k)
    if arguments.save:
        Path(arguments.save).write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
        print(f"{len(results)} cases saved to {arguments.save}", file=sys.stderr)
    if arguments.compare:
        saved = json.loads(Path(arguments.compare).read_text())
        if arguments.k:
            saved = {name: value for name, value in saved.items() if name in results}
        found = differences(saved, results)
        for line in found:
            print(line)
        print(f"{len(results)} cases, {len(found)} differences", file=sys.stderr)
        sys.exit(1 if found else 0)


if __name__ == "__main__":
    main()
