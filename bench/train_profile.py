"""Where a training call's time goes: the CUDA kernels of one forward + backward of chunk_kda (or,
for the GDN row, chunk_gated_delta_rule), by total time (torch.profiler), for one of
bench/cases.py's training rows, on bench/test_train.py's inputs and flags.

    python3 bench/train_profile.py [--case train_T8k_H32] [--impl flashkda|fla] [--top 15] [--ops]

--ops also lists the PyTorch ops (their CUDA time), which names the small kernels of the glue.
--impl fla profiles FLA's chunk_kda / chunk_gated_delta_rule on the same inputs (its Hopper guard
on the scalar-gate backward lifted as bench/test_train.py lifts it; its autotuning winners pinned).
The upstream gradients are made before the profiled step, as bench/test_train.py makes them. Last
line: the sum of the step's kernel times, beside the step's time by CUDA events (median of
back-to-back steps, as bench/test_train.py times them); where the second exceeds the first, the
device waited for the host.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ["FLA_FLASH_KDA"] = "0"  # FLA's rows run FLA's own kernels
os.environ["FLASHKDA_FLA_BACKEND"] = "0"
sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]

import torch  # noqa: E402
from torch.autograd import DeviceType  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

import flashkda  # noqa: E402
import test_train  # noqa: E402
from cases import TRAIN_GDN_ROW, TRAIN_ROWS  # noqa: E402
from common import cuda_median_ms  # noqa: E402
from test_train import GDN_FLAGS, KDA_FLAGS, _inputs  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--case", default="train_T8k_H32", choices=[*TRAIN_ROWS, TRAIN_GDN_ROW])
    ap.add_argument("--impl", default="flashkda", choices=["flashkda", "fla"])
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--ops", action="store_true", help="also the PyTorch ops (CPU activity)")
    args = ap.parse_args()
    gdn = args.case == TRAIN_GDN_ROW
    lens, B, H = ([8192], 1, 32) if gdn else TRAIN_ROWS[args.case]
    kw = _inputs(lens, B, H, gdn=gdn)
    inputs = [t for t in kw.values() if isinstance(t, torch.Tensor) and t.requires_grad]
    if args.impl == "fla":
        if test_train.fla_kda is None:
            sys.exit("train_profile: --impl fla needs fla-core (flash-linear-attention) installed")
        import fla_autotune

        fla_autotune.pin()
        if gdn:
            test_train._lift_fla_hopper_guard()
        fn = test_train.fla_gdn if gdn else test_train.fla_kda
    else:
        fn = flashkda.chunk_gated_delta_rule if gdn else flashkda.chunk_kda
    flags = GDN_FLAGS if gdn else KDA_FLAGS
    o, s = fn(**kw, **flags)
    do, ds = torch.ones_like(o), torch.ones_like(s)
    del o, s

    def step():
        o, s = fn(**kw, **flags)
        return torch.autograd.grad([o, s], inputs, [do, ds])

    step()
    torch.cuda.synchronize()
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if args.ops else [ProfilerActivity.CUDA]
    with profile(activities=activities) as prof:
        step()
        torch.cuda.synchronize()
    sort = "self_cuda_time_total" if args.ops else "cuda_time_total"
    events = prof.key_averages()
    print(events.table(sort_by=sort, row_limit=args.top, max_name_column_width=60))
    kernels_ms = sum(e.self_device_time_total for e in events if e.device_type == DeviceType.CUDA) / 1e3
    print(f"{args.impl} {args.case}: kernels {kernels_ms:.3f} ms, step {cuda_median_ms(step, calls=20):.3f} ms "
          "(CUDA events, back to back)")


if __name__ == "__main__":
    main()
