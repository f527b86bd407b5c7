"""Finding, building and loading ``hookplug._C``, the compiled stats op.

The one place for what ``setup.py`` and the JIT path share: where the C++ sources are,
the compiler flags, whether the CUDA binding builds and for which GPU architectures, and
which torch a build is for. ``setup.py`` loads this file by path (it imports only the
standard library at module level, torch lazily).

At run time, :func:`load` tries, in order:

1. the prebuilt ``hookplug._C``, when ``hookplug/_build_info.py`` (written next to it by
   ``setup.py``) says it was built for the running torch;
2. a JIT build of the shipped sources (``hookplug/csrc`` in a wheel or sdist install,
   ``csrc/`` in a checkout) with ``torch.utils.cpp_extension.load`` into the torch
   extensions cache, one directory per Python and torch version;
3. the pure-torch reference, with one warning (an ``ImportError`` under
   ``HOOKPLUG_REQUIRE_EXT=1``).

Compiler output goes to the ``hookplug.build`` logger (DEBUG; WARNING with
``HOOKPLUG_VERBOSE=1``), never into a warning or exception message.

Environment: ``HOOKPLUG_NO_CUDA=1`` builds the CPU kernels only; ``HOOKPLUG_FORCE_CUDA=1``
builds the CUDA binding without checking the toolkit; ``TORCH_CUDA_ARCH_LIST`` as in torch
(default :data:`CUDA_ARCH_DEFAULT` when no GPU is visible); ``HOOKPLUG_DEBUG_BUILD=1``
keeps debug info in the ``.so``.
"""
from __future__ import annotations

import contextlib
import glob
import importlib
import logging
import os
import re
import subprocess
import sys
import threading
import warnings
from typing import Any, Callable, Iterator, List, Optional, Tuple

__all__ = ["CUDA_ARCH_DEFAULT", "OPS_VERSION", "BuildError", "csrc_dir", "sources", "cxx_flags",
           "nvcc_flags", "ld_flags", "cuda_plan", "cuda_arch_env", "build_info_source", "built_for",
           "built_ops_version", "jit_build",
           "load"]

_log = logging.getLogger("hookplug.build")

#: GPU architectures built when torch has CUDA, no GPU is visible (a CI runner, a Docker
#: build stage) and ``TORCH_CUDA_ARCH_LIST`` is unset: A100, H100, and PTX for newer GPUs.
CUDA_ARCH_DEFAULT = "8.0;9.0+PTX"

#: Headers the torch CUDA binding includes (through ATen/cuda/CUDAContext.h) beyond the
#: CUDA runtime: a toolkit without them (compiler + runtime only) cannot build it.
_CUDA_HEADERS = ("cuda_runtime_api.h", "cublas_v2.h", "cusparse.h")

_PKG_DIR = os.path.dirname(os.path.abspath(__file__))
_FIX = ("reinstall hookplug against this torch: "
        "pip install --no-build-isolation --no-deps --force-reinstall <hookplug checkout or sdist>")


class BuildError(RuntimeError):
    """The extension could not be built; the message is one line, the compiler output is
    on the ``hookplug.build`` logger."""


def _flag(name: str) -> bool:
    return os.environ.get(name, "0") == "1"


# -- sources and flags -----------------------------------------------------------------------

def _has_cpp(path: str) -> bool:
    return bool(glob.glob(os.path.join(path, "*.cpp")))


def csrc_dir() -> Optional[str]:
    """The C++ sources: ``hookplug/csrc`` in an installed wheel or sdist, ``<checkout>/csrc``
    in a source tree (an editable install); None when neither is there."""
    shipped = os.path.join(_PKG_DIR, "csrc")
    if _has_cpp(shipped):
        return shipped
    root = os.path.dirname(_PKG_DIR)
    checkout = os.path.join(root, "csrc")
    if _has_cpp(checkout) and os.path.isfile(os.path.join(root, "setup.py")):
        return checkout
    return None


def sources(src: str, with_cuda: bool) -> List[str]:
    """Every ``*.cpp`` under ``src``, plus ``cuda/*.cpp`` and ``cuda/*.cu`` with CUDA (globbed:
    new files join the build without a change here)."""
    found = sorted(glob.glob(os.path.join(src, "*.cpp")))
    if with_cuda:
        found += sorted(glob.glob(os.path.join(src, "cuda", "*.cpp")))
        found += sorted(glob.glob(os.path.join(src, "cuda", "*.cu")))
    return found


def _openmp() -> List[str]:
    # at::parallel_for is inline OpenMP in torch's headers: without -fopenmp the CPU kernel
    # runs on one thread (Linux/GCC/Clang; the runtime is the libgomp torch already loaded).
    return ["-fopenmp"] if sys.platform.startswith("linux") else []


