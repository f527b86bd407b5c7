#!/usr/bin/env bash
# Issue 15's checks on a lent GPU machine, in as few device calls as possible. That machine
# has no network and its own python3 with torch (2.11+cu130), pytest, transformers,
# torchvision, lightning...: hookplug is built there against that torch, without deps.
#
#   scripts/gpu_check.sh test    # build (CUDA kernels), the whole suite, compute-sanitizer
#   scripts/gpu_check.sh bench   # build, then the op, training-step and telemetry benches
#   scripts/gpu_check.sh all     # both (may not fit one 10-minute call)
#
# Logs go to $OUT (the device tool brings them back) or ./gpu-out; the last lines printed
# are a summary. Nothing here changes the GPU's settings.
set -uo pipefail
cd "$(dirname "$0")/.."
what="${1:-all}"
case "$what" in test|bench|all) ;; *) echo "usage: scripts/gpu_check.sh test|bench|all" >&2; exit 2 ;; esac
out="${OUT:-gpu-out}"
mkdir -p "$out"
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1 HOOKPLUG_REQUIRE_EXT=1
summary=()

build() {
  { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"
    nvcc --version | tail -1; } 2>&1 | tee "$out/machine.txt"
  if ! "$PY" -m pip install -q --no-build-isolation --no-deps -e . >"$out/build.log" 2>&1; then
    tail -30 "$out/build.log"; echo "BUILD FAILED (log: $out/build.log)"; exit 1
  fi
  "$PY" -m pip install -q --no-deps -e examples/thirdparty_plugin >>"$out/build.log" 2>&1
  "$PY" -c "import hookplug, hookplug._build_info as b; from hookplug import ops
print('backend', ops.backend(), '| CUDA kernels', ops._has_cuda, '|', getattr(b, 'CUDA_WHY', ''))" \
    | tee -a "$out/build.log"
}

run() {  # run NAME CMD...: log to $out/NAME.log, note pass/fail
  local name="$1"; shift
  echo "== $name: $*"
  "$@" >"$out/$name.log" 2>&1
  local rc=$?
  tail -15 "$out/$name.log"
  summary+=("$name: rc $rc")
}

build
case "$what" in
  test|all)
    run tests "$PY" -m pytest -q -p no:cacheprovider tests
    run sanitizer env HOOKPLUG_TEST_SANITIZER=1 "$PY" -m pytest -q -p no:cacheprovider \
      tests/test_ops_cuda.py -k sanitizer -rA ;;&
  bench|all)
    run bench_stats "$PY" benchmarks/bench_stats.py --device cuda --sizes 1 16 64 256 1024 \
      --dtypes float32 bfloat16 float16 --repeat 20
    run bench_training "$PY" benchmarks/bench_training.py --device cuda --rounds 5 --steps 20
    run bench_telemetry "$PY" benchmarks/bench_telemetry.py --device cuda --rounds 5 ;;
  *) ;;
esac
echo "== summary"
printf '%s\n' "${summary[@]}"
