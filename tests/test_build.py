"""Building and loading hookplug._C (hookplug/_loader.py, setup.py, pyproject.toml).

The end-to-end routes (a wheel in a fresh venv, the JIT rebuild from a wheel, an isolated
``pip install .``) are checked by .ci/wheel_check.sh; these tests pin the decisions."""
import ast
import logging
import os
import re
import subprocess
import sys

import pytest
import torch
from torch.utils import cpp_extension

import hookplug
from hookplug import _loader, ops

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PKG = os.path.dirname(os.path.abspath(hookplug.__file__))
REQUIRE_EXT = os.environ.get("HOOKPLUG_REQUIRE_EXT", "0") == "1"
IN_CHECKOUT = os.path.isfile(os.path.join(ROOT, "setup.py"))
needs_checkout = pytest.mark.skipif(not IN_CHECKOUT, reason="needs the source checkout")


def _toml(path):
    import tomllib

    with open(path, "rb") as f:
        return tomllib.load(f)


# -- compiler flags --------------------------------------------------------------------------

@needs_checkout
def test_no_hard_coded_cxx_standard():
    flags = _loader.cxx_flags() + _loader.nvcc_flags()
    assert not [f for f in flags if f.startswith("-std")], f"flags fix a C++ standard: {flags}"
    for rel in ("setup.py", "hookplug/_loader.py", "hookplug/ops.py"):
        with open(os.path.join(ROOT, rel)) as f:
            hits = re.findall(r"-std=c\+\+\d+", f.read())
        assert not hits, f"{rel} hard-codes {hits}: torch's cpp_extension must choose the standard"


def test_release_flags_strip_and_debug_build_keeps_symbols(monkeypatch):
    monkeypatch.delenv("HOOKPLUG_DEBUG_BUILD", raising=False)
    if sys.platform.startswith("linux"):
        assert "-Wl,--strip-all" in _loader.ld_flags(), _loader.ld_flags()
        assert "-g0" in _loader.cxx_flags(), _loader.cxx_flags()
    monkeypatch.setenv("HOOKPLUG_DEBUG_BUILD", "1")
    assert "-Wl,--strip-all" not in _loader.ld_flags()
    assert "-g0" not in _loader.cxx_flags()


def test_built_extension_is_stripped():
    if ops.backend() != "compiled":
        pytest.skip(f"backend is {ops.backend()!r}, not the prebuilt extension")
    path = sys.modules["hookplug._C"].__file__
    with open(path, "rb") as f:
        data = f.read()
    info = sys.modules.get("hookplug._build_info")
    assert b".debug_info" not in data, (
        f"{path} ({len(data)} bytes) has debug info; built with HOOKPLUG_DEBUG_BUILD=1? "
        f"(build info: {getattr(info, '__dict__', {}).get('TORCH_VERSION')})")


# -- sources ---------------------------------------------------------------------------------

def test_sources_are_globbed(tmp_path):
    for rel in ("b.cpp", "a.cpp", "x.h", "cuda/k.cu", "cuda/bind.cpp", "cuda/k.h"):
        (tmp_path / rel).parent.mkdir(exist_ok=True)
        (tmp_path / rel).write_text("")
    names = lambda files: [os.path.relpath(f, tmp_path) for f in files]  # noqa: E731
    assert names(_loader.sources(str(tmp_path), False)) == ["a.cpp", "b.cpp"]
    assert names(_loader.sources(str(tmp_path), True)) == [
        "a.cpp", "b.cpp", os.path.join("cuda", "bind.cpp"), os.path.join("cuda", "k.cu")]
    (tmp_path / "c.cpp").write_text("")
    assert "c.cpp" in names(_loader.sources(str(tmp_path), False)), "a new .cpp must join the build"


