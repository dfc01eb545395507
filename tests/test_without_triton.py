"""The CPU-only install has no Triton (torch's CPU builds do not ship it): the documented Python API's CPU path works
there, and a GPU backend says in one line that it needs Triton. The child processes here see no Triton
(fixtures/no_triton.py says why that is faithful), whatever this environment has installed."""

from __future__ import annotations

import random

from fixtures.no_triton import run_without_triton

# The documented calls, each dequantized weight compared bit for bit with the CPU reference of bitsandbytes' CUDA
# arithmetic; then the Triton backend, eager and compiled, which must be one DependencyError line.
_API = """
import random, sys
sys.path.insert(0, "tests")
import torch
import nf4convert
from fixtures.weights import bits, bnb_reference_cpu, quantize

assert "triton" not in sys.modules
random.seed(int(sys.argv[1]))
CASES = (("nf4", True, torch.bfloat16), ("fp4", False, torch.float16), ("nf4", False, torch.float32))
for quant_type, nested, dtype in CASES:
    shape = (random.randrange(3, 70), random.randrange(3, 90))
    packed, state = quantize(shape, quant_type=quant_type, blocksize=64, nested=nested, dtype=dtype)
    expected = bits(bnb_reference_cpu(packed, state))
    assert torch.equal(bits(nf4convert.dequantize_4bit(packed, state)), expected)
    assert torch.equal(bits(nf4convert.dequantize_4bit(packed, state, backend="cpu")), expected)
    out = torch.empty(shape, dtype=dtype)
    nf4convert.dequantize_4bit(packed, state, out=out, backend="cpu")
    assert torch.equal(bits(out), expected)
    compiled = torch.compile(lambda p, s: nf4convert.dequantize_4bit(p, s), fullgraph=True)
    assert torch.equal(bits(compiled(packed, state)), expected)
print("cpu ok")

import os
os.environ["TRITON_INTERPRET"] = "1"  # the Triton backend on CPU tensors, as on CUDA ones, goes to the kernel
for call in (
    lambda: nf4convert.dequantize_4bit(packed, state, backend="triton"),
    lambda: torch.compile(lambda p, s: nf4convert.dequantize_4bit(p, s, backend="triton"))(packed, state),
):
    try:
        call()
    except nf4convert.DependencyError as error:
        print(type(error).__name__, error)
    else:
        raise AssertionError("the Triton backend ran without Triton")
assert "triton" not in sys.modules
"""


def test_triton_is_hidden_in_the_children():
    """Else the tests below could pass with Triton at hand."""
    result = run_without_triton(
        ["-c", "import importlib.util; assert importlib.util.find_spec('triton') is None; import triton"]
    )
    assert result.returncode == 1 and result.stderr.strip().splitlines()[-1] == (
        "ModuleNotFoundError: No module named 'triton'"
    ), result.stderr


def test_the_documented_api_works_without_triton_and_its_gpu_backend_is_one_line():
    result = run_without_triton(["-c", _API, str(random.randrange(1 << 30))])
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.strip().splitlines()
    message = (
        "DependencyError dequantizing cpu tensors with backend='triton' needs Triton, which is not installed "
        "(pip install triton; on Windows, triton-windows); the CPU path (--device cpu, backend='cpu') works without it"
    )
    assert lines == ["cpu ok", message, message], result.stdout + result.stderr


def test_the_apis_tests_pass_without_triton():
    """The Python API's own tests (eager and compiled), run where Triton is not installed; the Triton interpreter's
    cases skip there."""
    result = run_without_triton(
        ["-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_dequantize_cpu.py", "tests/test_compile.py"]
    )
    summary = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else ""
    assert result.returncode == 0 and " passed" in summary and "failed" not in summary, result.stdout[-4000:]
