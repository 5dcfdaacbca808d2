"""Quick look at the chunked prefill: accuracy of the required cases and time per benchmark row for
each value split, with the per-kernel split of the time (torch.profiler). Prints a table.

    PYTHONPATH=.:bench python bench/prefill_quick.py [--rows fixed_8k_H96,...] [--no-accuracy]
        [--splits 0,1,2] [--segments 8,16] [--json out.json]

Records (impl flashkda, flashkda_softplus, flashkda_gdn for the automatic value split; flashkda_split1
/ flashkda_split2 for forced splits, flashkda_seg{n} for segments of n chunks) use the timing and
floor of bench/test_prefill.py.
"""

from __future__ import annotations

import argparse

import torch

import flashkda
from flashkda import _ext
import common
from common import cuda_median_ms, kernel_family, record
from test_prefill import KDA_FLAGS, ROWS, _floor, _gdn_inputs, _inputs


def accuracy() -> None:
    import sys

    sys.path.insert(0, "tests")
    from helpers import reference64, rel_err

    gen = torch.Generator().manual_seed(0)
    lens, D = [700, 1348], 128
    T = sum(lens)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    for name, H, HV, gate in (("lower_bound", 4, 4, "lb"), ("lower_bound/sm80", 4, 4, "lb"),
                              ("softplus", 4, 4, "sp"),
                              ("gva_x2", 4, 8, "lb"), ("gdn", 4, 4, "gdn"), ("fp16", 4, 4, "fp16")):
        dt = torch.float16 if gate == "fp16" else torch.bfloat16
        gdn = gate == "gdn"
        kw = dict(q=r(1, T, H, D).to(dt).cuda(), k=r(1, T, H, D).to(dt).cuda(), v=r(1, T, HV, D).to(dt).cuda(),
                  g=(2 * r(1, T, HV) if gdn else 2 * r(1, T, HV, D)).to(dt).cuda(), beta=r(1, T, HV).to(dt).cuda(),
                  A_log=torch.rand(HV, generator=gen).cuda(), dt_bias=(r(HV) if gdn else r(HV * D)).cuda(),
                  initial_state=(0.1 * r(2, HV, D, D)).cuda(),
                  cu_seqlens=torch.tensor([0, 700, T], dtype=torch.int32, device="cuda"),
                  use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                  lower_bound=None if gate == "sp" else -5.0, state_v_first=True)
        fn = flashkda.chunk_gated_delta_rule if gdn else flashkda.chunk_kda
        with kernel_family(name.split("/")[1] if "/" in name else _ext.config.kernel_family):
            o, s = fn(**kw, output_final_state=True)
        ro, rs = reference64(kw, output_final_state=True)
        print(f"accuracy {name:12s} output {rel_err(o, ro):.2e}  state {rel_err(s, rs):.2e}", flush=True)


def kernel_times(fn) -> dict:
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
    out = {}  # kernel time per call, ms (the segmented recurrence launches twice per call)
    for ev in prof.key_averages():
        if ev.device_type.name == "CUDA" and "chunk" in ev.key:
            name = next((n for n in ("prepare", "recurrence", "scan") if n in ev.key), "index")
            total = ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
            out[name] = out.get(name, 0.0) + total / 5 / 1e3
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default=",".join(ROWS))
    ap.add_argument("--no-accuracy", action="store_true")
    ap.add_argument("--splits", default="0,1,2")
    ap.add_argument("--segments", default="",
                    help="chunks per segment to time as well, 0 for whole chains (FLASHKDA_CHUNK_SEGMENT; the "
                         "main rows use auto)")
    ap.add_argument("--json", help="write the records here (rewritten after each one)")
    args = ap.parse_args()
    common.RESULTS_PATH = args.json
    if not args.no_accuracy:
        accuracy()
    print(f"{'case':22s} {'impl':18s} {'ms':>8s} {'floor':>7s}  kernels (ms)")
    with torch.inference_mode():
        for case in args.rows.split(","):
            lens, H = ROWS[case]
            kw = _inputs(lens, H)
            for split in (int(x) for x in args.splits.split(",")):
                _ext.config.chunk_value_split = split
                for impl in ("lb", "softplus", "gdn", "sm80") if split == 0 else ("lb",):
                    if impl == "lb":
                        fn = lambda: flashkda.chunk_kda(**kw, **KDA_FLAGS)  # noqa: E731
                    elif impl == "sm80":

                        def fn():
                            with kernel_family("sm80"):
                                flashkda.chunk_kda(**kw, **KDA_FLAGS)
                    elif impl == "softplus":
                        fl = dict(KDA_FLAGS, lower_bound=None, safe_gate=False)
                        fn = lambda: flashkda.chunk_kda(**kw, **fl)  # noqa: E731
                    else:
                        gk = _gdn_inputs(kw)
                        fn = lambda: flashkda.chunk_gated_delta_rule(**gk)  # noqa: E731
                    ms = cuda_median_ms(fn, calls=20)
                    kt = kernel_times(fn)
                    name = {"lb": "flashkda", "softplus": "flashkda_softplus", "gdn": "flashkda_gdn",
                            "sm80": "flashkda_sm80"}[impl]
                    record(case, name if split == 0 else f"{name}_split{split}", ms,
                           _floor(lens, H, gdn=impl == "gdn"), **{f"{k}_ms": round(v, 4) for k, v in kt.items()})
                    ks = " ".join(f"{k}={v:.3f}" for k, v in sorted(kt.items()))
                    print(f"{case:22s} {impl + '/split' + str(split):18s} {ms:8.3f} {_floor(lens, H):7.3f}  {ks}",
                          flush=True)
            _ext.config.chunk_value_split = 0
            for seg in (int(x) for x in args.segments.split(",") if x):
                _ext.config.chunk_segment = seg
                fn = lambda: flashkda.chunk_kda(**kw, **KDA_FLAGS)  # noqa: E731
                ms = cuda_median_ms(fn, calls=20)
                kt = kernel_times(fn)
                _ext.config.chunk_segment = -1
                record(case, f"flashkda_seg{seg}", ms, _floor(lens, H), **{f"{k}_ms": round(v, 4) for k, v in kt.items()})
                ks = " ".join(f"{k}={v:.3f}" for k, v in sorted(kt.items()))
                print(f"{case:22s} {'segments ' + str(seg):18s} {ms:8.3f} {_floor(lens, H):7.3f}  {ks}", flush=True)


if __name__ == "__main__":
    main()
