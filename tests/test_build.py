"""The build script's helpers: architecture flags, CUDA toolkit and CUTLASS discovery."""

import importlib.util
import os
import stat
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def setup_py():
    spec = importlib.util.spec_from_file_location("flashkda_setup", ROOT / "setup.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # defines the helpers; setup() runs only as __main__
    return module


def test_arch_flags(setup_py):
    assert setup_py.arch_flags("80;90a") == ["-gencode=arch=compute_80,code=sm_80",
                                             "-gencode=arch=compute_90a,code=sm_90a"]
    assert setup_py.arch_flags("90a, 80+PTX") == ["-gencode=arch=compute_90a,code=sm_90a",
                                                  "-gencode=arch=compute_80,code=sm_80",
                                                  "-gencode=arch=compute_80,code=compute_80"]
    with pytest.raises(RuntimeError, match="names no architecture"):
        setup_py.arch_flags(" ; ")


def test_cuda_home_from_a_wrapper_nvcc(setup_py, tmp_path, monkeypatch):
    """A wrapper script on PATH: the toolkit is the prefix nvcc reports in a dry run, not its folder."""
    toolkit = tmp_path / "toolkit"
    toolkit.mkdir()
    wrapper = tmp_path / "bin" / "nvcc"
    wrapper.parent.mkdir()
    wrapper.write_text(f"#!/bin/sh\necho '#$ TOP={toolkit}' >&2\n")
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IEXEC)
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.setenv("PATH", f"{wrapper.parent}{os.pathsep}{os.environ['PATH']}")
    assert setup_py.find_cuda_home() == str(toolkit)
    monkeypatch.setenv("CUDA_HOME", "/opt/cuda-x")
    assert setup_py.find_cuda_home() == "/opt/cuda-x"


def test_cutlass_lookup_order_and_error(setup_py, tmp_path, monkeypatch):
    home = tmp_path / "cutlass"
    (home / "include" / "cute").mkdir(parents=True)
    monkeypatch.setenv("CUTLASS_HOME", str(home))
    assert setup_py.find_cutlass_include() == str(home / "include")
    monkeypatch.setenv("CUTLASS_HOME", str(tmp_path / "missing"))
    monkeypatch.setattr(setup_py, "ROOT", str(tmp_path))  # no third_party/cutlass there
    monkeypatch.setitem(sys.modules, "cutlass_library", None)  # the wheel is not installed
    with pytest.raises(RuntimeError) as info:
        setup_py.find_cutlass_include()
    msg = str(info.value)
    assert "CUTLASS_HOME=" in msg and "third_party" in msg and "nvidia-cutlass" in msg


def test_cutlass_pin_is_the_readmes():
    """nvidia-cutlass is a pinned build requirement, and the README's install command installs that pin."""
    import re

    pin = re.search(r'"nvidia-cutlass==([0-9.]+)"', (ROOT / "pyproject.toml").read_text()).group(1)
    quickstart = (ROOT / "README.md").read_text().split("<!-- quickstart -->")[1].split("<!-- /quickstart -->")[0]
    assert f"nvidia-cutlass=={pin}" in quickstart
    assert (ROOT / "third_party" / "README.md").is_file()
