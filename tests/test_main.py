"""``python -m flashkda``: the build and kernel report, and the checked workload."""

import torch

from flashkda import __main__ as cli
from flashkda import _ext


def test_info_reports_build_and_devices(capsys):
    assert cli.main(["--info"]) == 0
    out = capsys.readouterr().out
    assert ("CUDA extension: built" in out) == _ext.HAS_EXTENSION
    if torch.cuda.is_available():
        assert "GPU 0:" in out and "prefill:" in out or "reference" in out
    else:
        assert "GPU: none visible" in out


def test_workload_passes_on_this_machine(capsys):
    assert cli.main(["--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "chunk_kda" in out and "fused_recurrent_kda" in out and "OK" in out
