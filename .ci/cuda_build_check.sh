#!/usr/bin/env bash
# The CUDA binding built where torch has CUDA but no GPU is visible (a CI runner, a Docker
# build stage): with TORCH_CUDA_ARCH_LIST unset the build must use hookplug's default list
# (8.0;9.0+PTX) instead of crashing in torch, and load. This machine's toolkit has nvcc and
# the CUDA runtime only; the cuBLAS/cuSPARSE headers that torch's CUDA binding includes come
# from the CUDA wheels the torch wheel installs (site-packages/nvidia/*/include), via CPATH.
# Usage: .ci/cuda_build_check.sh [VENV]   (VENV has a CUDA build of torch; default .venv-2.14)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="$ROOT/${1:-.venv-2.14}/bin/python"
export CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"
[ -x "$CUDA_HOME/bin/nvcc" ] || { echo "cuda_build_check: no nvcc in $CUDA_HOME/bin (set CUDA_HOME)" >&2; exit 1; }
SITE="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
INC="$(dirname "$(ls "$SITE"/nvidia/*/include/cublas_v2.h | head -n 1)")" \
  || { echo "cuda_build_check: no cublas_v2.h under $SITE/nvidia (not a CUDA build of torch?)" >&2; exit 1; }
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
unset TORCH_CUDA_ARCH_LIST HOOKPLUG_NO_CUDA HOOKPLUG_FORCE_CUDA
cd "$WORK"
CPATH="$INC${CPATH:+:$CPATH}" TORCH_EXTENSIONS_DIR="$WORK/ext" "$PY" - <<'PYEOF'
import logging, os, sys, time
import torch
logging.basicConfig(level=logging.INFO, format="cuda_build_check: %(message)s", stream=sys.stdout)
from hookplug import _loader
assert torch.version.cuda is not None, f"torch {torch.__version__} has no CUDA"
assert torch.cuda.device_count() == 0, "a GPU is visible: this check is for GPU-less machines"
with_cuda, why = _loader.cuda_plan()
assert with_cuda, f"cuda_plan() says no CUDA binding: {why}"
t0 = time.time()
mod = _loader.jit_build()
assert mod.has_cuda(), "the extension was built without its CUDA kernels"
with open(os.path.join(os.path.dirname(mod.__file__), "build.ninja")) as f:
    ninja = f.read()
for want in ("arch=compute_80,code=sm_80", "arch=compute_90,code=sm_90", "arch=compute_90,code=compute_90"):
    assert want in ninja, f"{want} missing from the nvcc flags"
print(f"cuda_build_check: ok: torch {torch.__version__}, CUDA binding built for {_loader.CUDA_ARCH_DEFAULT} "
      f"in {time.time() - t0:.0f} s, {os.path.getsize(mod.__file__)} bytes, has_cuda() True")
PYEOF
