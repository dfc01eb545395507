#!/usr/bin/env bash
# The GPU machine: the GPU tests, the whole-model conversion benchmark, the kernel benchmark, torch.compile against eager,
# the float formats at real shapes.
# Expects bitsandbytes unpacked under .carry/site, peft 0.21 under .carry/peft and Unsloth's kernel copy under
# .carry/peers (docs/performance.md, "How to run them"). STAGES picks parts
# (tests,convert,gguf,verify,int,formats,dequant,compile,kernels,push); logs go to $OUT.
set -o pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
carry=$(cd "$root/.." && pwd)  # .carry when run from .carry/perf
export PYTHONPATH="$root:$root/.carry/peft:$root/.carry/site:$root/.carry/peers:$carry/site:$carry/peers:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
out=${OUT:-$root/.device-out}
stages=${STAGES:-tests,convert,dequant,compile}
mkdir -p "$out"
cd "$root"
{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader; nproc; free -g | head -2; df -h /tmp "$root" | tail -2
  lscpu | grep -E "Model name|avx512fp16" | cut -c1-120
  echo "vm.dirty_background_ratio=$(cat /proc/sys/vm/dirty_background_ratio) vm.dirty_ratio=$(cat /proc/sys/vm/dirty_ratio)"
  python3 -c "import torch, triton, transformers, bitsandbytes, peft; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'bnb', bitsandbytes.__version__, 'peft', peft.__version__)"; } 2>&1 | tee "$out/env.log"
if [[ $stages == *tests* ]]; then
  # The suite, one pytest a test file and TEST_JOBS files at once (TEST_FILES: the files, all by default): the tests
  # marked gpu run here, and every other test meets CUDA where it picks a device itself. Not pytest-xdist: under it the
  # GPU tests ran far slower on the H200 than one file a process (docs/performance.md, "Tests on the GPU").
  mkdir -p "$out/tests"
  printf '%s\n' ${TEST_FILES:-tests/test_*.py} | PYTEST_ARGS="${PYTEST_ARGS:-}" TESTS_TIMEOUT=${TESTS_TIMEOUT:-540} \
    xargs -P ${TEST_JOBS:-8} -I{} bash -c 'timeout $TESTS_TIMEOUT python3 -m pytest {} -q -p no:cacheprovider --durations=5 \
      $PYTEST_ARGS > "$0/$(basename {} .py).log" 2>&1; echo "{} exit $?: $(tail -1 "$0/$(basename {} .py).log")"' "$out/tests" \
    | sort | tee "$out/gpu_tests.log"
fi
if [[ $stages == *convert* ]]; then
  # Warmed (Triton's cache filled by a one-layer run, as after a user's first conversion), and once more on an empty
  # Triton cache: a fresh machine's first run.
  timeout ${CONVERT_TIMEOUT:-330} python3 benchmarks/bench_convert.py --workdir /tmp/bench-convert --warm --json "$out/convert.json" \
    --routes ${ROUTES:-dd,cuda,cpu,transformers,adapter,peft,cuda+TRITON_CACHE_DIR=/tmp/nf4convert-empty-triton-cache} ${CONVERT_ARGS:-} 2>&1 \
    | tee "$out/convert.log" | grep -v '^ *$'
  rm -rf /tmp/bench-convert
fi
if [[ $stages == *gguf* ]]; then
  # -o x.gguf (bf16, f16, q8_0) against the dense conversion on each route, with the targets (1.1x, 1.2x, 1 GB) and
  # each run's profile; gguf-bf16 once more under -X importtime. GGUF_ARGS: "--shape 70b" for the 70B shapes (8 layers).
  # The checkpoint is built in (or taken from) the verify stage's folder, which keeps it for that stage.
  timeout ${GGUF_TIMEOUT:-580} python3 benchmarks/bench_gguf.py --workdir /tmp/bench-verify --device ${GGUF_DEVICES:-cuda,cpu} \
    --importtime --json "$out/gguf.json" ${GGUF_ARGS:-} 2>&1 | tee "$out/gguf.log" | grep -v ' {"seconds"'
