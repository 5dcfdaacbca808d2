"""``python -m flashkda``: the build and kernel report, and the checked workload."""

import pytest
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


def test_info_on_a_gpu_names_every_path(monkeypatch, capsys):
    """The per-GPU report (exercised here with the device queries answered for an sm_90 GPU that
    runs every kernel): prefill, decode and training lines."""
    if not _ext.HAS_EXTENSION:
        pytest.skip("the per-GPU report needs the extension")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: "sm_90 GPU")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i: (9, 0))
    for name in ("device_shortfall", "chunk_smem_shortfall", "chunk_bwd_shortfall"):
        monkeypatch.setattr(_ext, name, lambda i, **kw: None)
    monkeypatch.setattr(_ext, "chunk_bwd_in_value_halves", lambda i: False)
    lines = cli.describe()
    text = "\n".join(lines)
    assert "GPU 0: sm_90 GPU" in text and "prefill: the chunked kernels" in text
    assert "training: the kernels' forward; the backward's kernels" in text
    assert "chunk_local_grad per chunk" in text and "chunk_state_scan for fp32 inputs" in text
    monkeypatch.setattr(_ext, "chunk_bwd_shortfall", lambda i, transitions=False: None if not transitions else "163 KB")
    monkeypatch.setattr(_ext, "chunk_bwd_in_value_halves", lambda i: True)
    text = "\n".join(cli.describe())
    assert "chunk_local_grad in value halves per chunk" in text and "fp32 inputs on a PyTorch backward (163 KB)" in text
    monkeypatch.setattr(_ext, "chunk_bwd_shortfall", lambda i, transitions=False: "163 KB per block")
    assert "a PyTorch backward (163 KB per block)" in "\n".join(cli.describe())
