"""The default family's decode kernels against the sm_80 one and the fp64 oracle: an fp32 state runs
csrc/flashkda/decode/decode_stream.cuh (any device); a bf16 state with one token per sequence in a
uniform batch csrc/flashkda/decode/decode_stream_tc.cuh (any device), other bf16 cases
csrc/flashkda/decode/decode_bulk.cuh (sm_90).

Sizes give every block of the persistent grids dozens of work items, so the bulk kernel's stage ring
wraps many times and its producer resolves several batches of 32 items, and every warp of the
stream kernels carries a prefetched item across many iterations. On a device or build without
sm_90 code the bf16 cases that decode_stream_tc.cuh does not take run the sm_80 kernel in both
families and the tests still hold.
"""

import pytest
import torch

import flashkda
from flashkda.reference import kda_reference

from helpers import HAS_CUDA_KERNELS, as_fp64_cpu, kernel_family, make_inputs, public_fn, reference64, rel_err

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not HAS_CUDA_KERNELS, reason="needs CUDA and the extension")]

TOL = {torch.bfloat16: 2e-3, torch.float16: 2e-3, torch.float32: 1e-5}
@pytest.mark.parametrize("T", [1, 3])
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
def test_families_agree_on_pool_with_padding(pool_dtype, T):
    N, H, HV, D = 600, 2, 8, 128
    slots = N + 40
    token_dtype = torch.float32 if pool_dtype == torch.float32 else torch.bfloat16
    kw = make_inputs(B=N, T=T, H=H, HV=HV, D=D, dtype=token_dtype, device="cuda", state=False, state_v_first=True)
    idx = torch.randperm(slots, device="cuda")[:N].to(torch.int32)
    idx[::7] = -1  # padding
    idx[3::11] = slots + 5  # beyond the pool: skipped like padding
    pool0 = (0.1 * torch.randn(slots, HV, D, D, device="cuda")).to(pool_dtype)

    results = {}
    for family in ("sm80", "sm90"):
        pool = pool0.clone()
        with kernel_family(family):
            o, ret = flashkda.fused_recurrent_kda(**kw, initial_state=pool, ssm_state_indices=idx)
        torch.cuda.synchronize()
        assert ret is pool
        results[family] = (o, pool)

    valid = (idx >= 0) & (idx < slots)
    named = torch.zeros(slots, dtype=torch.bool, device="cuda")
    named[idx[valid].long()] = True
    for family, (o, pool) in results.items():
        assert torch.equal(pool[~named], pool0[~named]), f"{family}: a slot not named was touched"
        assert torch.count_nonzero(o[~valid]) == 0, f"{family}: padding output is not zero"

    (o80, p80), (o90, p90) = results["sm80"], results["sm90"]
    if pool_dtype == torch.float32:  # fp32 tokens and pool: the kernels sum in different orders
        assert rel_err(o90, o80) <= 1e-6 and rel_err(p90, p80) <= 1e-6
    else:  # bf16 pool: the kernels sum in different orders, and near-cancelling outputs can differ by
        # more than one bf16 step element-wise; the fp64 checks below bound both
        assert rel_err(o90, o80) <= 4e-3 and rel_err(p90, p80) <= 4e-3

    ref_idx = torch.where(valid, idx, torch.full_like(idx, -1)).cpu()
    ref_pool = pool0.double().cpu()
    ref_o, _ = kda_reference(**as_fp64_cpu(kw), initial_state=ref_pool, ssm_state_indices=ref_idx, core="recurrent")
    state_tol = TOL[token_dtype] if pool_dtype == torch.float32 else 1e-2
    assert rel_err(o90, ref_o) <= TOL[token_dtype]
    assert rel_err(p90[named], ref_pool[named.cpu()]) <= state_tol


