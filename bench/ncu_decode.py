"""A decode workload for Nsight Compute (the benchmark's inputs: N sequences, H = 32, fp32 V-first
pool, shuffled slots, one token each):

    ncu --set full -k regex:decode_step -c 1 python bench/ncu_decode.py [N, default 1024]
"""

import sys

sys.path[:0] = [".", "bench"]

import torch  # noqa: E402

import flashkda  # noqa: E402
from test_decode import _inputs  # noqa: E402

if __name__ == "__main__":
    N = int(sys.argv[1]) if len(sys.argv) > 1 else 1024
    kw = _inputs(N)
    out = torch.empty_like(kw["v"])
    for _ in range(2):
        flashkda.fused_recurrent_kda(**kw, out=out)
    torch.cuda.synchronize()
