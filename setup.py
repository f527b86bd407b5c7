"""Builds hookplug._C (the fused tensor-statistics op) from csrc/ with ninja.

The binary is built against the torch installed in the build environment, so build
without isolation: ``pip install --no-build-isolation .`` (``-e .``, ``python -m build
--no-isolation``). The CPU kernels always build; the CUDA binding builds when torch has
CUDA and a complete toolkit is at CUDA_HOME (see hookplug/_loader.py, which this file
shares with the JIT path). Metadata lives in pyproject.toml.
"""
import glob
import importlib.util
import os
import shutil
import sys

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = os.path.dirname(os.path.abspath(__file__))

try:
    import torch
    from torch.utils import cpp_extension
except ImportError:
    sys.exit(
        "error: hookplug builds its C++ extension against the torch it will run with, and "
        "this build environment has no torch (pip's build isolation?): install torch, then "
        "`pip install --no-build-isolation .` (or `python -m build --no-isolation`).")


def _loader():
    """hookplug/_loader.py by path: importing the package would need its dependencies."""
    spec = importlib.util.spec_from_file_location(
        "_hookplug_build_loader", os.path.join(ROOT, "hookplug", "_loader.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_L = _loader()
_WITH_CUDA, _WHY = _L.cuda_plan()


def _extension():
    src = os.path.join(ROOT, "csrc")
    sources = [os.path.relpath(p, ROOT) for p in _L.sources(src, _WITH_CUDA)]
    kwargs = dict(include_dirs=[src], extra_link_args=_L.ld_flags())
    if _WITH_CUDA:
        return cpp_extension.CUDAExtension(
            "hookplug._C", sources, define_macros=[("HOOKPLUG_WITH_CUDA", "1")],
            extra_compile_args={"cxx": _L.cxx_flags(), "nvcc": _L.nvcc_flags()}, **kwargs)
    return cpp_extension.CppExtension(
        "hookplug._C", sources, extra_compile_args={"cxx": _L.cxx_flags()}, **kwargs)


class _BuildExt(cpp_extension.BuildExtension):
    """torch's build_ext, with the default CUDA architectures where no GPU is visible, and
    hookplug/_build_info.py (the torch this build is for) written next to the binary."""

    def run(self):
        print(f"hookplug: building _C for torch {torch.__version__}; CUDA binding: "
              f"{'yes' if _WITH_CUDA else 'no'} ({_WHY})")
        with _L.cuda_arch_env(_WITH_CUDA) as arch:
            super().run()
        built = self.get_ext_fullpath("hookplug._C")
        problem = _L.static_libstdcxx_problem(built)
        if problem:  # leave no refused binary behind, in the build or the source tree
            for path in {built, os.path.join(ROOT, "hookplug", os.path.basename(built))}:
                if os.path.exists(path):
                    os.remove(path)
            sys.exit(f"error: hookplug: {problem}")
        text = _L.build_info_source(_WITH_CUDA, _WHY, arch)
        targets = {os.path.dirname(self.get_ext_fullpath("hookplug._C"))}
        if self.inplace or getattr(self, "editable_mode", False):
            targets.add(os.path.join(ROOT, "hookplug"))
        for folder in targets:
            os.makedirs(folder, exist_ok=True)
            with open(os.path.join(folder, "_build_info.py"), "w") as f:
                f.write(text)


class _BuildPy(build_py):
    """Ships csrc/ as hookplug/csrc in wheels, so the JIT path can rebuild from a wheel."""

    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):
            return  # an editable install finds <checkout>/csrc
        dest = os.path.join(self.build_lib, "hookplug", "csrc")
        for path in glob.glob(os.path.join(ROOT, "csrc", "**", "*"), recursive=True):
            if os.path.isfile(path):
                target = os.path.join(dest, os.path.relpath(path, os.path.join(ROOT, "csrc")))
                os.makedirs(os.path.dirname(target), exist_ok=True)
                shutil.copy2(path, target)


setup(
    ext_modules=[_extension()],
    cmdclass={"build_ext": _BuildExt.with_options(use_ninja=True), "build_py": _BuildPy},
)
