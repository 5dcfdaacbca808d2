"""Where a training call's time goes: the CUDA kernels of one forward + backward of chunk_kda (or,
for the GDN row, chunk_gated_delta_rule), by total time (torch.profiler), for one of
bench/cases.py's training rows, on bench/test_train.py's inputs and flags.

    python3 bench/train_profile.py [--case train_T8k_H32] [--top 15] [--ops]

--ops also lists the PyTorch ops (their CUDA time), which names the small kernels of the glue.
The upstream gradients are made before the profiled step, as bench/test_train.py makes them.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

import flashkda  # noqa: E402
from cases import TRAIN_GDN_ROW, TRAIN_ROWS  # noqa: E402
from test_train import GDN_FLAGS, KDA_FLAGS, _inputs  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--case", default="train_T8k_H32", choices=[*TRAIN_ROWS, TRAIN_GDN_ROW])
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--ops", action="store_true", help="also the PyTorch ops (CPU activity)")
    args = ap.parse_args()
    gdn = args.case == TRAIN_GDN_ROW
    lens, B, H = ([8192], 1, 32) if gdn else TRAIN_ROWS[args.case]
    kw = _inputs(lens, B, H, gdn=gdn)
    inputs = [t for t in kw.values() if isinstance(t, torch.Tensor) and t.requires_grad]
    fn, flags = (flashkda.chunk_gated_delta_rule, GDN_FLAGS) if gdn else (flashkda.chunk_kda, KDA_FLAGS)
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
    print(prof.key_averages().table(sort_by=sort, row_limit=args.top, max_name_column_width=60))


if __name__ == "__main__":
    main()
