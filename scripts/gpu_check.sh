#!/usr/bin/env bash
# Issue 15's checks on a lent GPU machine, in as few device calls as possible. That machine
# has no network and its own python3 with torch (2.11+cu130), pytest, transformers,
# torchvision, lightning...: hookplug is built there against that torch, without deps.
#
#   scripts/gpu_check.sh test    # build (CUDA kernels), the whole suite, compute-sanitizer
#   scripts/gpu_check.sh bench   # build, then the op, training-step and telemetry benches
#   scripts/gpu_check.sh all     # both (may not fit one 10-minute call)
#   scripts/gpu_check.sh profile # hist, build, then profile_step.py on GPT-2 and ResNet-50
#   scripts/gpu_check.sh hist    # no build: benchmarks/cuda/hist_variants.cu, the log2
#                                # histogram update A/B (~1 min)
#
# Knobs: SANITIZER=0 (skip compute-sanitizer), TELEMETRY=0 (skip bench_telemetry), GDB=1
# (run the error-message probe under cuda-gdb), PYTEST_PATHS / PYTEST_ARGS (test subset).
# Seen on an H100 (session 4): machine start ~30 s, build 55-60 s, whole suite with 8 xdist
# workers ~160 s, `bench` ~270 s. The image's CXX=/opt/gcc/bin/g++ links libstdc++
# statically (setup.py refuses that binary), so the build switches to /usr/bin/g++.
#
# Logs go to $OUT (the device tool brings them back) or ./gpu-out; the last lines printed
# are a summary. Nothing here changes the GPU's settings.
set -uo pipefail
cd "$(dirname "$0")/.."
what="${1:-all}"
case "$what" in test|bench|all|profile|hist) ;; *) echo "usage: scripts/gpu_check.sh test|bench|all|profile|hist" >&2; exit 2 ;; esac
out="${OUT:-gpu-out}"
mkdir -p "$out"
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1 HOOKPLUG_REQUIRE_EXT=1
summary=()

