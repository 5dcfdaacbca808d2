"""Benchmarks run on a CUDA device only; the records collected in common.RESULTS are written to
the JSON file named by --flashkda-results after every record and at the end of the session."""

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

import common  # noqa: E402
import fla_autotune  # noqa: E402


def pytest_addoption(parser):
    parser.addoption("--flashkda-results", default=None, help="write benchmark records (JSON list) here")


def pytest_configure(config):
    config.addinivalue_line("markers", "sweep: time-against-T sweep for the plot (bench/report.py --plot)")
    common.RESULTS_PATH = config.getoption("--flashkda-results", default=None)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():  # FLA's modules are imported by now: its recorded autotuning winners
        print(f"\nfla_autotune: {fla_autotune.pin()} tuning keys of FLA's kernels pinned")
    else:
        skip = pytest.mark.skip(reason="benchmarks need a CUDA device")
        here = Path(__file__).parent
        for item in items:
            if here in Path(item.fspath).parents:
                item.add_marker(skip)


def pytest_sessionfinish(session, exitstatus):
    path = session.config.getoption("--flashkda-results")
    if path and common.RESULTS:
        Path(path).write_text(json.dumps(common.RESULTS, indent=1) + "\n")