def _release() -> bool:
    return not _flag("HOOKPLUG_DEBUG_BUILD") and sys.platform.startswith("linux")


def cxx_flags() -> List[str]:
    """Host compiler flags. No ``-std=``: torch's cpp_extension adds the standard its own
    headers need (C++17 or C++20 depending on the torch version)."""
    return ["-O3"] + _openmp() + (["-g0"] if _release() else [])


def nvcc_flags() -> List[str]:
    """nvcc flags; the standard again comes from torch."""
    return ["-O3"]


def ld_flags() -> List[str]:
    """Linker flags: OpenMP, and a stripped ``.so`` unless ``HOOKPLUG_DEBUG_BUILD=1``."""
    return _openmp() + (["-Wl,--strip-all"] if _release() else [])


def static_libstdcxx_problem(so_path: str) -> Optional[str]:
    """Why the built ``_C`` must not be used, when the compiler linked its own copy of
    libstdc++ into it (a toolchain without ``libstdc++.so``, e.g. ``/opt/gcc`` in some CUDA
    images): a second libstdc++ beside torch's crashes in iostreams, i.e. in any error
    message with a number. None when fine or when ``readelf`` is not there to tell."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        out = subprocess.run(["readelf", "-d", so_path], capture_output=True, text=True,
                             timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    if "(NEEDED)" not in out or "libstdc++" in out or "libc++" in out:
        return None
    cxx = os.environ.get("CXX", "c++")
    return (f"{cxx} linked libstdc++ statically into {os.path.basename(so_path)} (it has no "
            "libstdc++.so); next to torch's libstdc++ that crashes. Build with a compiler that "
            "links it dynamically, e.g. CXX=/usr/bin/g++ CC=/usr/bin/gcc")


# -- CUDA ------------------------------------------------------------------------------------

def _cuda_include_dirs(cuda_home: str) -> List[str]:
    dirs = [os.path.join(cuda_home, "include"),
            os.path.join(cuda_home, "targets", "x86_64-linux", "include"),
            os.path.join(cuda_home, "targets", "sbsa-linux", "include")]
    dirs += [d for d in os.environ.get("CPATH", "").split(os.pathsep) if d]
    return dirs


def _nvcc_version(cuda_home: str) -> Optional[str]:
    nvcc = os.path.join(cuda_home, "bin", "nvcc")
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True,
                             timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"release (\d+)\.(\d+)", out)
    return f"{m.group(1)}.{m.group(2)}" if m else None


def _toolkit_problem(cuda_home: str, torch_cuda: str) -> Optional[str]:
    """Why the toolkit at ``cuda_home`` cannot build the torch CUDA binding, or None."""
    dirs = _cuda_include_dirs(cuda_home)
    missing = [h for h in _CUDA_HEADERS
               if not any(os.path.isfile(os.path.join(d, h)) for d in dirs)]
    if missing:
        what = ("no CUDA headers: set CUDA_HOME to the toolkit" if "cuda_runtime_api.h" in missing
                else "an incomplete toolkit, e.g. compiler and runtime only")
        return f"the CUDA toolkit at {cuda_home} lacks {', '.join(missing)} ({what})"
    nvcc = _nvcc_version(cuda_home)
    if nvcc is None:
        return f"no working nvcc in {os.path.join(cuda_home, 'bin')}"
    if nvcc.split(".")[0] != torch_cuda.split(".")[0]:
        return f"nvcc {nvcc} at {cuda_home} does not match torch's CUDA {torch_cuda}"
    return None


def cuda_plan() -> Tuple[bool, str]:
    """``(build the CUDA binding?, why)``. It builds when torch has CUDA and its
    ``CUDA_HOME`` (the variable, or found from nvcc) holds a complete toolkit; never decided
    by probing for a GPU."""
    import torch
    from torch.utils import cpp_extension

    if _flag("HOOKPLUG_NO_CUDA"):
        return False, "HOOKPLUG_NO_CUDA=1"
    if torch.version.cuda is None:
        return False, f"torch {torch.__version__} has no CUDA"
    cuda_home = cpp_extension.CUDA_HOME
    if cuda_home is None:
        return False, "CUDA_HOME is not set and no nvcc was found"
    if _flag("HOOKPLUG_FORCE_CUDA"):
        return True, f"HOOKPLUG_FORCE_CUDA=1, CUDA_HOME={cuda_home}"
    problem = _toolkit_problem(cuda_home, torch.version.cuda)
    if problem is not None:
        return False, problem + "; set HOOKPLUG_FORCE_CUDA=1 to build it anyway"
    return True, f"CUDA {torch.version.cuda} at {cuda_home}"


def _default_arch_list() -> Optional[str]:
    """:data:`CUDA_ARCH_DEFAULT` when ``TORCH_CUDA_ARCH_LIST`` is unset and no GPU is
    visible (torch would otherwise fail with an IndexError); None leaves the choice to torch."""
    if os.environ.get("TORCH_CUDA_ARCH_LIST"):
        return None
    import torch

    return CUDA_ARCH_DEFAULT if torch.cuda.device_count() == 0 else None


@contextlib.contextmanager
def cuda_arch_env(with_cuda: bool) -> Iterator[Optional[str]]:
    """Sets ``TORCH_CUDA_ARCH_LIST`` to the default for the duration of a CUDA build where
    needed (see :func:`_default_arch_list`); yields the list built for (None: torch chose)."""
    arch = _default_arch_list() if with_cuda else None
    if arch is None:
        yield os.environ.get("TORCH_CUDA_ARCH_LIST") if with_cuda else None
        return
    _log.info("no GPU visible and TORCH_CUDA_ARCH_LIST unset: building the CUDA kernels for %s",
              arch)
    os.environ["TORCH_CUDA_ARCH_LIST"] = arch
    try:
        yield arch
    finally:
        os.environ.pop("TORCH_CUDA_ARCH_LIST", None)


# -- which torch a build is for --------------------------------------------------------------

def build_info_source(with_cuda: bool, cuda_why: str, cuda_arch: Optional[str]) -> str:
    """The text of ``hookplug/_build_info.py``, written by setup.py next to ``_C``."""
    import torch

    return (
        '"""Written by setup.py when it built hookplug._C: the torch it was built against."""\n'
        f"TORCH_VERSION = {torch.__version__!r}\n"
        f"TORCH_CUDA = {torch.version.cuda!r}\n"
        f"WITH_CUDA = {bool(with_cuda)!r}\n"
        f"CUDA_WHY = {cuda_why!r}\n"
        f"CUDA_ARCH_LIST = {cuda_arch!r}\n"
        f"OPS_VERSION = {OPS_VERSION!r}\n"
    )


# The version of the op schemas and of what the Python side passes them: raised when they
# change, so a build from older sources (a checkout pulled and not rebuilt) is rebuilt, not
# imported (2: stats_accumulate_'s skip_recompute).
OPS_VERSION = 2


def built_for() -> Optional[str]:
    """The torch version the prebuilt ``hookplug._C`` was built for, or None if unknown."""
    info = _build_info()
    return None if info is None else getattr(info, "TORCH_VERSION", None)


def built_ops_version() -> Optional[int]:
    """The ``OPS_VERSION`` of the sources the prebuilt ``hookplug._C`` was built from (1:
    before it was written), or None if unknown."""
    info = _build_info()
    return None if info is None else getattr(info, "OPS_VERSION", 1)


def _build_info():
    try:
        return importlib.import_module("hookplug._build_info")
    except ImportError:
        return None


class _StaleBuild(ImportError):
    pass


def _import_prebuilt() -> Any:
    import torch

    built = built_for()
    if built is not None and built != torch.__version__:
        raise _StaleBuild(f"hookplug._C was built for torch {built} but torch "
                          f"{torch.__version__} is running")
    ops_version = built_ops_version()
    if ops_version is not None and ops_version != OPS_VERSION:
        raise _StaleBuild(f"hookplug._C was built from older sources (ops version {ops_version}, "
                          f"this hookplug needs {OPS_VERSION})")
    if built is None:
        _log.debug("hookplug/_build_info.py is missing: importing hookplug._C unchecked")
    return importlib.import_module("hookplug._C")


# -- the JIT build ---------------------------------------------------------------------------

def _first_error_line(text: str) -> str:
    """The compiler's first ``error:`` line (else the first line), cut to 300 characters."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for pattern in (r"(^|[\s:])(fatal )?error:|#error", r"\berror\b"):
        for ln in lines[1:] if len(lines) > 1 else lines:
            if re.search(pattern, ln, 0 if pattern.startswith("(") else re.IGNORECASE):
                return ln[:300]
    return (lines[0] if lines else "no output")[:300]


