"""A small varlen chunk_kda / chunk_gated_delta_rule call for compute-sanitizer:

    compute-sanitizer --tool memcheck  python tests/sanitize_chunk.py
    compute-sanitizer --tool racecheck python tests/sanitize_chunk.py

Lengths 1, 15, 16, 17, 0, 97 with GVA, a bf16 initial state, masks (exact diagonal path) and
every value split and kernel family, whole chains and segments of one chunk (the local pass, the
segment scan, the output pass), states at chunk starts (dense, and into a pool by int32 and int64
slots) and the serving form (pool slots, a padding slot, has_initial_state), so every code path of
the chunked kernels runs once. Then the backward's kernels under autograd: a bf16 varlen call (the
per-token passes, the forward kernels again, chunk_state_grad, the gradients pass) and an fp32 one
(the transitions pass and the scans instead), with GVA and V-first states; and a bf16 varlen
chunk_gated_delta_rule call with GVA and one without (the scalar gate's gradients pass, the latter
on the raw q and k); each with the gradients pass whole and in value halves (the sm_80 family).
"""

import torch

import flashkda
from flashkda import _ext

from helpers import grads_of, make_inputs

if __name__ == "__main__":
    for family, split, segment in [(f, s, g) for f in ("sm80", "sm90") for s in (1, 2) for g in (0, 1)]:
        _ext.set_kernel_family(family)
        _ext.config.chunk_value_split = split
        _ext.config.chunk_segment = segment
        for gate in ("lower_bound", "precomputed"):
            kw = make_inputs(lens=[1, 15, 16, 17, 0, 97], H=1, HV=2, D=128, gate=gate, dtype=torch.bfloat16,
                             device="cuda", state_dtype=torch.bfloat16, mask_prob=0.2)
            flashkda.chunk_kda(**kw, output_final_state=True)
        kw = make_inputs(lens=[5, 70], H=1, D=128, gdn=True, dtype=torch.float16, device="cuda")
        flashkda.chunk_gated_delta_rule(**kw, output_final_state=True)
        flashkda.chunk_gated_delta_rule(**kw, return_intermediate_states=True)
        kw = make_inputs(lens=[130, 0, 64, 3], H=1, D=128, dtype=torch.bfloat16, device="cuda",
                         state_v_first=segment == 0)
        for idx_type in (torch.int32, torch.int64):
            ckpt = torch.tensor([[-1, 1, 2], [0, 3, 3], [-1, 3, -1], [4, -1, -1]], dtype=idx_type, device="cuda")
            flashkda.chunk_kda(**kw, checkpoint_pool=torch.zeros(5, 1, 128, 128, device="cuda"), checkpoint_slots=ckpt)
        pool = torch.zeros(6, 1, 128, 128, device="cuda", dtype=torch.bfloat16)
        flashkda.chunk_kda(**dict(kw, initial_state=pool), ssm_state_indices=torch.tensor([5, 0, -1, 2], device="cuda"),
                           has_initial_state=torch.tensor([True, False, True, True], device="cuda"),
                           return_intermediate_states=True)
    _ext.set_kernel_family("auto")
    _ext.config.chunk_value_split, _ext.config.chunk_segment = 0, -1  # the library's own choices
    if _ext.chunk_bwd_shortfall(torch.cuda.current_device(), transitions=True) is None:
        for family in ("auto", "sm80"):  # the gradients pass whole, and in value halves
            with _ext.kernel_family(family):
                for dtype in (torch.bfloat16, torch.float32):
                    kw = make_inputs(lens=[1, 17, 0, 97], H=1, HV=2, D=128, gate="lower_bound", dtype=dtype,
                                     device="cuda", state_v_first=True, seed=1)
                    grads_of(flashkda.chunk_kda, kw, torch.randn_like(kw["v"]), torch.randn_like(kw["initial_state"]),
                             output_final_state=True)
                for H in (1, 2):  # the scalar gate's gradients pass, with GVA and on the raw q and k
                    kw = make_inputs(lens=[1, 17, 0, 97], H=H, HV=2, D=128, gdn=True, dtype=torch.bfloat16,
                                     device="cuda", state_v_first=True, seed=2)
                    grads_of(flashkda.chunk_gated_delta_rule, kw, torch.randn_like(kw["v"]),
                             torch.randn_like(kw["initial_state"]), output_final_state=True)
    torch.cuda.synchronize()
    print("sanitize_chunk: done")
