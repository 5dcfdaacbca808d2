"""Small fused_recurrent_kda calls for compute-sanitizer, one per decode kernel:

    compute-sanitizer --tool memcheck  python tests/sanitize_decode.py
    compute-sanitizer --tool racecheck python tests/sanitize_decode.py

In both kernel families: an fp32 pool with one token per sequence (decode_stream.cuh with its L2
prefetch) and with three (without), an fp32 pool with token rows off 16-byte alignment
(decode_bulk.cuh), a bf16 pool with one token (decode_stream_tc.cuh), with two and varlen with
zero-length sequences (decode_bulk.cuh), and a K-first state; pools with padding slots. Two of the
stream cases have more work units than one round of the grid, so their blocks sort the slots
(slot_order.cuh). The decode_bulk.cuh cases have about 2000 work items, so that every block of its
persistent grid (at most 2 per SM) takes more items than its ring has stages and reuses them.
"""

import torch

import flashkda
from flashkda import _ext

from helpers import make_inputs


def unaligned(kw):
    """q, k, v as views 2 bytes off 16-byte alignment."""
    for name in ("q", "k", "v"):
        x = kw[name]
        wide = torch.empty(*x.shape[:-1], x.shape[-1] + 1, device=x.device, dtype=x.dtype)
        wide[..., 1:] = x
        kw[name] = wide[..., 1:]
    return kw


def pool_call(pool_dtype, T=1, lens=None, misalign=False, N=40, HV=2, D=128):
    if lens is not None:
        N = len(lens)
    kw = make_inputs(B=N, T=T, lens=lens, H=1, HV=HV, D=D,
                     dtype=torch.bfloat16, device="cuda", state=False, state_v_first=True)
    if misalign:
        kw = unaligned(kw)
    slots = N + 4
    idx = torch.randperm(slots, device="cuda")[:N].to(torch.int32)
    idx[::7] = -1
    pool = (0.1 * torch.randn(slots, HV, D, D, device="cuda")).to(pool_dtype)
    flashkda.fused_recurrent_kda(**kw, initial_state=pool, ssm_state_indices=idx)


if __name__ == "__main__":
    for family in ("sm80", "sm90"):
        _ext.set_kernel_family(family)
        pool_call(torch.float32, T=1)
        pool_call(torch.float32, T=1, N=200, HV=2)  # 6400 items: the later rounds in slot order
        pool_call(torch.float32, T=3)
        pool_call(torch.float32, T=1, misalign=True, N=64, HV=8)  # 32-row items: 2048
        pool_call(torch.bfloat16, T=1)
        pool_call(torch.bfloat16, T=1, N=1024, HV=20)  # 40960 units, 16 rounds: the later in slot order
        pool_call(torch.bfloat16, T=2, N=128, HV=8)  # 64-row items: 2048
        pool_call(torch.bfloat16, lens=[1, 0, 3, 2, 0, 1, 1, 2] * 16, HV=8)
        kw = make_inputs(B=8, T=2, H=1, HV=2, D=128, dtype=torch.bfloat16, device="cuda", state_v_first=False)
        flashkda.fused_recurrent_kda(**kw, output_final_state=True)
    torch.cuda.synchronize()
    print("sanitize_decode: done")
