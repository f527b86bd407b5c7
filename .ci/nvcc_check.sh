#!/usr/bin/env bash
# Compiles every csrc/cuda/*.cu (and the standalone benchmarks/cuda/*.cu) with plain nvcc (no torch) for sm_80 and sm_90, so a CUDA
# syntax or type error fails CI even on machines without a GPU or a CUDA build of torch.
# Usage: .ci/nvcc_check.sh   (NVCC=/path/to/nvcc to choose the compiler)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
NVCC="${NVCC:-nvcc}"
if ! command -v "$NVCC" >/dev/null 2>&1; then
  echo "nvcc_check: '$NVCC' not found (set NVCC or put nvcc on PATH)" >&2
  exit 2
fi
OUT="$(mktemp -d)"
trap 'rm -rf "$OUT"' EXIT
shopt -s nullglob
files=("$ROOT"/csrc/cuda/*.cu "$ROOT"/benchmarks/cuda/*.cu)
if [ ${#files[@]} -eq 0 ]; then
  echo "nvcc_check: no csrc/cuda/*.cu files" >&2
  exit 1
fi
"$NVCC" --version | tail -n 1
status=0
for f in "${files[@]}"; do
  name="$(basename "$f" .cu)"
  echo "nvcc_check: $f"
  if ! "$NVCC" -c -std=c++17 \
      -gencode arch=compute_80,code=sm_80 -gencode arch=compute_90,code=sm_90 \
      -Xcompiler -Wall -I "$ROOT/csrc" \
      -o "$OUT/$name.o" "$f"; then
    echo "nvcc_check: FAILED $f" >&2
    status=1
  fi
done
[ $status -eq 0 ] && echo "nvcc_check: all ${#files[@]} file(s) compiled"
exit $status
