"""The kernel builds for a Tesla T4 (sm_75) and keeps its two roundings whatever the fusion flag.

Triton compiles ahead of time for a named target with its bundled ptxas, so this runs without a GPU.
It runs in a subprocess because the interpreter (set by conftest on GPU-less machines) replaces
triton.jit at import.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _build(*args):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    run = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "fixtures" / "aot_build.py"), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    if run.returncode != 0 and "ptxas" in run.stderr and "not found" in run.stderr:
        pytest.skip("this Triton ships no ptxas")
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_builds_for_sm75_every_output_dtype():
    results = _build("75")
    assert {r["dtype"] for r in results} == {"torch.float16", "torch.bfloat16", "torch.float32"}
    for result in results:
        assert result["target"] == "sm_75"
        assert result["cubin_bytes"] > 0  # ptxas accepted the inline PTX for sm_75
        assert result["cvt_bf16"] == 0  # sm_75 has no cvt.rn.bf16.f32: integer rounding instead
        assert result["bf16_bits"] == (result["dtype"] == "torch.bfloat16")
        assert result["mul_rn"] >= 1 and result["fma"] == 0  # flush-to-zero multiplies, as inline PTX
        if result["nested"]:
            assert result["add_rn"] >= 1


def test_nested_scale_never_fused_even_with_fp_fusion_on():
    # torch.compile re-emits the kernel with FMA contraction allowed; the nested mul+add must stay two ops.
    for result in _build("90", "fp_fusion"):
        if result["nested"]:
            assert result["fma"] == 0 and result["mul_rn"] >= 1 and result["add_rn"] >= 1
