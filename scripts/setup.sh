#!/usr/bin/env bash
# Set up a virtual environment with torch and hookplug (building hookplug._C with ninja
# against that torch, without build isolation). `--test` adds the test extras and the
# example third-party plugin. Env: HOOKPLUG_VENV (default .venv), HOOKPLUG_TORCH (default
# torch==2.13.0: the CPU wheel on disk; one or more exact pip specs, e.g.
# "torch==2.14.1 torchvision==0.29.1"; never a bare `torch`, which pulls a CUDA build).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${HOOKPLUG_VENV:-.venv}"
read -r -a TORCH_SPECS <<< "${HOOKPLUG_TORCH:-torch==2.13.0}"
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-cache-dir)
"${PIP[@]}" "${TORCH_SPECS[@]}"
# What the build needs besides torch (pyproject's [build-system] leaves torch out on purpose).
"${PIP[@]}" "setuptools>=77" wheel ninja
EXTRAS=""
[ "${1:-}" = "--test" ] && EXTRAS="[test]"
# torch is already installed, so the `torch>=` requirement pulls nothing more.
"${PIP[@]}" --no-build-isolation -e ".${EXTRAS}"
if [ "${1:-}" = "--test" ]; then
  "${PIP[@]}" --no-build-isolation --no-deps -e examples/thirdparty_plugin
fi
"$VENV/bin/python" - <<'EOF'
import torch, hookplug
from hookplug import _build_info as b
print(f"torch {torch.__version__} | hookplug ops backend: {hookplug.ops.backend()} | built for torch "
      f"{b.TORCH_VERSION}, CUDA kernels: {'yes' if b.WITH_CUDA else 'no'} ({b.CUDA_WHY})")
EOF
