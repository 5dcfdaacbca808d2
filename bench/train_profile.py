"""Where a training call's time goes: the CUDA kernels of one forward + backward of chunk_kda, by
total time (torch.profiler), for one of bench/cases.py's TRAIN_ROWS.

    python3 bench/train_profile.py [--case train_T8k_H32] [--top 15]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

import flashkda  # noqa: E402
from cases import TRAIN_ROWS  # noqa: E402
from test_train import KDA_FLAGS, _inputs  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--case", default="train_T8k_H32", choices=list(TRAIN_ROWS))
    ap.add_argument("--top", type=int, default=15)
    args = ap.parse_args()
    lens, B, H = TRAIN_ROWS[args.case]
    kw = _inputs(lens, B, H)
    inputs = [t for t in kw.values() if isinstance(t, torch.Tensor) and t.requires_grad]

    def step():
        o, s = flashkda.chunk_kda(**kw, **KDA_FLAGS)
        return torch.autograd.grad([o, s], inputs, [torch.ones_like(o), torch.ones_like(s)])

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.top, max_name_column_width=60))


if __name__ == "__main__":
    main()
