#!/usr/bin/env bash
# Set up a virtual environment with the CPU build of torch and hookplug (building
# hookplug._C with ninja against that torch). `--test` adds the test extras and the
# example third-party plugin. Env: HOOKPLUG_VENV (default .venv), HOOKPLUG_TORCH
# (default torch==2.13.0: the CPU wheel on disk; never a bare `torch`, which pulls CUDA).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${HOOKPLUG_VENV:-.venv}"
TORCH_SPEC="${HOOKPLUG_TORCH:-torch==2.13.0}"
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
"${PIP[@]}" "$TORCH_SPEC"
"${PIP[@]}" setuptools wheel ninja pybind11 pluggy numpy
EXTRAS=""
[ "${1:-}" = "--test" ] && EXTRAS="[test]"
# torch is already installed, so the `torch>=2.4` requirement pulls nothing more.
"${PIP[@]}" --no-build-isolation -e ".${EXTRAS}"
if [ "${1:-}" = "--test" ]; then
  "${PIP[@]}" --no-build-isolation --no-deps -e examples/thirdparty_plugin
fi
"$VENV/bin/python" -c "import torch, hookplug; print('torch', torch.__version__, '| hookplug ops backend:', hookplug.ops.backend())"