def test_csrc_dir_has_the_sources():
    src = _loader.csrc_dir()
    assert src is not None, f"no C++ sources beside {PKG} (hookplug/csrc) nor in the checkout"
    assert _loader.sources(src, False), f"{src} has no *.cpp"
    expected = os.path.join(ROOT, "csrc") if PKG == os.path.join(ROOT, "hookplug") else os.path.join(PKG, "csrc")
    assert src == expected, f"csrc_dir() is {src}, expected {expected}"


# -- CUDA: whether, and for which architectures ----------------------------------------------

@pytest.fixture
def cuda_torch(monkeypatch, tmp_path):
    """A CUDA 13.0 torch whose CUDA_HOME is tmp_path/cuda (empty: add headers and nvcc)."""
    home = tmp_path / "cuda"
    (home / "include").mkdir(parents=True)
    (home / "bin").mkdir()
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", str(home))
    for name in ("HOOKPLUG_NO_CUDA", "HOOKPLUG_FORCE_CUDA", "CPATH"):
        monkeypatch.delenv(name, raising=False)
    return home


def _toolkit(home, headers=_loader._CUDA_HEADERS, release="13.0"):
    for h in headers:
        (home / "include" / h).write_text("")
    nvcc = home / "bin" / "nvcc"
    nvcc.write_text(f"#!/bin/sh\necho 'Cuda compilation tools, release {release}, V{release}.1'\n")
    nvcc.chmod(0o755)