fi
if [[ $stages == *verify* ]]; then
  # verify beside the conversion. VERIFY_ARGS: the 8B shapes by default; "--shape 70b --layers 8 --steps
  # dd,cuda,verify-cuda,cpu,verify-cpu,adapter,verify-adapter" for the 70B shapes (the checkpoint stays in
  # /tmp/bench-verify for a later stage of the same call: "--build-only" first splits a long run).
  timeout ${VERIFY_TIMEOUT:-540} python3 benchmarks/bench_verify.py --workdir /tmp/bench-verify --json "$out/verify.json" \
    ${VERIFY_ARGS:---shape 8b --importtime} 2>&1 | tee "$out/verify.log" | grep -v ' {"seconds"'
fi
if [[ $stages == *int* ]]; then
  # GPTQ and AWQ (bench_int.py): INT_ARGS picks the checkpoints and steps; one checkpoint a call stays well inside a
  # call's time ("--checkpoints gptq-8b", "--checkpoints awq-8b", "--checkpoints gptq-70b").
  timeout ${INT_TIMEOUT:-560} python3 benchmarks/bench_int.py --workdir /tmp/bench-int --json "$out/int.json" \
    ${INT_ARGS:---checkpoints gptq-8b} 2>&1 | tee "$out/int.log" | grep -v '^{'
  rm -rf /tmp/bench-int
fi
if [[ $stages == *dequant* ]]; then
  timeout ${DEQUANT_TIMEOUT:-200} python3 benchmarks/bench_dequant.py --json "$out/dequant.json" ${DEQUANT_ARGS:---timer graph --rounds 3} 2>&1 | tee "$out/dequant.log" | grep -v '^{'
fi
if [[ $stages == *compile* ]]; then
  # Stacks of 16 and 48 layers: all five shapes in both dtypes take ~15 min on the H200, more than one device call;
  # split them with COMPILE_ARGS="--shapes ..." (README's figures: three shapes, then the two large ones in fp16).
  timeout ${COMPILE_TIMEOUT:-560} python3 benchmarks/bench_compile.py --json "$out/compile.json" ${COMPILE_ARGS:-} 2>&1 | tee "$out/compile.log" | grep -v '^{'
fi
if [[ $stages == *kernels* ]]; then
  # What a compiled forward runs beside eager: GPU kernels, host profile, and Inductor's code and guards.
  TORCH_LOGS=${KERNELS_LOGS:-output_code,guards,recompiles} timeout ${KERNELS_TIMEOUT:-120} python3 benchmarks/bench_compile.py \
    --kernels ${KERNELS_SHAPE:-14336x4096} ${KERNELS_ARGS:-} > "$out/kernels.log" 2>&1; grep "^=====" "$out/kernels.log"; tail -5 "$out/kernels.log"
fi
if [[ $stages == *formats* ]]; then
  # Models released as floats at their real shapes (bench_formats.py): gpt-oss-20b's MXFP4 (13 GB in, 42 GB out) and
  # DeepSeek-V3's FP8 (3 dense + 1 MoE layers: 17 GB in, 30 GB out), each route and verify beside dd. FORMAT picks
  # one (mxfp4, fp8); FORMATS_ARGS adds options ("--steps dd,cuda,verify-cuda", "--build-only": the source stays in
  # /tmp/bench-formats for a later call). Verify needs compressed-tensors (and loguru) for FP8 on the path.
  for format in ${FORMAT:-mxfp4 fp8}; do
    timeout ${FORMATS_TIMEOUT:-560} python3 benchmarks/bench_formats.py --format "$format" --workdir /tmp/bench-formats \
      --json "$out/formats-$format.json" ${FORMATS_ARGS:-} 2>&1 | tee "$out/formats-$format.log" | grep -v '^{'
  done
fi
if [[ $stages == *push* ]]; then
  # Hub to Hub with no local copy (bench_push.py) against a fake Hub whose links run at PUSH_BANDWIDTHS MB/s each way,
  # beside download, convert and upload alone and today's download-convert-upload; PUSH_ARGS adds options.
  timeout ${PUSH_TIMEOUT:-560} python3 benchmarks/bench_push.py --layers ${PUSH_LAYERS:-4} --device ${PUSH_DEVICE:-cuda} \
    --bandwidths ${PUSH_BANDWIDTHS:-100,500,0} --workdir /tmp/bench-push --json "$out/push.json" ${PUSH_ARGS:-} 2>&1 \
    | tee "$out/push.log" | grep -v '^[0-9.]* MB/s'
fi
