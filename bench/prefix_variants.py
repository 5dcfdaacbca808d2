"""States at chunk starts on PREFIX_ROW (8k tokens, H = 96): what each form of keeping them costs
beside the plain call, all in one process, interleaved, so that the ratios share one clock.

Forms: every chunk's bf16 state (``return_intermediate_states``); a checkpoint every
PREFIX_CHECKPOINT_TOKENS tokens into an fp32 pool (the required case), into a bf16 pool, with int64
slots; a slot table naming no slot (the per-step cost of the pool path alone); a checkpoint at every
chunk into an fp32 pool (the cost of the stores). Inputs and flags are bench/test_prefill.py's.

    python bench/prefix_variants.py [--rounds 2] [--json PATH]

--json writes the two cases of bench/test_prefill.py::test_prefill_prefix_states as records
(median over the rounds, ``plain_ms`` from the same rounds).
"""

import argparse
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import flashkda  # noqa: E402
from cases import PREFILL_ROWS, PREFIX_CHECKPOINT_TOKENS, PREFIX_ROW  # noqa: E402
from common import cuda_median_ms, floor_ms, record  # noqa: E402
from test_prefill import CHUNK, KDA_FLAGS, _floor, _inputs, checkpoint_kwargs, prefix_state_bytes  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json")
    args = ap.parse_args()
    lens, H = PREFILL_ROWS[PREFIX_ROW]
    kw = _inputs(lens, H)
    chunks, every = -(-sum(lens) // CHUNK), PREFIX_CHECKPOINT_TOKENS // CHUNK
    N = len(lens)
    forms = {
        "plain": {},
        "intermediate_states": dict(return_intermediate_states=True),
        "checkpoints": checkpoint_kwargs(N, chunks, H, every),
        "checkpoints_bf16_pool": checkpoint_kwargs(N, chunks, H, every, torch.bfloat16),
        "checkpoints_int64_slots": checkpoint_kwargs(N, chunks, H, every, index_dtype=torch.int64),
        "slot_table_no_slot": checkpoint_kwargs(N, chunks, H, every, none=True),
        "checkpoint_every_chunk": checkpoint_kwargs(N, chunks, H, 1),
    }
    times = {name: [] for name in forms}
    with torch.inference_mode():
        for _ in range(args.rounds):
            for name, extra in forms.items():
                times[name].append(cuda_median_ms(lambda: flashkda.chunk_kda(**kw, **KDA_FLAGS, **extra), calls=20))
    ms = {name: statistics.median(t) for name, t in times.items()}
    print(f"{PREFIX_ROW}: ms (x plain)")
    for name, t in ms.items():
        print(f"  {name:26s} {t:8.4f}  {t / ms['plain']:.3f}x")
    if args.json:
        recs = [record(f"{PREFIX_ROW}_{kind}", "flashkda", ms[kind],
                       _floor(lens, H) + floor_ms(prefix_state_bytes(kind, chunks, H)),
                       plain_ms=round(ms["plain"], 5), source="bench/prefix_variants.py")
                for kind in ("intermediate_states", "checkpoints")]
        with open(args.json, "w") as f:
            json.dump(recs, f, indent=1)


if __name__ == "__main__":
    main()
