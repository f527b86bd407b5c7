#!/usr/bin/env bash
# Set everything up, compile-check the CUDA kernels with plain nvcc (when nvcc exists),
# then run the test suite against the compiled extension (no silent fallback).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh --test
if command -v nvcc >/dev/null 2>&1; then
  ./.ci/nvcc_check.sh
elif [ "${HOOKPLUG_REQUIRE_NVCC:-0}" = "1" ]; then
  echo "nvcc not found but HOOKPLUG_REQUIRE_NVCC=1" >&2; exit 1
fi
export HOOKPLUG_REQUIRE_EXT=1
# torch.compile's caches live inside the venv, so repeated runs don't fill the shared /tmp
# (a full disk failed a CI run; the default /tmp/torchinductor_$USER had grown to 5 GB).
VENV_DIR="$(cd "${HOOKPLUG_VENV:-.venv}" && pwd)"
export TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-$VENV_DIR/.cache/torchinductor}"
export TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-$VENV_DIR/.cache/triton}"
exec "${HOOKPLUG_VENV:-.venv}/bin/python" -m pytest -q -p no:cacheprovider "$@"