def _jit_build_dir() -> str:
    """``$TORCH_EXTENSIONS_DIR`` (else torch's default root)/hookplug_py311_torch<version>: a
    build per Python and torch version, so switching torch never reuses another's objects."""
    import torch
    from torch.utils import cpp_extension

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()
    tag = re.sub(r"[^A-Za-z0-9_.+-]", "_", f"py{sys.version_info[0]}{sys.version_info[1]}"
                 f"_torch{torch.__version__}")
    path = os.path.join(root, f"hookplug_{tag}")
    os.makedirs(path, exist_ok=True)
    return path


def _jit_built() -> bool:
    """Whether the JIT build directory of this torch already holds a built module (ninja
    then only checks it is up to date)."""
    try:
        return any(name.startswith("hookplug_C") and name.endswith((".so", ".pyd"))
                   for name in os.listdir(_jit_build_dir()))
    except OSError:
        return False


def jit_build() -> Any:
    """Build the sources for the running torch with ``torch.utils.cpp_extension.load``
    (ninja); returns the module. Raises :class:`BuildError` with a one-line message."""
    import torch
    from torch.utils import cpp_extension

    src = csrc_dir()
    if src is None:
        raise BuildError("the C++ sources are not installed beside hookplug "
                         f"(no {os.path.join(_PKG_DIR, 'csrc', '*.cpp')})")
    with_cuda, why = cuda_plan()
    cflags = cxx_flags() + (["-DHOOKPLUG_WITH_CUDA=1"] if with_cuda else [])
    build_dir = _jit_build_dir()
    _log.info("building hookplug._C for torch %s with the JIT from %s into %s (CUDA: %s, %s)",
              torch.__version__, src, build_dir, "yes" if with_cuda else "no", why)
    with cuda_arch_env(with_cuda):
        try:
            module = cpp_extension.load(
                name="hookplug_C", sources=sources(src, with_cuda), extra_include_paths=[src],
                extra_cflags=cflags, extra_ldflags=ld_flags(),
                extra_cuda_cflags=nvcc_flags() + ["-DHOOKPLUG_WITH_CUDA=1"] if with_cuda else None,
                with_cuda=with_cuda, build_directory=build_dir, verbose=False)
        except Exception as e:  # compiler missing, build error, ...
            output = str(e)
            level = logging.WARNING if _flag("HOOKPLUG_VERBOSE") else logging.DEBUG
            _log.log(level, "JIT build of hookplug._C failed; output:\n%s", output)
            raise BuildError(f"{type(e).__name__}: {_first_error_line(output)} (full output: "
                             "logger 'hookplug.build' at DEBUG, or HOOKPLUG_VERBOSE=1)") from None
    problem = static_libstdcxx_problem(getattr(module, "__file__", "") or "")
    if problem:
        raise BuildError(problem)
    return module


