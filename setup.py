"""Builds hookplug._C (the fused tensor-statistics op) from csrc/ with ninja.

The CPU kernels always build. The CUDA binding builds only when torch itself has CUDA
and CUDA_HOME is set (never by probing for a GPU). Metadata lives in pyproject.toml.
"""
import glob
import os
import sys

from setuptools import setup
from torch.utils import cpp_extension

ROOT = os.path.dirname(os.path.abspath(__file__))


def _sources(pattern):
    return sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, pattern)))


def _openmp_flags():
    """at::parallel_for is inline OpenMP in torch's headers: without -fopenmp the CPU kernel
    runs on one thread. (Linux/GCC/Clang; the runtime is the libgomp torch already loaded.)"""
    return ["-fopenmp"] if sys.platform.startswith("linux") else []


def _extension():
    cxx_flags = ["-O3", "-std=c++17"] + _openmp_flags()
    sources = _sources("csrc/*.cpp")
    with_cuda = (
        os.environ.get("HOOKPLUG_NO_CUDA", "0") != "1"
        and cpp_extension.CUDA_HOME is not None
        and __import__("torch").version.cuda is not None
    )
    if with_cuda:
        sources += _sources("csrc/cuda/*.cpp") + _sources("csrc/cuda/*.cu")
        return cpp_extension.CUDAExtension(
            "hookplug._C",
            sources,
            include_dirs=[os.path.join(ROOT, "csrc")],
            define_macros=[("HOOKPLUG_WITH_CUDA", "1")],
            extra_compile_args={"cxx": cxx_flags, "nvcc": ["-O3", "-std=c++17"]},
            extra_link_args=_openmp_flags(),
        )
    return cpp_extension.CppExtension(
        "hookplug._C",
        sources,
        include_dirs=[os.path.join(ROOT, "csrc")],
        extra_compile_args={"cxx": cxx_flags},
        extra_link_args=_openmp_flags(),
    )


setup(
    ext_modules=[_extension()],
    cmdclass={"build_ext": cpp_extension.BuildExtension.with_options(use_ninja=True)},
)
