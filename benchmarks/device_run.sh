#!/usr/bin/env bash
# One call on the GPU machine: GPU tests, then the benchmark. Expects bitsandbytes unpacked under
# .carry/site and Unsloth's kernel copy under .carry/peers (see README, "GPU tests and benchmark").
set -o pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
export PYTHONPATH="$root:$root/.carry/site:$root/.carry/peers:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
out=${OUT:-$root/.device-out}
mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
python3 -c "import torch, triton, bitsandbytes; print('torch', torch.__version__, 'triton', triton.__version__, 'bnb', bitsandbytes.__version__)"
python3 -m pytest "$root/tests/test_gpu.py" "$root/tests/test_sm75_build.py" -q -p no:cacheprovider ${PYTEST_ARGS:-} 2>&1 | tee "$out/gpu_tests.log" | tail -40
python3 "$root/benchmarks/host_overhead.py" 2>&1 | tee "$out/host_overhead.log"
python3 "$root/benchmarks/bench_dequant.py" --json "$out/bench.json" ${BENCH_ARGS:-} 2>&1 | tee "$out/bench.log" | grep -v '^{'