# -- loading ---------------------------------------------------------------------------------

_stale_logged = threading.Event()


def load(allow_jit: bool = True,
         build: Optional[Callable[[], Any]] = None) -> Tuple[Any, Optional[str]]:
    """``(module, kind)`` with kind ``"compiled"``, ``"jit"`` or ``"reference"`` (module
    None); ``(None, None)`` when the prebuilt module is unusable and ``allow_jit`` is False.

    ``build`` replaces :func:`jit_build` (tests). Falling back to the reference warns once
    per call here; under ``HOOKPLUG_REQUIRE_EXT=1`` it raises ``ImportError`` instead.
    """
    errors = []
    try:
        return _import_prebuilt(), "compiled"
    except _StaleBuild as e:
        errors.append(str(e))
        if not _stale_logged.is_set():
            _stale_logged.set()
            if not csrc_dir():
                _log.warning("hookplug: %s; no sources to rebuild it: %s", e, _FIX)
            elif _jit_built():  # (every process said it rebuilds)
                _log.info("hookplug: %s; using the JIT build for this torch made before", e)
            else:
                _log.warning("hookplug: %s; rebuilding it for this torch with the JIT (once)", e)
    except ImportError as e:
        errors.append(f"import hookplug._C failed: {e}")
    if not allow_jit:
        return None, None
    try:
        return (build or jit_build)(), "jit"
    except Exception as e:  # noqa: BLE001 - any failure falls back (or raises below)
        what = str(e) if isinstance(e, BuildError) else f"{type(e).__name__}: {e}"
        errors.append(f"JIT build failed: {what}")
    msg = "; ".join(errors)
    if "was built for torch" in errors[0]:
        msg += f"; to fix: {_FIX}"
    if _flag("HOOKPLUG_REQUIRE_EXT"):
        raise ImportError(f"hookplug: the compiled stats op is unavailable: {msg} "
                          "(HOOKPLUG_REQUIRE_EXT=1 forbids the pure-torch fallback)")
    warnings.warn(f"hookplug: the compiled stats op is unavailable, using the pure-torch "
                  f"reference (slower). {msg}", RuntimeWarning, stacklevel=4)
    return None, "reference"