@pytest.mark.parametrize("case", ["bf16", "fp16", "fp32", "gdn", "softplus", "int64_slots"])
def test_bf16_pool_one_token_matches_oracle(case):
    """One token per sequence into a bf16 pool (decode_stream_tc.cuh in the default family): each
    token dtype, the scalar gate, the softplus gate, int64 slot indices, padding; against the fp64
    oracle and the sm_80 family. The tensor-core sums carry about 16 bits of each fp32 factor, hence
    1e-4 rather than 1e-5 for the output with fp32 tokens."""
    dtype = {"fp16": torch.float16, "fp32": torch.float32}.get(case, torch.bfloat16)
    gdn = case == "gdn"
    N, H, HV, D = 300, 2, 4, 128
    slots = N + 16
    kw = make_inputs(B=N, T=1, H=H, HV=HV, D=D, dtype=dtype, gdn=gdn, gate="softplus" if case == "softplus" else "lower_bound",
                     device="cuda", state=False, state_v_first=True)
    idx = torch.randperm(slots, device="cuda")[:N].to(torch.int64 if case == "int64_slots" else torch.int32)
    idx[::13] = -1
    pool0 = (0.1 * torch.randn(slots, HV, D, D, device="cuda")).to(torch.bfloat16)
    ref_pool = pool0.double().cpu()  # updated in place by the oracle
    ref_o, _ = kda_reference(**as_fp64_cpu(kw), initial_state=ref_pool, ssm_state_indices=idx.cpu(), core="recurrent")
    results = {}
    for family in ("sm80", "sm90"):
        pool = pool0.clone()
        with kernel_family(family):
            o, _ = public_fn("recurrent", gdn)(**kw, initial_state=pool, ssm_state_indices=idx)
        results[family] = (o, pool)
    torch.cuda.synchronize()
    (o80, p80), (o, pool) = results["sm80"], results["sm90"]
    unnamed = torch.ones(slots, dtype=torch.bool, device="cuda")
    unnamed[idx[idx >= 0].long()] = False
    assert torch.equal(pool[unnamed], pool0[unnamed]), "a slot not named was touched"
    assert torch.count_nonzero(o[idx < 0]) == 0, "padding output is not zero"
    assert not torch.isnan(o).any() and not torch.isnan(pool).any()
    assert rel_err(o, ref_o) <= (1e-4 if dtype == torch.float32 else TOL[dtype])
    assert rel_err(pool[~unnamed], ref_pool[~unnamed.cpu()]) <= 1e-2
    assert rel_err(o, o80) <= 4e-3 and rel_err(pool, p80) <= 4e-3


def _varlen(lens_count=300, seed=0):
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(0, 4, (lens_count,), generator=gen).tolist()  # zero-length sequences included
    lens[0], lens[-1] = 0, 2
    return lens


@pytest.mark.parametrize(
    "case", ["states", "no_initial_state", "no_final_state", "gdn", "unaligned_tokens", "fp16", "fp32", "long"]
)
def test_sm90_cases_match_oracle(case):
    """Varlen with zero-length sequences and separate initial / final states on the sm90 family
    ("long": more tokens per sequence than the sm_90 kernel takes, so the sm_80 kernel runs)."""
    dtype = {"fp16": torch.float16, "fp32": torch.float32}.get(case, torch.bfloat16)
    gdn = case == "gdn"
    lens = [40, 3, 0, 25] if case == "long" else _varlen()
    kw = make_inputs(lens=lens, H=2, HV=4, D=128, dtype=dtype, gdn=gdn, device="cuda", state_v_first=True,
                     state=case != "no_initial_state")
    if case == "unaligned_tokens":  # rows 2 bytes off 16-byte alignment: read from global memory
        for name in ("q", "k", "v"):
            x = kw[name]
            wide = torch.randn(*x.shape[:-1], x.shape[-1] + 1, device="cuda").to(x.dtype)
            wide[..., 1:] = x
            kw[name] = wide[..., 1:]
    with kernel_family("sm90"):
        o, s = public_fn("recurrent", gdn)(**kw, output_final_state=case != "no_final_state")
    torch.cuda.synchronize()
    ref_o, ref_s = reference64(kw, output_final_state=True)
    assert rel_err(o, ref_o) <= TOL[dtype]
    if case != "no_final_state":
        assert rel_err(s, ref_s) <= TOL[dtype]


