"""A short chunk_kda workload (T = 8192, the benchmark's inputs; H = 16 unless given) for Nsight Compute:

    ncu --clock-control none --section SpeedOfLight --section Occupancy --section WarpStateStats \
        -k regex:chunk_ -c 2 python bench/ncu_chunk.py [H]
"""

import sys

sys.path[:0] = [".", "bench"]

import torch  # noqa: E402

import flashkda  # noqa: E402
from test_prefill import KDA_FLAGS, _inputs  # noqa: E402

if __name__ == "__main__":
    kw = _inputs([8192], int(sys.argv[1]) if len(sys.argv) > 1 else 16)
    with torch.inference_mode():
        for _ in range(2):
            flashkda.chunk_kda(**kw, **KDA_FLAGS)
        torch.cuda.synchronize()
