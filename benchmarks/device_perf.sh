#!/usr/bin/env bash
# Issue 10 on the GPU machine, one call: GPU tests of the pipeline, kernel and compile paths, then the whole-model
# conversion benchmark, then kernel variants. Expects bitsandbytes unpacked under ../site or .carry/site and
# Unsloth's kernel under ../peers or .carry/peers. STAGES picks parts (tests,convert,dequant); logs go to $OUT.
set -o pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
carry=$(cd "$root/.." && pwd)  # .carry when run from .carry/perf
export PYTHONPATH="$root:$carry/site:$carry/peers:$root/.carry/site:$root/.carry/peers:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
out=${OUT:-$root/.device-out}
stages=${STAGES:-tests,convert,dequant}
mkdir -p "$out"
cd "$root"
{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader; nproc; free -g | head -2; df -h /tmp "$root" | tail -2
  python3 -c "import torch, triton, transformers, bitsandbytes; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'bnb', bitsandbytes.__version__)"; } 2>&1 | tee "$out/env.log"
if [[ $stages == *tests* ]]; then
  timeout ${TESTS_TIMEOUT:-200} python3 -m pytest ${TEST_FILES:-tests/test_stream.py tests/test_compile.py tests/test_configs.py tests/test_gpu.py} \
    -q -p no:cacheprovider -x ${PYTEST_ARGS:-} 2>&1 | tee "$out/gpu_tests.log" | tail -25
fi
if [[ $stages == *convert* ]]; then
  timeout ${CONVERT_TIMEOUT:-280} python3 benchmarks/bench_convert.py --workdir /tmp/bench-convert --json "$out/convert.json" ${CONVERT_ARGS:-} 2>&1 \
    | tee "$out/convert.log" | grep -v '^ *$'
  rm -rf /tmp/bench-convert
fi
if [[ $stages == *dequant* ]]; then
  timeout ${DEQUANT_TIMEOUT:-200} python3 benchmarks/bench_dequant.py --json "$out/dequant.json" ${DEQUANT_ARGS:-} 2>&1 | tee "$out/dequant.log" | grep -v '^{'
fi