def test_sm90_pool_varlen_zero_length_keeps_slot():
    """A zero-length sequence in the pool leaves its slot untouched, bit for bit."""
    lens = _varlen(200, seed=1)
    N, HV, D = len(lens), 4, 128
    slots = N + 8
    kw = make_inputs(lens=lens, H=2, HV=HV, D=D, dtype=torch.bfloat16, device="cuda", state=False,
                     state_v_first=True)
    idx = torch.randperm(slots, device="cuda")[:N].to(torch.int64)
    idx[5::9] = -1
    pool = 0.1 * torch.randn(slots, HV, D, D, device="cuda")
    before = pool.clone()
    ref_pool = before.double().cpu()
    ref_o, _ = kda_reference(**as_fp64_cpu(kw), initial_state=ref_pool, ssm_state_indices=idx.cpu(), core="recurrent")
    with kernel_family("sm90"):
        o, _ = flashkda.fused_recurrent_kda(**kw, initial_state=pool, ssm_state_indices=idx)
    torch.cuda.synchronize()
    for n, length in enumerate(lens):
        if length == 0 and idx[n] >= 0:
            assert torch.equal(pool[idx[n]], before[idx[n]]), f"zero-length sequence {n} changed its slot"
    assert rel_err(o, ref_o) <= TOL[torch.bfloat16]
    assert rel_err(pool, ref_pool) <= TOL[torch.float32]


def test_sm90_unaligned_state_falls_back():
    """A state pool 4 bytes off 16-byte alignment cannot move by bulk copy; the result is the same."""
    N, HV, D, slots = 64, 2, 128, 70
    kw = make_inputs(B=N, T=1, H=2, HV=HV, D=D, dtype=torch.bfloat16, device="cuda", state=False,
                     state_v_first=True)
    flat = torch.randn(slots * HV * D * D + 1, device="cuda") * 0.1
    pool = flat[1:].view(slots, HV, D, D)
    idx = torch.randperm(slots, device="cuda")[:N].to(torch.int32)
    ref_pool = pool.double().cpu()
    ref_o, _ = kda_reference(**as_fp64_cpu(kw), initial_state=ref_pool, ssm_state_indices=idx.cpu(), core="recurrent")
    with kernel_family("sm90"):
        o, _ = flashkda.fused_recurrent_kda(**kw, initial_state=pool, ssm_state_indices=idx)
    torch.cuda.synchronize()
    assert rel_err(o, ref_o) <= TOL[torch.bfloat16]
    assert rel_err(pool, ref_pool) <= TOL[torch.float32]


# (pool dtype, layout): sequences N, value heads HV, pool slots
SLOT_ORDER_CASES = {
    (torch.float32, "spread"): (200, 1, 8200),
    (torch.float32, "crowded"): (200, 1, 8200),
    (torch.float32, "many_sequences"): (1100, 1, 8200),
    # decode_stream_tc.cuh sorts from 16 rounds of its grid on: 40960 units, 16 rounds of 132 SMs
    (torch.bfloat16, "spread"): (1024, 20, 1088),
}


