"""States at chunk starts from the chunked prefill (prefix caching): ``return_intermediate_states``
(FLA's ``h``) and checkpoints written into a state pool (``checkpoint_pool`` / ``checkpoint_slots``);
the prefill reading and writing its states in pool slots (``ssm_state_indices`` /
``has_initial_state``).

CPU tests pin the semantics on the reference; GPU tests check the kernels against the fp64 oracle at
every chunk start (bf16 ``h``: the final-state bounds of the prefill), on freshly poisoned memory,
and resume a prefill from a checkpoint.
"""

import pytest
import torch

import flashkda
from flashkda import _constants as C
from flashkda import _ext

from helpers import HAS_CUDA_KERNELS, make_inputs, public_fn, reference64, rel_err

CHUNK = C.CHUNK_STATE_TOKENS
LENS = [1, 17, 0, 97, 64, 1000, 65]


def _entries(lens):
    return [-(-n // CHUNK) for n in lens]


def _oracle_h(kw, gdn, lens):
    """The fp64 state before every chunk of every sequence, [NT, HV, ...] in the call's layout."""
    NT = sum(_entries(lens))
    HV, D = kw["v"].shape[2], kw["v"].shape[3]
    h = torch.empty(NT, HV, D, D, dtype=torch.float64)
    reference64(kw, gdn=gdn, chunk_states=h)
    return h


def _check_h(h, ref, tol):
    assert torch.isfinite(h).all()
    err = rel_err(h.reshape(ref.shape), ref)
    assert err <= tol, f"h error {err:.2e} > {tol:.1e}"


# ------------------------------------------------------------------------------------------ CPU


@pytest.mark.parametrize("gdn", [False, True])
@pytest.mark.parametrize("state_v_first", [True, False])
def test_reference_h_is_the_state_at_every_chunk_start(gdn, state_v_first):
    kw = make_inputs(lens=LENS, H=2, HV=4, D=16, gdn=gdn, state_v_first=state_v_first, seed=3)
    o, s, h = public_fn("chunk", gdn)(**kw, output_final_state=True, return_intermediate_states=True)
    NT = sum(_entries(LENS))
    assert h.shape == (1, NT, 4, 16, 16) and h.dtype == kw["k"].dtype
    # h[:, first chunk of n] is sequence n's initial state; the rest: the state after 64 j tokens.
    firsts = torch.tensor([0, *_entries(LENS)]).cumsum(0)[:-1]
    for n, L in enumerate(LENS):
        if L:
            assert torch.equal(h[0, firsts[n]], kw["initial_state"][n])
    o2, s2 = public_fn("chunk", gdn)(**kw, output_final_state=True)
    assert torch.equal(o, o2) and torch.equal(s, s2)
    _check_h(h, _oracle_h(kw, gdn, LENS), 1e-5)


def test_reference_h_batched_shape():
    kw = make_inputs(B=2, T=130, H=2, D=16, seed=4)
    _, _, h = flashkda.chunk_kda(**kw, return_intermediate_states=True)
    assert h.shape == (2, 3, 2, 16, 16)


def test_checkpoint_slots_semantics_cpu():
    """Slot checkpoints: chunk j of sequence n to pool slot slots[n, j]; negative slots and columns
    past a sequence's chunks write nothing; unnamed slots stay bit-identical."""
    lens = [200, 0, 70]
    kw = make_inputs(lens=lens, H=2, D=16, state_v_first=True, seed=5)
    pool = torch.full((8, 2, 16, 16), 1e30)
    slots = torch.tensor([[-1, 3, 5, 6, 7], [0, -1, -1, -1, -1], [-1, 1, 2, -1, -1]], dtype=torch.int32)
    flashkda.chunk_kda(**kw, checkpoint_pool=pool, checkpoint_slots=slots)
    _, _, h = flashkda.chunk_kda(**kw, return_intermediate_states=True)
    # dense entries: sequence 0 has chunks 0..3, sequence 1 none, sequence 2 chunks 0..1
    for slot, entry in ((3, 1), (5, 2), (6, 3), (1, 5)):
        assert torch.equal(pool[slot], h[0, entry])
    for slot in (0, 2, 4, 7):  # 0: a sequence without chunks; 2: past sequence 2's chunks
        assert (pool[slot] == 1e30).all()


def test_chunk_state_arguments_are_checked():
    kw = make_inputs(lens=[5, 9], H=2, D=16, state_v_first=True, seed=6)
    pool = torch.zeros(4, 2, 16, 16)
    with pytest.raises(ValueError, match="checkpoint_slots"):
        flashkda.chunk_kda(**kw, checkpoint_pool=pool, checkpoint_slots=torch.zeros(3, 2, dtype=torch.int32))
    with pytest.raises(ValueError, match="checkpoint_pool"):
        flashkda.chunk_kda(**kw, checkpoint_pool=torch.zeros(4, 2, 8, 16), checkpoint_slots=torch.zeros(2, 2,
                                                                                                     dtype=torch.int32))
    with pytest.raises(TypeError, match="checkpoint_pool"):
        flashkda.chunk_kda(**kw, checkpoint_pool=pool.double(), checkpoint_slots=torch.zeros(2, 2, dtype=torch.int32))
    with pytest.raises(ValueError, match="not both"):
        flashkda.chunk_kda(**kw, return_intermediate_states=True, checkpoint_pool=pool,
                           checkpoint_slots=torch.zeros(2, 2, dtype=torch.int32))


# Pool slots of the serving prefill: sequence 0 -> slot 4, 1 (empty) -> slot 1, 2 padding, 3 a new
# sequence (from zeros, whatever slot 0 holds) -> slot 0, 4 -> slot 3; slots 2 and 5 unnamed.
SERVING_LENS = [200, 0, 70, 33, 1000]
SERVING_SLOTS = [4, 1, -1, 0, 3]
SERVING_HAS_INITIAL = [True, True, True, False, True]


def _serving_case(kw, pool_dtype):
    """(pool, idx, has_initial_state, the equivalent gathered initial states)."""
    N, (HV, D) = len(SERVING_LENS), kw["v"].shape[2:]
    dev = kw["q"].device
    pool = (0.1 * torch.randn(6, HV, D, D, generator=torch.Generator().manual_seed(11))).to(dev, pool_dtype)
    idx = torch.tensor(SERVING_SLOTS, dtype=torch.int32, device=dev)
    has = torch.tensor(SERVING_HAS_INITIAL, device=dev)
    gathered = torch.zeros(N, HV, D, D, dtype=pool_dtype, device=dev)
    for n, (slot, h) in enumerate(zip(SERVING_SLOTS, SERVING_HAS_INITIAL)):
        if slot >= 0 and h:
            gathered[n] = pool[slot]
    return pool, idx, has, gathered


def _check_serving(kw, gdn, pool, before, o, final, o_ref, final_ref, tol):
    """o and the pool against the gathered call (o_ref, final_ref [N, ...]): the padding sequence's
    output is zero, its slot and the unnamed ones are untouched."""
    assert final is pool
    bounds = [0, *torch.tensor(SERVING_LENS).cumsum(0).tolist()]
    for n, slot in enumerate(SERVING_SLOTS):
        seg = slice(bounds[n], bounds[n + 1])
        if slot < 0:
            assert (o[:, seg] == 0).all()
            continue
        assert rel_err(o[:, seg], o_ref[:, seg]) <= tol
        assert rel_err(pool[slot].float(), final_ref[n].float()) <= tol
    for slot in set(range(pool.shape[0])) - {s for s in SERVING_SLOTS if s >= 0}:
        assert torch.equal(pool[slot], before[slot])


@pytest.mark.parametrize("gdn", [False, True])
def test_reference_prefill_from_pool_slots(gdn):
    kw = make_inputs(lens=SERVING_LENS, H=2, D=16, gdn=gdn, state_v_first=True, seed=12)
    pool, idx, has, gathered = _serving_case(kw, torch.float32)
    before = pool.clone()
    o_ref, final_ref = public_fn("chunk", gdn)(**dict(kw, initial_state=gathered), output_final_state=True)
    o, final = public_fn("chunk", gdn)(**dict(kw, initial_state=pool), ssm_state_indices=idx,
                                       has_initial_state=has)
    o_ref[:, SERVING_LENS[0] + SERVING_LENS[1]:sum(SERVING_LENS[:3])] = 0
    _check_serving(kw, gdn, pool, before, o, final, o_ref, final_ref, 1e-6)


def test_serving_prefill_arguments_are_checked():
    kw = make_inputs(lens=[5, 9], H=2, D=16, seed=13)
    pool = torch.zeros(4, 2, 16, 16)
    idx = torch.tensor([0, 2])
    with pytest.raises(ValueError, match=r"ssm_state_indices .*\[N\]"):
        flashkda.chunk_kda(**dict(kw, initial_state=pool), ssm_state_indices=idx[:, None])
    with pytest.raises(ValueError, match="has_initial_state needs ssm_state_indices"):
        flashkda.chunk_kda(**kw, has_initial_state=torch.tensor([True, False]))
    with pytest.raises(TypeError, match="has_initial_state"):
        flashkda.chunk_kda(**dict(kw, initial_state=pool), ssm_state_indices=idx, has_initial_state=idx)
    with pytest.raises(ValueError, match="has_initial_state"):
        flashkda.chunk_kda(**dict(kw, initial_state=pool), ssm_state_indices=idx,
                           has_initial_state=torch.tensor([True]))
    with pytest.raises(ValueError, match="ssm_state_indices names slot 7"):
        flashkda.chunk_kda(**dict(kw, initial_state=pool), ssm_state_indices=torch.tensor([0, 7]))


# ------------------------------------------------------------------------------------------ GPU

cuda = pytest.mark.skipif(not HAS_CUDA_KERNELS, reason="needs CUDA and the extension")
# bf16 h: the final-state bound of the prefill (tests/test_cuda_chunk.py); fp16: its fp16 bound.
H_TOL = {torch.bfloat16: 5e-3, torch.float16: 2e-3}


def _poison():
    blocks = [torch.full((1 << 22,), float("nan"), device="cuda") for _ in range(4)]
    del blocks


@cuda
@pytest.mark.parametrize("family", ["sm80", "sm90"])
@pytest.mark.parametrize("case", ["kda_vfirst_bf16", "kda_kfirst_fp16", "gdn_gva", "segmented"])
def test_gpu_h_against_fp64_at_every_chunk_start(monkeypatch, family, case):
    gdn = case == "gdn_gva"
    dtype = torch.float16 if "fp16" in case else torch.bfloat16
    kw = make_inputs(lens=LENS, H=2, HV=4 if gdn else 2, D=128, gdn=gdn, dtype=dtype, device="cuda",
                     state_v_first=case != "kda_kfirst_fp16", seed=7)
    if case == "segmented":
        monkeypatch.setattr(_ext.config, "chunk_segment", 2)
    with _ext.kernel_family(family):
        _poison()
        o, s, h = public_fn("chunk", gdn)(**kw, output_final_state=True, return_intermediate_states=True)
        o2, s2 = public_fn("chunk", gdn)(**kw, output_final_state=True)
    torch.cuda.synchronize()
    assert h.dtype == dtype and h.shape[1] == sum(_entries(LENS))
    assert torch.equal(o, o2) and torch.equal(s, s2)  # keeping the states changes nothing else
    _check_h(h, _oracle_h(kw, gdn, LENS), H_TOL[dtype])


@cuda
@pytest.mark.parametrize("state_v_first", [True, False])
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
def test_gpu_checkpoints_into_a_pool(pool_dtype, state_v_first):
    lens = [1000, 0, 130, 17]
    kw = make_inputs(lens=lens, H=2, D=128, dtype=torch.bfloat16, device="cuda", state_v_first=state_v_first,
                     seed=8)
    pool = torch.full((10, 2, 128, 128), 1e30, dtype=pool_dtype, device="cuda")
    before = pool.clone()
    # every 512 tokens of sequence 0 (chunk 8), chunks 1 and 2 of sequence 2, nothing else
    slots = torch.full((4, 16), -1, dtype=torch.int32)
    slots[0, 8], slots[2, 1], slots[2, 2], slots[3, 0] = 4, 7, 2, 9
    flashkda.chunk_kda(**kw, checkpoint_pool=pool, checkpoint_slots=slots.cuda())
    _, _, h = flashkda.chunk_kda(**kw, return_intermediate_states=True)
    firsts = torch.tensor([0, *_entries(lens)]).cumsum(0)[:-1].tolist()
    for slot, n, j in ((4, 0, 8), (7, 2, 1), (2, 2, 2), (9, 3, 0)):
        want = h[0, firsts[n] + j].float()
        got = pool[slot].float()
        assert rel_err(got, want) <= (1e-2 if pool_dtype == torch.bfloat16 else 1e-2)
    named = {4, 7, 2, 9}
    for slot in range(10):
        if slot not in named:
            assert torch.equal(pool[slot], before[slot])


@cuda
def test_gpu_resume_from_a_checkpoint():
    """Prefill 1000 tokens with a checkpoint at 512, prefill tokens 512..999 again from it: outputs
    and final state agree with the single run within the prefill's accuracy, and decoding continues
    the same from either state."""
    kw = make_inputs(B=1, T=1000, H=2, D=128, dtype=torch.bfloat16, device="cuda", state_v_first=True, seed=9)
    pool = torch.zeros(2, 2, 128, 128, device="cuda")
    slots = torch.full((1, 16), -1, dtype=torch.int32, device="cuda")
    slots[0, 512 // CHUNK] = 1
    o, s = flashkda.chunk_kda(**kw, output_final_state=True, checkpoint_pool=pool, checkpoint_slots=slots)
    tail = {n: (x[:, 512:] if isinstance(x, torch.Tensor) and x.dim() >= 3 and x.shape[1] == 1000 else x)
            for n, x in kw.items()}
    tail["initial_state"] = pool[1:2]
    o2, s2 = flashkda.chunk_kda(**tail, output_final_state=True)
    assert rel_err(o2, o[:, 512:]) <= 5e-3 and rel_err(s2, s) <= 5e-3
    ref_o, ref_s = reference64(kw, output_final_state=True)
    assert rel_err(o2, ref_o[:, 512:]) <= 6e-3 and rel_err(s2, ref_s) <= 5e-3
    step = make_inputs(B=1, T=1, H=2, D=128, dtype=torch.bfloat16, device="cuda", state=False, seed=10)
    step = {n: x for n, x in step.items() if n not in ("state_v_first",)}
    d1, _ = flashkda.fused_recurrent_kda(**step, initial_state=s, state_v_first=True)
    d2, _ = flashkda.fused_recurrent_kda(**step, initial_state=s2, state_v_first=True)
    assert rel_err(d2, d1) <= 5e-3


@cuda
@pytest.mark.parametrize("family", ["sm80", "sm90"])
@pytest.mark.parametrize("case", ["kda_fp32_pool", "kda_bf16_pool_kfirst", "gdn", "segmented"])
def test_gpu_prefill_from_pool_slots(monkeypatch, family, case):
    """The serving prefill against the same call on gathered states: outputs and final states
    bit-identical, the padding sequence's output zero and its h entries zero, unnamed slots
    untouched; and against the fp64 oracle."""
    gdn = case == "gdn"
    pool_dtype = torch.bfloat16 if "bf16" in case else torch.float32
    kw = make_inputs(lens=SERVING_LENS, H=2, D=128, gdn=gdn, dtype=torch.bfloat16, device="cuda",
                     state_v_first=case != "kda_bf16_pool_kfirst", seed=14)
    if case == "segmented":
        monkeypatch.setattr(_ext.config, "chunk_segment", 2)
    pool, idx, has, gathered = _serving_case(kw, pool_dtype)
    before = pool.clone()
    fn = public_fn("chunk", gdn)
    with _ext.kernel_family(family):
        o_ref, final_ref = fn(**dict(kw, initial_state=gathered), output_final_state=True)
        _poison()
        o, final, h = fn(**dict(kw, initial_state=pool), ssm_state_indices=idx, has_initial_state=has,
                         return_intermediate_states=True)
    torch.cuda.synchronize()
    pad = slice(sum(SERVING_LENS[:2]), sum(SERVING_LENS[:3]))
    o_ref[:, pad] = 0
    _check_serving(kw, gdn, pool, before, o, final, o_ref, final_ref.to(pool_dtype), 0.0)
    firsts = torch.tensor([0, *_entries(SERVING_LENS)]).cumsum(0).tolist()
    assert (h[0, firsts[2]:firsts[3]] == 0).all()
    ref_o, ref_s = reference64(dict(kw, initial_state=gathered), gdn=gdn, output_final_state=True)
    assert rel_err(o[:, :pad.start], ref_o[:, :pad.start]) <= 6e-3
    assert rel_err(final_ref, ref_s) <= 5e-3
