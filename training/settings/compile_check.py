"""What torch.compile (`--compile`) needs on this machine, found before any compiling: a C++
compiler and Python's headers on CPUs (inductor), triton and a C compiler on GPUs. Asked by
training.fsdp before it builds its model, and by make selftest's compile check."""

from __future__ import annotations

import os
import shutil
import sysconfig
from pathlib import Path

import torch

from torch_multinode.cluster.errors import UserError


def compile_problem(device: torch.device) -> UserError | None:
    """What torch.compile would fail on here, found before any compiling: on CPUs inductor builds
    C++ kernels with Python bindings (a C++ compiler, Python.h); on GPUs triton builds a C
    launcher (triton, a C compiler, Python.h)."""
    if device.type == "cuda":
        from torch.utils._triton import has_triton

        if not has_triton():
            return UserError(
                "--compile on GPUs needs triton, which this torch does not find",
                hint="the CUDA training image (it keeps triton), or leave out --compile",
            )
        # triton's own search (triton.runtime.build): $CC, else gcc, else clang
        compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("clang")
        if compiler is None:
            return UserError(
                "--compile on GPUs needs a C compiler for triton's launcher ($CC, gcc or clang); "
                "none is installed here",
                hint="apt-get install gcc, or leave out --compile",
            )
    else:
        from torch._inductor import config as inductor
        from torch._inductor.cpp_builder import get_cpp_compiler

        try:
            get_cpp_compiler()
        except Exception:  # inductor's own search failed: InvalidCxxCompiler, or its cause
            tried = " or ".join(name for name in inductor.cpp.cxx if name)
            return UserError(
                f"--compile on CPUs needs a C++ compiler to build torch.compile's kernels, and "
                f"{tried} does not run here",
                hint="apt-get install g++ (or CXX=<compiler>), or leave out --compile",
            )
    headers = Path(sysconfig.get_paths()["include"], "Python.h")
    if not headers.is_file():
        return UserError(
            f"--compile needs Python's C headers, and {headers} is missing (the compiled kernels "
            "include it)",
            hint="apt-get install python3-dev (for this Python), or leave out --compile",
        )
    return None
