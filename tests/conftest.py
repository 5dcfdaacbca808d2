"""FLA's recorded autotuning winners (bench/fla_autotune.py) set before the tests that run FLA's
Triton kernels: each compiles one config instead of benchmarking all of them. Any GPU's winners
serve, since these tests compare results, not times."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import fla_autotune  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():  # FLA's modules are imported by now
        print(f"\nfla_autotune: {fla_autotune.pin(any_gpu=True)} tuning keys of FLA's kernels pinned")
