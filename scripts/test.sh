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
exec "${HOOKPLUG_VENV:-.venv}/bin/python" -m pytest -q -p no:cacheprovider "$@"
