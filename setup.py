"""Build script: the CUDA extension ``flashkda._C`` through ``torch.utils.cpp_extension``.

Package metadata lives in pyproject.toml. Environment:

* ``FLASHKDA_CUDA_ARCHS``: ``"80+PTX;90a"`` (default: machine code for the A100 and H100 / H200,
  and the sm_80 family as PTX, which the driver compiles for any later GPU: sm_86, sm_89,
  Blackwell), ``"auto"`` (the visible GPU) or a list such as ``"90a"``; an entry ``"80+PTX"`` embeds
  PTX for that arch beside its machine code.
* ``FLASHKDA_SKIP_CUDA_BUILD=1``: install the pure-Python package only.
* ``MAX_JOBS`` (parallel compile jobs, read by torch) and ``NVCC_THREADS`` (nvcc ``--threads``).
* ``CUDA_HOME``: the CUDA toolkit; found from ``nvcc`` on PATH when unset.
* ``CUTLASS_HOME``: CUTLASS checkout; else ``third_party/cutlass``; else the ``nvidia-cutlass`` wheel.

Without a CUDA toolchain or a CUDA build of torch the package installs as pure Python and the
PyTorch reference serves every call. This script runs no git command and downloads nothing.
"""

import glob
import os
import shutil
import subprocess
import sys

from setuptools import setup

ROOT = os.path.dirname(os.path.abspath(__file__))
DEFAULT_ARCHS = "80+PTX;90a"


def log(msg: str) -> None:
    print(f"flashkda setup: {msg}", file=sys.stderr)


def find_cuda_home():
    """CUDA_HOME, or the toolkit that ``nvcc`` on PATH belongs to (also through wrapper scripts)."""
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            return os.environ[var]
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        return None
    try:  # nvcc reports its own install prefix as TOP in a dry run, wherever it was started from.
        out = subprocess.run([nvcc, "--dryrun", "-x", "cu", "-c", os.devnull, "-o", os.devnull],
                             capture_output=True, text=True, timeout=60)
        for line in (out.stdout + out.stderr).splitlines():
            if line.startswith("#$ TOP="):
                return os.path.realpath(line.split("=", 1)[1].strip())
    except (OSError, subprocess.SubprocessError):
        pass
    return os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))


def find_cutlass_include():
    tried = []
    home = os.environ.get("CUTLASS_HOME")
    if home:
        tried.append(f"CUTLASS_HOME={home}/include")
        if os.path.isdir(os.path.join(home, "include", "cute")):
            return os.path.join(home, "include")
    sub = os.path.join(ROOT, "third_party", "cutlass", "include")
    tried.append(sub)
    if os.path.isdir(os.path.join(sub, "cute")):
        return sub
    try:
        import cutlass_library

        wheel = os.path.join(os.path.dirname(cutlass_library.__file__), "source", "include")
        tried.append(wheel)
        if os.path.isdir(os.path.join(wheel, "cute")):
            return wheel
    except ImportError:
        tried.append("the nvidia-cutlass wheel (not installed)")
    raise RuntimeError(
        "flashkda: CUTLASS/CuTe headers not found; tried: " + "; ".join(tried)
        + ". Set CUTLASS_HOME, add third_party/cutlass, or `pip install nvidia-cutlass`."
    )


def arch_flags(spec: str):
    if spec.strip() == "auto":
        import torch

        major, minor = torch.cuda.get_device_capability()
        spec = f"{major}{minor}" + ("a" if major == 9 else "")
    flags = []
    for entry in filter(None, (s.strip() for s in spec.replace(",", ";").split(";"))):
        ptx = entry.endswith("+PTX")
        arch = entry[: -len("+PTX")] if ptx else entry
        flags.append(f"-gencode=arch=compute_{arch},code=sm_{arch}")
        if ptx:
            flags.append(f"-gencode=arch=compute_{arch},code=compute_{arch}")
    if not flags:
        raise RuntimeError(f"flashkda: FLASHKDA_CUDA_ARCHS={spec!r} names no architecture")
    return flags


def cuda_extension():
    """The extension and build command, or (None, reason) when only the Python package installs."""
    if os.environ.get("FLASHKDA_SKIP_CUDA_BUILD", "0") == "1":
        return None, "FLASHKDA_SKIP_CUDA_BUILD=1"
    cuda_home = find_cuda_home()
    if cuda_home is None:
        return None, "no CUDA toolkit (nvcc not on PATH and CUDA_HOME unset)"
    os.environ.setdefault("CUDA_HOME", cuda_home)  # read by torch.utils.cpp_extension at import
    try:
        import torch
        from torch.utils.cpp_extension import BuildExtension, CUDAExtension
    except ImportError:
        return None, ("torch is not importable at build time (install torch first and build with "
                      "`pip install --no-build-isolation`)")
    if torch.version.cuda is None:
        return None, f"torch {torch.__version__} is not a CUDA build"

    archs = os.environ.get("FLASHKDA_CUDA_ARCHS", DEFAULT_ARCHS)
    nvcc_threads = os.environ.get("NVCC_THREADS", "2")
    sources = sorted(glob.glob("csrc/binding/*.cpp")) + sorted(glob.glob("csrc/kernels/*.cu"))
    include_dirs = [os.path.join(ROOT, "csrc"), find_cutlass_include()]
    ext = CUDAExtension(
        name="flashkda._C",
        sources=sources,
        include_dirs=include_dirs,
        extra_compile_args={
            "cxx": ["-O3", "-std=c++20"],  # torch >= 2.10 headers need C++20; kernels are torch-free
            "nvcc": ["-O3", "-std=c++17", "-lineinfo", "--expt-relaxed-constexpr", f"--threads={nvcc_threads}",
                     "-DNDEBUG"] + arch_flags(archs),
        },
    )
    log(f"building the CUDA extension for {archs} with CUDA_HOME={os.environ['CUDA_HOME']}")
    return (ext, BuildExtension.with_options(use_ninja=shutil.which("ninja") is not None)), None


def main() -> None:
    built, reason = cuda_extension()
    if built is None:
        log(f"installing without the CUDA extension: {reason}")
        setup()
    else:
        ext, build_cmd = built
        setup(ext_modules=[ext], cmdclass={"build_ext": build_cmd})


if __name__ == "__main__":  # setuptools runs this file as __main__; tests import its helpers
    main()