build() {
  local t0=$SECONDS
  # torch's CUDA headers include cuBLAS/cuSPARSE headers: where the toolkit lacks them, the
  # CUDA wheels beside torch (site-packages/nvidia/*/include) have them.
  local site inc
  site="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  for inc in "$site"/nvidia/*/include "$site"/nvidia/cu*/include; do
    [ -d "$inc" ] && export CPATH="$inc${CPATH:+:$CPATH}"
  done
  export HOOKPLUG_FORCE_CUDA="${HOOKPLUG_FORCE_CUDA:-1}"  # a failed CUDA compile must show, not be skipped
  # The image's CXX=/opt/gcc/bin/g++ has no libstdc++.so: it links libstdc++ statically, and a
  # second libstdc++ beside torch's crashes in iostreams (any number in an error message).
  if [ -n "${CXX:-}" ] && [[ "$("$CXX" -print-file-name=libstdc++.so)" != /* ]] && [ -x /usr/bin/g++ ]; then
    echo "CXX=$CXX links libstdc++ statically: building with /usr/bin/g++"; export CXX=/usr/bin/g++ CC=/usr/bin/gcc
  fi
  { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"
    nvcc --version | tail -1; } 2>&1 | tee "$out/machine.txt"
  if ! "$PY" -m pip install -v --no-build-isolation --no-deps -e . >"$out/build.log" 2>&1; then
    tail -30 "$out/build.log"; echo "BUILD FAILED (log: $out/build.log)"; exit 1
  fi
  "$PY" -m pip install -q --no-build-isolation --no-deps -e examples/thirdparty_plugin \
    >>"$out/build.log" 2>&1 || { tail -5 "$out/build.log"; echo "example plugin: install failed"; }
  "$PY" -c "import hookplug, hookplug._build_info as b; from hookplug import ops
print('backend', ops.backend(), '| CUDA kernels', ops._has_cuda, '|', getattr(b, 'CUDA_WHY', ''))" \
    | tee -a "$out/build.log"
  echo "build: $((SECONDS - t0)) s"
}

run() {  # run NAME CMD...: log to $out/NAME.log, note pass/fail
  local name="$1"; shift
  echo "== $name: $*"
  "$@" >"$out/$name.log" 2>&1
  local rc=$?
  tail -15 "$out/$name.log"
  summary+=("$name: rc $rc")
}

hist_variants() {  # the standalone histogram A/B: plain nvcc, no torch
  local arch
  arch="$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -n 1 | tr -d '.')"
  rm -f /tmp/hookplug_hist_variants
  run hist_build nvcc -O3 -std=c++17 -arch="sm_${arch:-90}" -Xptxas -v -I csrc \
    -o /tmp/hookplug_hist_variants benchmarks/cuda/hist_variants.cu
  if [[ "${summary[-1]}" == "hist_build: rc 0" ]]; then
    run hist_variants timeout 120 /tmp/hookplug_hist_variants
  else
    summary+=("hist_variants: not run (the build failed)")
  fi
}

case "$what" in hist|profile) hist_variants ;; esac
[ "$what" = hist ] || build
case "$what" in
  test|all)
    probe="import torch; from hookplug import ops; print(ops.backend()); x = torch.randn(10)
for args in ((4, 7), (4, 1, 2.0, 1.0)):
    try:
        torch.ops.hookplug.tensor_stats(x, *args)
    except ValueError as e:
        print('raised:', e)"
    if [ "${GDB:-0}" = 1 ] && command -v cuda-gdb >/dev/null; then  # a native backtrace on a crash
      run gdb timeout 150 cuda-gdb -q -batch -ex "set pagination off" -ex run -ex bt --args "$PY" -c "$probe"
    else
      run error_messages timeout 60 "$PY" -c "$probe"
    fi
    xdist=(); "$PY" -c "import xdist" 2>/dev/null && xdist=(-n 8 --dist loadfile)
    tmo=(); "$PY" -c "import pytest_timeout" 2>/dev/null && tmo=(-p timeout --timeout 100)
    run tests timeout 360 "$PY" -m pytest -v -p no:cacheprovider -rfEs --durations 15 \
      "${tmo[@]}" "${xdist[@]}" ${PYTEST_ARGS:-} ${PYTEST_PATHS:-tests}
    if [ "${SANITIZER:-1}" = 1 ]; then
      run sanitizer timeout 150 env HOOKPLUG_TEST_SANITIZER=1 "$PY" -m pytest -q -p no:cacheprovider \
        tests/test_ops_cuda.py -k sanitizer -rA
    fi ;;&
  bench|all)
    { ls -l hookplug/_C*.so; readelf -d hookplug/_C*.so | grep NEEDED
      "$PY" -c "import sysconfig as s; print({k: s.get_config_var(k) for k in ('CC', 'CXX', 'LDSHARED', 'LDFLAGS', 'LDCXXSHARED')})"
      env | grep -iE "flags|^CC=|^CXX=|^LD" ; grep -E "(-shared|static-lib)" "$out/build.log" | cut -c1-3000
      grep -h -E "^(cflags|post_cflags|cuda_cflags|ldflags)" build/temp*/build.ninja 2>/dev/null
      echo "defined libstdc++ symbols in _C: $(nm -C --defined-only hookplug/_C*.so 2>/dev/null | grep -c 'std::locale::')"
    } >"$out/link.txt" 2>&1
    run bench_stats timeout 100 "$PY" benchmarks/bench_stats.py --device cuda --sizes 1 16 64 256 1024 \
      --dtypes float32 bfloat16 float16 --repeat 20
    run bench_training timeout 200 "$PY" benchmarks/bench_training.py --device cuda --rounds 3 --steps 12
    [ "${TELEMETRY:-1}" = 1 ] && run bench_telemetry timeout 80 "$PY" benchmarks/bench_telemetry.py --device cuda --rounds 3 --steps 200
    run bench_compiled timeout 200 "$PY" benchmarks/bench_training.py --device cuda --rounds 3 --steps 15 \
      --models "" --compile gpt2
    run profile_step timeout 150 "$PY" benchmarks/profile_step.py --device cuda --model gpt2 ;;
  profile)
    run profile_gpt2 timeout 200 "$PY" benchmarks/profile_step.py --device cuda --model gpt2
    run profile_resnet50 timeout 200 "$PY" benchmarks/profile_step.py --device cuda --model resnet50 ;;
  *) ;;
esac
echo "== summary"
printf '%s\n' "${summary[@]}"