@pytest.mark.parametrize("pool_dtype,layout", list(SLOT_ORDER_CASES), ids=lambda x: str(x).replace("torch.", ""))
def test_slot_order_wide_span(pool_dtype, layout):
    """The persistent decode kernels take their sequences in slot order
    (csrc/flashkda/decode/slot_order.cuh), sorted by every block alike. Slots spread over a span wider than the sort's 1024 ranges
    ("spread": ranges shared by several sequences), nine sequences in one range ("crowded": the
    launch keeps index order), and more sequences than the sort takes ("many_sequences"); padding
    in each. Against the sm_80 family, with the output poisoned and untouched slots compared bit
    for bit. Sizes give the kernels more work units than the rounds from which they sort."""
    D = 128
    N, HV, slots = SLOT_ORDER_CASES[(pool_dtype, layout)]
    token_dtype = torch.float32 if pool_dtype == torch.float32 else torch.bfloat16
    kw = make_inputs(B=N, T=1, H=1, HV=HV, D=D, dtype=token_dtype, device="cuda", state=False, state_v_first=True)
    idx = torch.randperm(slots, device="cuda")[:N].to(torch.int32)
    idx[5::17] = -1
    if layout == "crowded":  # slots 0..8 and 8199: the first of 1024 ranges of [0, 8199] holds nine
        live = torch.nonzero(idx >= 0).flatten()
        fill = torch.randperm(slots - 17, device="cuda")[: live.numel()].to(torch.int32) + 16
        fill[:9] = torch.arange(9, device="cuda", dtype=torch.int32)
        fill[9] = slots - 1
        idx[live] = fill
    pool0 = (0.1 * torch.randn(slots, HV, D, D, device="cuda")).to(pool_dtype)
    results = {}
    for family in ("sm80", "sm90"):
        pool = pool0.clone()
        out = torch.full_like(kw["v"], float("nan"))
        with kernel_family(family):
            flashkda.fused_recurrent_kda(**kw, initial_state=pool, ssm_state_indices=idx, out=out)
        results[family] = (out, pool)
    torch.cuda.synchronize()
    named = torch.zeros(slots, dtype=torch.bool, device="cuda")
    named[idx[idx >= 0].long()] = True
    (o80, p80), (o90, p90) = results["sm80"], results["sm90"]
    assert not torch.isnan(o90).any(), "an output row was not written"
    assert torch.equal(p90[~named], pool0[~named]), "a slot not named was touched"
    assert torch.count_nonzero(o90[idx < 0]) == 0, "padding output is not zero"
    tol = 1e-6 if pool_dtype == torch.float32 else 4e-3
    assert rel_err(o90, o80) <= tol and rel_err(p90[named], p80[named]) <= tol


def _served_kernels(fn) -> set:
    """Names of the CUDA kernels that ``fn()`` launches (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return {e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA}


# (token dtype, pool dtype, tokens per sequence, V-first, head dim) -> the kernel decode_select.h picks
# on an sm_90 device with the default family.
SELECTED = {
    "fp32_pool_one_token": ((torch.float32, torch.float32, 1, True, 128), "decode_step_stream"),
    "bf16_pool_one_token": ((torch.bfloat16, torch.bfloat16, 1, True, 128), "decode_step_stream_tc"),
    "bf16_pool_two_tokens": ((torch.bfloat16, torch.bfloat16, 2, True, 128), "decode_step_bulk"),
    "fp32_pool_long": ((torch.float32, torch.float32, 20, True, 128), "decode_step_vfirst"),
    "k_first": ((torch.float32, torch.float32, 1, False, 128), "decode_step_kfirst"),
    "head_dim_64": ((torch.float32, torch.float32, 1, True, 64), "decode_step_vfirst"),
}


@pytest.mark.parametrize("case", list(SELECTED))
def test_selected_kernel_serves(case):
    """The kernel that decode_select.h's rule names for a call is the one the profiler sees (and only
    that decode kernel)."""
    (token_dtype, pool_dtype, T, v_first, D), want = SELECTED[case]
    if want == "decode_step_bulk" and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the bulk kernel needs sm_90")
    N, H, slots = 64, 2, 80
    kw = make_inputs(B=N, T=T, H=H, D=D, dtype=token_dtype, device="cuda", state=False, state_v_first=v_first)
    idx = torch.randperm(slots, device="cuda")[:N].to(torch.int32)
    pool = (0.1 * torch.randn(slots, H, D, D, device="cuda")).to(pool_dtype)
    names = _served_kernels(lambda: flashkda.fused_recurrent_kda(**kw, initial_state=pool, ssm_state_indices=idx))
    decode = {n for n in names if "decode_step_" in n}
    assert len(decode) == 1 and f"{want}<" in next(iter(decode)), f"{case}: {sorted(decode)}"
