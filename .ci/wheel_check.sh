#!/usr/bin/env bash
# The install routes a user takes, checked end to end:
#  1. a wheel built with --no-build-isolation from the venv BUILD_VENV (default .venv), its
#     contents (stripped _C, csrc/, _build_info, py.typed, LICENSE, runtime deps only);
#  2. that wheel installed into a fresh venv (same torch) and used from another directory;
#  3. the same install meeting another torch (its _build_info says so): the JIT rebuild from
#     the csrc/ shipped in the wheel;
#  4. `pip install .` with build isolation fails within seconds, saying --no-build-isolation.
# Usage: .ci/wheel_check.sh [BUILD_VENV]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
BUILD_VENV="${1:-.venv}"
WHEEL_VENV="${HOOKPLUG_WHEEL_VENV:-.venv-wheel}"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
PY="$BUILD_VENV/bin/python"
TORCH_SPEC="torch==$("$PY" -c 'import torch; print(torch.__version__.split("+")[0])')"
step() { echo "wheel_check: $*"; }

step "1. building the wheel with $BUILD_VENV ($TORCH_SPEC)"
t0=$SECONDS
"$PY" -m pip wheel -q --no-build-isolation --no-deps -w "$WORK/dist" . >"$WORK/build.log" 2>&1 \
  || { cat "$WORK/build.log"; exit 1; }
WHEEL="$(ls "$WORK"/dist/hookplug-*.whl)"
step "   built $(basename "$WHEEL") in $((SECONDS - t0)) s, $(du -k "$WHEEL" | cut -f1) KiB"
"$PY" - "$WHEEL" <<'PYEOF'
import re, sys, zipfile
z = zipfile.ZipFile(sys.argv[1])
names = z.namelist()
so = [n for n in names if re.fullmatch(r"hookplug/_C\..*\.so", n)]
assert len(so) == 1, f"wheel: expected one hookplug/_C*.so, found {so}"
size = z.getinfo(so[0]).file_size
data = z.read(so[0])
assert b".debug_info" not in data, f"wheel: {so[0]} ({size} bytes) still has debug info"
need = ["hookplug/py.typed", "hookplug/_build_info.py"]
missing = [n for n in need if n not in names]
assert not missing, f"wheel: missing {missing}"
assert any(n.startswith("hookplug/csrc/") and n.endswith(".cpp") for n in names), \
    "wheel: no hookplug/csrc/*.cpp (the JIT path needs the sources)"
assert any(n.startswith("hookplug/csrc/") and n.endswith(".h") for n in names), "wheel: no csrc headers"
assert any(re.search(r"\.dist-info/licenses/LICENSE$", n) for n in names), "wheel: no LICENSE"
meta = z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
assert "License-Expression: MIT" in meta, "wheel: METADATA has no 'License-Expression: MIT'"
reqs = sorted(re.findall(r"^Requires-Dist: ([A-Za-z0-9_.-]+)(.*)$", meta, re.M))
runtime = {name for name, rest in reqs if "extra ==" not in rest}
assert runtime == {"torch", "pluggy", "tomli"}, f"wheel: runtime requirements {runtime}, expected torch, pluggy, tomli (<3.11)"
info = z.read("hookplug/_build_info.py").decode()
print(f"wheel_check:    {so[0]}: {size} bytes stripped; {len([n for n in names if n.startswith('hookplug/csrc/')])} csrc files; "
      f"built for {re.search(r'TORCH_VERSION = (.*)', info).group(1)}")
PYEOF

step "2. fresh venv $WHEEL_VENV with $TORCH_SPEC and the wheel"
t0=$SECONDS
rm -rf "$WHEEL_VENV"
python3 -m venv "$WHEEL_VENV"
WPY="$ROOT/$WHEEL_VENV/bin/python"
"$WPY" -m pip install -q --disable-pip-version-check --no-cache-dir "$TORCH_SPEC" "$WHEEL" 2>&1 | grep -v "is ignored" || true
(cd "$WORK" && "$WPY" -W ignore -c "import hookplug") || { echo "wheel_check: the wheel did not install" >&2; exit 1; }
step "   installed in $((SECONDS - t0)) s"
cat >"$WORK/use.py" <<'PYEOF'
import os, sys, warnings
warnings.simplefilter("error", RuntimeWarning)  # no fallback warning allowed
import torch, hookplug
from hookplug import ops
where = os.path.dirname(hookplug.__file__)
assert "site-packages" in where, f"hookplug imported from {where}, expected the venv's site-packages"
want = sys.argv[1]
assert ops.backend() == want, f"backend() is {ops.backend()!r}, expected {want!r}"
model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(4 * 6 * 6, 2))
with hookplug.attach(model, "Conv2d|Linear", plugins=["stats"]) as s:
    model(torch.randn(2, 3, 8, 8)).sum().backward()
res = s["stats"].results()
assert set(res) == {"0", "3"}, f"stats results for {sorted(res)}, expected ['0', '3']"
x = torch.randn(1000, dtype=torch.float64)
got, ref = ops.tensor_stats(x), ops.reference_tensor_stats(x)
assert torch.equal(got.hist_counts, ref.hist_counts) and abs(float(got.mean) - float(ref.mean)) < 1e-12, \
    "compiled stats differ from the reference"
print(f"wheel_check:    ok from {os.getcwd()}: torch {torch.__version__}, backend {ops.backend()}, hookplug at {where}")
PYEOF
(cd "$WORK" && "$WPY" use.py compiled)

step "3. the installed wheel meeting another torch: JIT rebuild from the shipped csrc/"
t0=$SECONDS
INFO="$(cd "$WORK" && "$WPY" -W ignore -c 'import hookplug, os; print(os.path.join(os.path.dirname(hookplug.__file__), "_build_info.py"))')"
case "$INFO" in "$ROOT/$WHEEL_VENV"/*) ;; *) echo "wheel_check: hookplug resolved to $INFO, not the wheel venv" >&2; exit 1;; esac
cp "$INFO" "$WORK/_build_info.py.orig"
sed -i "s/^TORCH_VERSION = .*/TORCH_VERSION = '0.0.0'/" "$INFO"
"$WPY" -m pip install -q --disable-pip-version-check ninja 2>&1 | grep -v "is ignored" || true
(cd "$WORK" && TORCH_EXTENSIONS_DIR="$WORK/ext" "$WPY" use.py jit 2>"$WORK/jit.err") \
  || { cat "$WORK/jit.err"; exit 1; }
grep -q "built for torch 0.0.0" "$WORK/jit.err" \
  || { echo "wheel_check: no log line naming the stale build:"; cat "$WORK/jit.err"; exit 1; } >&2
step "   $(grep -m1 'built for torch 0.0.0' "$WORK/jit.err")"
step "   JIT rebuild + check in $((SECONDS - t0)) s"
cp "$WORK/_build_info.py.orig" "$INFO"

step "4. pip install . with build isolation stops at once with the fix"
t0=$SECONDS
if "$WPY" -m pip install --no-deps "$ROOT" >"$WORK/iso.log" 2>&1; then
  echo "wheel_check: an isolated build succeeded; it must stop and ask for --no-build-isolation" >&2; exit 1
fi
grep -q -- "--no-build-isolation" "$WORK/iso.log" \
  || { echo "wheel_check: the isolated build failed without naming --no-build-isolation:"; cat "$WORK/iso.log"; exit 1; } >&2
step "   failed in $((SECONDS - t0)) s with: $(grep -m1 -- 'error: hookplug' "$WORK/iso.log")"
step "all checks passed"
