"""bench/fla_autotune.py: FLA's autotuning winners read from a Triton cache, merged per GPU, and set
into the autotuners of FLA's modules (a stand-in module here), only where the config is offered."""

import json
import sys
import types
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import fla_autotune  # noqa: E402

triton = pytest.importorskip("triton")

KEY = [64, True, "torch.bfloat16"]


def _config(bk, warps, stages):
    return dict(kwargs={"BK": bk}, num_warps=warps, num_ctas=1, num_stages=stages, maxnreg=None, pre_hook=None,
                ir_override=None)


def _cache(tmp_path, name, key, timings):
    d = tmp_path / "cache" / name  # Triton's cache: a folder per hash
    d.mkdir(parents=True)
    (d / f"{name}.autotune.json").write_text(json.dumps({"key": key, "configs_timings": timings}))


def test_record_takes_the_winner_and_merges_per_gpu(tmp_path):
    # timings as Triton keeps them ([median, p20, p80]); the smallest median wins, p20 breaks no tie here
    _cache(tmp_path, "kda_kernel", KEY, [[_config(32, 4, 3), [0.020, 0.010, 0.030]],
                                         [_config(64, 4, 2), [0.015, 0.014, 0.016]],
                                         [_config(64, 8, 2), [0.018, 0.001, 0.019]]])
    _cache(tmp_path, "triton_poi_fused_add_0", [8], [[_config(16, 1, 1), [0.001]]])  # torch.compile's: skipped
    records = tmp_path / "fla_autotune.json"
    records.write_text(json.dumps({"other GPU": {"kda_kernel": {"[1]": {"kwargs": {}}}}}))
    assert fla_autotune.record(tmp_path / "cache", "GPU A", records) == 1
    data = json.loads(records.read_text())
    assert set(data) == {"other GPU", "GPU A"}
    assert data["GPU A"] == {"kda_kernel": {json.dumps(KEY): {"kwargs": {"BK": 64}, "num_warps": 4, "num_stages": 2,
                                                              "num_ctas": 1, "maxnreg": None}}}


def test_pin_sets_offered_winners_into_fla_autotuners(tmp_path, monkeypatch):
    @triton.jit
    def kda_kernel(x, N, BK: "triton.language.constexpr"):  # noqa: F821
        pass

    offered = [triton.Config({"BK": bk}, num_warps=4, num_stages=s) for bk in (32, 64) for s in (2, 3)]
    tuner = triton.autotune(configs=offered, key=["N"])(kda_kernel)
    monkeypatch.setitem(sys.modules, "fla.ops.stand_in", types.SimpleNamespace(kda_kernel=tuner))
    winner = {"kwargs": {"BK": 64}, "num_warps": 4, "num_stages": 2, "num_ctas": 1, "maxnreg": None}
    not_offered = dict(winner, num_warps=8)
    records = tmp_path / "fla_autotune.json"
    records.write_text(json.dumps({"GPU A": {"kda_kernel": {json.dumps(KEY): winner, "[128]": not_offered}},
                                   "GPU B": {"kda_kernel": {"[256]": winner}}}))
    assert fla_autotune.pin("GPU A", path=records) == 1
    assert tuner.cache == {tuple(KEY): offered[2]}
    assert fla_autotune.pin("GPU C", path=records) == 0  # benchmarks: this GPU model's winners only
    assert fla_autotune.pin("GPU C", any_gpu=True, path=records) == 2
    assert tuner.cache[(256,)] is offered[2]


def test_watch_prints_each_config_as_it_is_timed(monkeypatch, capfd):
    @triton.jit
    def kda_kernel(x, N, BK: "triton.language.constexpr"):  # noqa: F821
        pass

    offered = [triton.Config({"BK": bk}, num_warps=4, num_stages=2) for bk in (32, 64)]
    tuner = triton.autotune(configs=offered, key=["N"])(kda_kernel)
    timed = []
    monkeypatch.setattr(tuner, "_bench", lambda *args, config, **kw: timed.append(config) or [0.5, 0.4, 0.6],
                        raising=False)
    # only the stand-in: FLA's own autotuners, where FLA is installed, stay as they are
    monkeypatch.setattr(fla_autotune, "_autotuners", lambda: iter([("kda_kernel", tuner)]))
    assert fla_autotune.watch(30) == 1
    assert fla_autotune.watch(30) == 0  # wrapped once
    tuner.nargs = {"x": None, "N": 4096}
    assert tuner._bench(None, 4096, config=offered[1]) == [0.5, 0.4, 0.6]
    assert timed == [offered[1]]
    lines = capfd.readouterr().err.splitlines()
    assert len(lines) == 2 and lines[0].startswith("fla_autotune: kda_kernel [4096] ") and lines[0].endswith(" ...")
    assert "BK: 64" in lines[1] and "[0.5, 0.4, 0.6]" in lines[1]