def test_cuda_plan_cpu_torch(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.delenv("HOOKPLUG_NO_CUDA", raising=False)
    assert _loader.cuda_plan() == (False, f"torch {torch.__version__} has no CUDA")


def test_cuda_plan_complete_toolkit(cuda_torch):
    _toolkit(cuda_torch)
    with_cuda, why = _loader.cuda_plan()
    assert with_cuda, why
    assert str(cuda_torch) in why


def test_cuda_plan_skips_an_incomplete_toolkit(cuda_torch):
    _toolkit(cuda_torch, headers=["cuda_runtime_api.h"])  # compiler + runtime only
    with_cuda, why = _loader.cuda_plan()
    assert not with_cuda
    assert "cublas_v2.h" in why and "cusparse.h" in why and str(cuda_torch) in why, why
    assert "HOOKPLUG_FORCE_CUDA=1" in why, why


def test_cuda_plan_skips_a_mismatched_nvcc(cuda_torch):
    _toolkit(cuda_torch, release="12.8")
    with_cuda, why = _loader.cuda_plan()
    assert not with_cuda
    assert "nvcc 12.8" in why and "CUDA 13.0" in why, why


def test_cuda_plan_env_overrides(cuda_torch, monkeypatch):
    _toolkit(cuda_torch)
    monkeypatch.setenv("HOOKPLUG_NO_CUDA", "1")
    assert _loader.cuda_plan() == (False, "HOOKPLUG_NO_CUDA=1")
    monkeypatch.delenv("HOOKPLUG_NO_CUDA")
    (cuda_torch / "include" / "cublas_v2.h").unlink()
    monkeypatch.setenv("HOOKPLUG_FORCE_CUDA", "1")
    assert _loader.cuda_plan()[0] is True


def test_cuda_plan_without_cuda_home(cuda_torch, monkeypatch):
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", None)
    assert _loader.cuda_plan() == (False, "CUDA_HOME is not set and no nvcc was found")


def test_default_arch_list_without_a_gpu(monkeypatch):
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with _loader.cuda_arch_env(True) as arch:
        assert arch == _loader.CUDA_ARCH_DEFAULT == "8.0;9.0+PTX"
        assert os.environ["TORCH_CUDA_ARCH_LIST"] == arch
        get_flags = getattr(cpp_extension, "_get_cuda_arch_flags", None)
        if get_flags is not None:  # torch's own parser accepts it (it raised IndexError before)
            flags = get_flags()
            for want in ("arch=compute_80,code=sm_80", "arch=compute_90,code=sm_90",
                         "arch=compute_90,code=compute_90"):
                assert any(want in f for f in flags), f"{want} not in torch's flags {flags}"
    assert "TORCH_CUDA_ARCH_LIST" not in os.environ, "the default must not outlive the build"
    with _loader.cuda_arch_env(False) as arch:
        assert arch is None and "TORCH_CUDA_ARCH_LIST" not in os.environ


def test_arch_list_left_to_the_user_or_the_gpu(monkeypatch):
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with _loader.cuda_arch_env(True) as arch:
        assert arch == "9.0" and os.environ["TORCH_CUDA_ARCH_LIST"] == "9.0"
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with _loader.cuda_arch_env(True) as arch:
        assert arch is None and "TORCH_CUDA_ARCH_LIST" not in os.environ


# -- the torch a build is for ----------------------------------------------------------------

def test_build_info_names_the_running_torch():
    if ops.backend() != "compiled":
        pytest.skip(f"backend is {ops.backend()!r}, not the prebuilt extension")
    built = _loader.built_for()
    if REQUIRE_EXT:
        assert built is not None, f"no hookplug/_build_info.py beside {PKG} (setup.py writes it)"
    assert built in (None, torch.__version__), f"_C built for torch {built}, loaded by {torch.__version__}"


def test_build_info_source_roundtrip():
    text = _loader.build_info_source(False, "HOOKPLUG_NO_CUDA=1", None)
    ns = {}
    exec(compile(text, "_build_info.py", "exec"), ns)  # noqa: S102 - our own generated text
    assert ns["TORCH_VERSION"] == torch.__version__
    assert ns["WITH_CUDA"] is False and ns["CUDA_ARCH_LIST"] is None
    assert ns["CUDA_WHY"] == "HOOKPLUG_NO_CUDA=1"
    assert ns["OPS_VERSION"] == _loader.OPS_VERSION


def test_a_build_from_older_sources_is_rebuilt_not_imported(monkeypatch):
    """A ``_C`` built for this torch from sources whose op schemas are older (a checkout
    pulled and not rebuilt: its ``stats_accumulate_`` lacks ``skip_recompute``, and every
    compiled call would fail) is rebuilt with the JIT, not imported."""
    monkeypatch.setattr(_loader, "built_ops_version", lambda: _loader.OPS_VERSION - 1)
    monkeypatch.setattr(_loader, "_stale_logged", type(_loader._stale_logged)())
    sentinel = object()
    assert _loader.load(allow_jit=False) == (None, None)
    assert _loader.load(allow_jit=True, build=lambda: sentinel) == (sentinel, "jit")
    if ops.backend() == "compiled" and _loader.built_for() is not None:  # the real build: current
        monkeypatch.undo()
        assert _loader.built_ops_version() == _loader.OPS_VERSION


@pytest.fixture
def other_torch_build(monkeypatch):
    """hookplug._C claims to be built for torch 0.0.0; the loader's one-time log is reset."""
    monkeypatch.setattr(_loader, "built_for", lambda: "0.0.0")
    monkeypatch.setattr(_loader, "_stale_logged", type(_loader._stale_logged)())
    monkeypatch.setattr(_loader, "_jit_built", lambda: False)  # (no JIT build made before)


def test_stale_build_is_rebuilt_not_imported(other_torch_build, caplog):
    sentinel = object()
    with caplog.at_level(logging.WARNING, logger="hookplug.build"):
        assert _loader.load(allow_jit=False) == (None, None)
        mod, kind = _loader.load(allow_jit=True, build=lambda: sentinel)
    assert (mod, kind) == (sentinel, "jit"), f"got kind {kind!r}: a stale _C must not be imported"
    lines = [r.getMessage() for r in caplog.records if r.name == "hookplug.build"]
    assert len(lines) == 1, f"expected one log line about the stale build, got {lines}"
    assert "0.0.0" in lines[0] and torch.__version__ in lines[0] and "\n" not in lines[0], lines[0]


def test_stale_build_with_a_jit_build_made_before_logs_at_info(other_torch_build, caplog, monkeypatch):
    """Every process meeting a stale ``_C`` warned that it rebuilds "once", also when it only
    loads the JIT build an earlier process made: that is INFO now."""
    sentinel = object()
    monkeypatch.setattr(_loader, "_jit_built", lambda: True)
    with caplog.at_level(logging.INFO, logger="hookplug.build"):
        assert _loader.load(allow_jit=True, build=lambda: sentinel) == (sentinel, "jit")
    records = [r for r in caplog.records if r.name == "hookplug.build"]
    assert [r.levelno for r in records] == [logging.INFO]
    assert "made before" in records[0].getMessage()


def test_stale_build_that_cannot_rebuild_fails_in_one_line(other_torch_build, monkeypatch):
    def no_build():
        raise _loader.BuildError("RuntimeError: Ninja is required to load C++ extensions")

    monkeypatch.setenv("HOOKPLUG_REQUIRE_EXT", "1")
    with pytest.raises(ImportError) as exc:
        _loader.load(build=no_build)
    msg = str(exc.value)
    assert "\n" not in msg and len(msg) < 600, msg
    for want in ("0.0.0", torch.__version__, "--no-build-isolation", "Ninja is required"):
        assert want in msg, f"{want!r} not in {msg!r}"
    monkeypatch.setenv("HOOKPLUG_REQUIRE_EXT", "0")
    with pytest.warns(RuntimeWarning, match="pure-torch reference") as rec:
        assert _loader.load(build=no_build) == (None, "reference")
    assert len(rec) == 1 and "0.0.0" in str(rec[0].message)


def test_jit_failure_output_goes_to_logging(monkeypatch, tmp_path, caplog):
    if _loader.csrc_dir() is None:
        pytest.skip("no C++ sources installed")
    output = ("[1/3] c++ -MMD -c stats_op.cpp ...\nFAILED: stats_op.o\n" + "x" * 47000 + "\n"
              "torch/include/c10/util/C++17.h:13:2: error: #error C++20 or later compatible "
              "compiler is required to use ATen.\nninja: build stopped: subcommand failed.\n")

    def failing_load(**kwargs):
        assert not any(f.startswith("-std") for f in kwargs["extra_cflags"]), kwargs["extra_cflags"]
        raise RuntimeError("Error building extension 'hookplug_C': " + output)

    monkeypatch.setattr(cpp_extension, "load", failing_load)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setenv("HOOKPLUG_NO_CUDA", "1")
    monkeypatch.delenv("HOOKPLUG_VERBOSE", raising=False)
    with caplog.at_level(logging.DEBUG, logger="hookplug.build"):
        with pytest.raises(_loader.BuildError) as exc:
            _loader.jit_build()
    msg = str(exc.value)
    assert "\n" not in msg and len(msg) < 600, f"{len(msg)} characters: {msg[:200]!r}..."
    assert "C++20 or later compatible compiler is required" in msg, msg
    logged = [r for r in caplog.records if r.name == "hookplug.build" and r.levelno == logging.DEBUG]
    assert any(output in r.getMessage() for r in logged), "the full compiler output is not logged"
    assert os.listdir(tmp_path) == [f"hookplug_py{sys.version_info[0]}{sys.version_info[1]}"
                                    f"_torch{torch.__version__}"], os.listdir(tmp_path)


# -- setup.py and packaging ------------------------------------------------------------------

@needs_checkout
def test_setup_without_torch_stops_at_once_with_the_fix():
    code = ("import sys, runpy; sys.modules['torch'] = None; sys.argv = ['setup.py', '--version'];"
            "runpy.run_path('setup.py', run_name='__main__')")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode != 0, f"setup.py without torch exited 0: {proc.stdout}"
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert lines and "--no-build-isolation" in lines[-1], proc.stderr


@needs_checkout
def test_pyproject_packaging():
    meta = _toml(os.path.join(ROOT, "pyproject.toml"))
    project = meta["project"]
    assert project["license"] == "MIT" and project["license-files"] == ["LICENSE"], project["license"]
    with open(os.path.join(ROOT, "LICENSE")) as f:
        assert f.readline().strip() == "MIT License"
    assert os.path.isfile(os.path.join(ROOT, "hookplug", "py.typed"))
    assert "torch" not in " ".join(meta["build-system"]["requires"]), (
        "torch in build-system.requires makes an isolated build fetch another torch")
    deps = {re.split(r"[<>=!;\s\[]", d)[0]: d for d in project["dependencies"]}
    assert set(deps) == {"torch", "pluggy", "tomli"}, f"runtime dependencies {sorted(deps)}"
    assert "python_version < '3.11'" in deps["tomli"], deps["tomli"]
    assert project["requires-python"] == ">=3.10", project["requires-python"]


@needs_checkout
def test_module_level_imports_are_runtime_dependencies():
    """Only torch and pluggy (and the stdlib) at module level; optional libraries lazily."""
    allowed = set(sys.stdlib_module_names) | {"torch", "pluggy", "hookplug", "hookplug_plugins"}
    bad = []
    for folder in ("hookplug", "plugins"):
        for dirpath, _, files in os.walk(os.path.join(ROOT, folder)):
            for name in files:
                if not name.endswith(".py"):
                    continue
                path = os.path.join(dirpath, name)
                with open(path) as f:
                    tree = ast.parse(f.read(), path)
                for node in tree.body:
                    if isinstance(node, ast.Import):
                        mods = [a.name for a in node.names]
                    elif isinstance(node, ast.ImportFrom) and node.level == 0:
                        mods = [node.module]
                    else:
                        continue
                    bad += [f"{os.path.relpath(path, ROOT)}: {m}" for m in mods
                            if m.split(".")[0] not in allowed]
    assert not bad, f"module-level imports outside the runtime dependencies: {bad}"


@needs_checkout
def test_every_package_is_listed_for_the_wheel():
    """A package missing from [tool.setuptools] packages imports in a checkout but not from a wheel."""
    meta = _toml(os.path.join(ROOT, "pyproject.toml"))["tool"]["setuptools"]
    dirs = {name: os.path.join(ROOT, path) for name, path in meta["package-dir"].items()}
    found = set()
    for top in ("hookplug", "hookplug_plugins"):
        base = dirs.get(top, os.path.join(ROOT, top))
        for dirpath, _, files in os.walk(base):
            if "__init__.py" in files and "__pycache__" not in dirpath:
                rel = os.path.relpath(dirpath, base)
                found.add(top if rel == "." else f"{top}.{rel.replace(os.sep, '.')}")
    missing = sorted(found - set(meta["packages"]))
    assert not missing, f"packages with an __init__.py missing from pyproject's packages: {missing}"


def test_a_statically_linked_libstdcxx_is_refused(monkeypatch):
    """A toolchain that links its own libstdc++ into _C (no libstdc++.so, e.g. /opt/gcc in a
    CUDA image) gives a binary that crashes beside torch's libstdc++: the build says so."""
    import subprocess
    import sys

    from hookplug import _loader

    if not sys.platform.startswith("linux"):
        pytest.skip("ELF only")

    def readelf(needed):
        text = "".join(f" 0x1 (NEEDED) Shared library: [{n}]\n" for n in needed)
        return lambda *a, **k: subprocess.CompletedProcess(a, 0, stdout=text, stderr="")

    monkeypatch.setenv("CXX", "/opt/gcc/bin/g++")
    monkeypatch.setattr(subprocess, "run", readelf(["libc10.so", "libgcc_s.so.1", "libc.so.6"]))
    problem = _loader.static_libstdcxx_problem("_C.so")
    assert problem and "/opt/gcc/bin/g++ linked libstdc++ statically" in problem and "CXX=" in problem
    monkeypatch.setattr(subprocess, "run", readelf(["libc10.so", "libstdc++.so.6", "libc.so.6"]))
    assert _loader.static_libstdcxx_problem("_C.so") is None
