"""Every Python block of README.md runs as written: on the CUDA kernels when a GPU and the extension
are there, else on the reference path on the CPU (``device="cuda"`` read as ``"cpu"``)."""

import re
from pathlib import Path

import pytest
import torch

from helpers import HAS_CUDA_KERNELS

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()
BLOCKS = re.findall(r"```python\n(.*?)```", README, flags=re.S)
DEVICE = "cuda" if HAS_CUDA_KERNELS else "cpu"


def test_readme_has_python_blocks():
    assert len(BLOCKS) >= 5


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_block_runs(index):
    code = BLOCKS[index]
    if DEVICE == "cpu":
        code = code.replace('device="cuda"', 'device="cpu"').replace('.to("cuda"', '.to("cpu"')
    torch.manual_seed(0)
    namespace = {"__name__": f"readme_block_{index}"}
    exec(compile(code, f"README.md python block {index}", "exec"), namespace)  # noqa: S102
    for name, value in namespace.items():
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            assert torch.isfinite(value).all(), f"block {index}: {name} is not finite"
