"""Gradient accuracy of the chunked prefill: flashkda and FLA against fp64 autograd of the recurrence.

    python3 bench/grad_accuracy.py [--json PATH] [--impls flashkda,fla]

Inputs (tests/helpers.make_inputs, seed 12): bf16 q, k, v, raw g ~ N(0, 2) and beta, A_log ~ U(0, 1),
dt_bias ~ N(0, 1), fp32 initial state 0.1 N(0, 1); T = 300 fixed length and varlen 37 + 1 + 200 + 62,
H = 4, K = V = 128, l2norm and beta sigmoid in the kernel; lower-bound (-5, FLA with safe_gate) and
softplus gates; upstream gradients N(0, 1) for o and the final state. Prints one markdown row per
case and implementation: the relative L2 error of every gradient (tests/test_autograd.py bounds
flashkda's at 1.25x FLA's).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ["FLA_FLASH_KDA"] = "0"
os.environ["FLASHKDA_FLA_BACKEND"] = "0"  # FLA's rows run FLA's own kernels
root = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(root), str(root / "tests"), str(root / "bench")]

import torch  # noqa: E402

import common  # noqa: E402
import fla_autotune  # noqa: E402
import flashkda  # noqa: E402
from helpers import GRAD_INPUTS, grads64, grads_of, make_inputs, rel_err  # noqa: E402

CASES = {"T300": None, "varlen4": [37, 1, 200, 62]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json")
    ap.add_argument("--impls", default="flashkda,fla",
                    help="which to run (fla alone: FLA's Triton kernels compiled, e.g. to fill a cache)")
    args = ap.parse_args()
    impls_wanted = set(args.impls.split(","))
    common.RESULTS_PATH = args.json
    try:
        from fla.ops.kda import chunk_kda as fla_chunk_kda
    except Exception:  # noqa: BLE001
        fla_chunk_kda = None
    fla_autotune.pin(any_gpu=True)  # errors, not times: any GPU's recorded winners serve
    names = [n for n in GRAD_INPUTS]
    print("| case | gate | impl | " + " | ".join(f"d{n}" for n in names) + " |")
    print("|---|---|---|" + "---|" * len(names))
    for case, lens in CASES.items():
        for gate in ("lower_bound", "softplus"):
            kw = make_inputs(H=4, D=128, T=300, lens=lens, gate=gate, dtype=torch.bfloat16, device="cuda", seed=12)
            gen = torch.Generator().manual_seed(11)
            do = torch.randn(*kw["v"].shape, generator=gen).cuda()
            dht = torch.randn(*kw["initial_state"].shape, generator=gen).cuda()
            ref = grads64(kw, do, dht)
            impls = {}
            if "flashkda" in impls_wanted:
                impls["flashkda"] = grads_of(flashkda.chunk_kda, kw, do, dht, output_final_state=True)
            if fla_chunk_kda is not None and "fla" in impls_wanted:
                impls["fla"] = grads_of(fla_chunk_kda, kw, do, dht, output_final_state=True,
                                        safe_gate=gate == "lower_bound")
            for impl, got in impls.items():
                errs = {n: rel_err(a, r) for n, a, r in zip(names, got, ref)}
                print(f"| {case} | {gate} | {impl} | " + " | ".join(f"{errs[n]:.2e}" for n in names) + " |")
                common.record(f"grad_accuracy_{case}_{gate}", impl, 0.0, 0.0,
                              **{f"d{n}": round(e, 7) for n, e in errs.items()})


if __name__ == "__main__":
    main()
