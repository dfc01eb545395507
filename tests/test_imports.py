"""Imports off the critical path: bitsandbytes imported with its import-time ``torch.compile`` calls deferred gives
bit-identical results to its normal import (on the CPU; on a GPU, its CUDA ``dequantize_4bit``) without importing
torch's compiler; the deferral compiles as torch would on first call; the preload thread imports only where allowed,
and a module it failed on fails again, the same way, where it is needed."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from fixtures.processes import package_env

# bitsandbytes' functions on fixed random inputs, each result's bytes hashed: imported as verify imports it
# ("deferred") or as a plain import ("normal")
OUTPUTS = """
import hashlib, json, sys
import torch
if sys.argv[1] == "deferred":
    from nf4convert.verification.libraries import import_bitsandbytes
    compile_before = torch.compile
    import_bitsandbytes()
    assert torch.compile is compile_before, "torch.compile left replaced"
    compiler = [name for name in ("torch._inductor.compile_fx", "torch._dynamo.convert_frame") if name in sys.modules]
else:
    import bitsandbytes
    compiler = []
import bitsandbytes.functional as F

device = sys.argv[2]
generator = torch.Generator().manual_seed(11)
results = {}

def put(name, *tensors):
    digest = hashlib.sha256()
    for tensor in tensors:
        digest.update(tensor.detach().contiguous().cpu().view(-1).view(torch.uint8).numpy().tobytes())
    results[name] = digest.hexdigest()

for dtype in (torch.bfloat16, torch.float16, torch.float32):
    values = (torch.randn(257, 192, generator=generator) * 3).to(dtype).to(device)
    values.view(-1)[::97] = 0
    for quant_type in ("nf4", "fp4"):
        for nested in (False, True):
            for blocksize in (64, 128):
                name = f"{dtype}-{quant_type}-{nested}-{blocksize}"
                packed, state = F.quantize_4bit(
                    values, blocksize=blocksize, quant_type=quant_type, compress_statistics=nested
                )
                put(f"quantize_4bit {name}", packed, state.absmax)
                put(f"dequantize_4bit {name}", F.dequantize_4bit(packed, state))
                parts = state.as_dict(packed=True)
                again = F.QuantState.from_dict({k: v for k, v in parts.items()}, device=device)
                put(f"from_dict {name}", F.dequantize_4bit(packed, again))
    blockwise, state = F.quantize_blockwise(values.float().reshape(-1))
    put(f"blockwise {dtype}", blockwise, state.absmax, F.dequantize_blockwise(blockwise, state))
    if device == "cpu" or dtype == torch.float16:
        codes, scales, _ = F.int8_vectorwise_quant(values.to(torch.float16))
        put(f"int8 {dtype}", codes, scales, F.int8_vectorwise_dequant(codes, scales))
for quant_type in ("nf4", "fp4"):
    put(f"table {quant_type}", F.get_4bit_type(quant_type, device="cpu"))
put("dynamic map", F.create_dynamic_map(signed=True))
print(json.dumps({"results": results, "compiler": compiler}))
"""


def _outputs(how: str, device: str) -> dict:
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(OUTPUTS), how, device],
        capture_output=True,
        text=True,
        timeout=600,
        env=package_env(),
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.splitlines()[-1])


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_bitsandbytes_with_its_compile_deferred_gives_the_same_bits(device):
    normal, deferred = _outputs("normal", device), _outputs("deferred", device)
    assert deferred["results"] == normal["results"] and len(normal["results"]) > 50
    assert deferred["compiler"] == []  # and torch's compiler stack was not imported for it


def test_compile_on_first_call_compiles_once_as_torch_would(monkeypatch):
    import torch

    from nf4convert.verification.libraries import compile_on_first_call

    calls = []

    def compile_now(model=None, **options):
        calls.append((model, options))
        return lambda *args, **kwargs: ("compiled", model(*args, **kwargs))

    monkeypatch.setattr(torch, "compile", compile_now)

    def double(x, scale=2):
        """doubled"""
        return x * scale

    with compile_on_first_call():
        deferred = torch.compile(double, dynamic=False)
        decorated = torch.compile(fullgraph=True)(double)
        assert calls == []
    assert torch.compile is compile_now
    assert deferred.__name__ == "double" and deferred.__doc__ == "doubled"
    assert deferred(3) == ("compiled", 6) and deferred(4, scale=3) == ("compiled", 12)
    assert decorated(5) == ("compiled", 10)
    assert calls == [(double, {"dynamic": False}), (double, {"fullgraph": True})]


PRELOAD = """
import sys, threading, time
from nf4convert import preload
preload.start("json.tool")
assert "json.tool" not in sys.modules and threading.active_count() == 1, "queued outside allowed"
started = threading.Event()

def slow():
    started.set()
    time.sleep(0.3)
    import colorsys

def broken():
    raise ImportError("broken on purpose")

with preload.allowed():
    preload.start(("colorsys", slow), ("no_such_module_here", broken), here=("decimal",))
    assert "decimal" in sys.modules  # imported on this thread first
    started.wait(5)
    assert "colorsys" not in sys.modules
    preload.ready("colorsys")
    assert "colorsys" in sys.modules
    preload.ready("no_such_module_here")
    preload.ready("never_queued")
try:
    import no_such_module_here
except ImportError as error:
    print("raised again:", type(error).__name__)
"""


def test_preload_imports_on_the_side_only_where_allowed():
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(PRELOAD)], capture_output=True, text=True, timeout=60, env=package_env()
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "raised again: ModuleNotFoundError"


def test_verify_builds_its_model_while_its_libraries_import_on_the_side(tmp_path):
    """verify in a fresh process, its libraries importing on the preload thread while it plans: transformers' model
    on the meta device is built whole (no module handed over half imported), and the check passes."""
    from fixtures.checkpoints import build

    source = build(tmp_path / "bert-bnb-4bit", "bert-encoder-nf4")
    out = tmp_path / "out"
    command = [sys.executable, "-m", "nf4convert"]
    subprocess.run([*command, str(source), "-o", str(out), "-q", "--device", "cpu"], check=True, env=package_env())
    for _ in range(2):
        result = subprocess.run(
            [*command, "verify", str(out), str(source), "--device", "cpu", "-q"],
            capture_output=True,
            text=True,
            timeout=600,
            env=package_env(),
        )
        assert result.returncode == 0 and "OK: bit-exact" in result.stdout, result.stdout + result.stderr
        assert "could not build the model" not in result.stdout, result.stdout
