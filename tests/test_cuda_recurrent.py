"""The recurrent CUDA kernel against the fp64 oracle (skipped without a GPU and the extension)."""

import pytest
import torch

import flashkda
from flashkda.reference import kda_reference

from helpers import (CHUNK_TOL, HAS_CUDA_KERNELS, as_fp64_cpu, fast_spy, kernel_family, make_inputs, public_fn,
                     reference64, rel_err)

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not HAS_CUDA_KERNELS, reason="needs CUDA and the extension")]

TOL = {torch.bfloat16: 2e-3, torch.float16: 2e-3, torch.float32: 1e-5}


@pytest.fixture(params=["sm80", "sm90"], autouse=True)
def family(request):
    """Every test runs on both decode kernel families; sm90 runs the sm_80 kernel where it does not apply."""
    with kernel_family(request.param):
        yield request.param


def _poison_allocator(like: torch.Tensor, count: int = 4) -> None:
    """Fill freed cache blocks with NaN so that an output the kernel fails to write shows up."""
    blocks = [torch.full((like.numel() + 1024,), float("nan"), dtype=torch.float32, device="cuda")
              for _ in range(count)]
    del blocks


def _check(kw, kind="recurrent", gdn=False, tol=None, wrap=None, **extra):
    """`tol`: one bound for the output and the state, or an (output, state) pair; `wrap`: applied to
    the public function before the call (e.g. torch.compile)."""
    tol_o, tol_s = tol if isinstance(tol, tuple) else (tol or TOL[kw["q"].dtype],) * 2
    _poison_allocator(kw["v"])
    fn = public_fn(kind, gdn)
    o, s = (wrap(fn) if wrap is not None else fn)(**kw, output_final_state=True, **extra)
    torch.cuda.synchronize()
    ref_o, ref_s = reference64(kw, output_final_state=True)
    eo, es = rel_err(o, ref_o), rel_err(s, ref_s)
    assert eo <= tol_o, f"output error {eo:.2e} > {tol_o:.0e}"
    assert es <= tol_s, f"state error {es:.2e} > {tol_s:.0e}"
    return eo, es


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("state_v_first", [True, False])
@pytest.mark.parametrize("gate", ["lower_bound", "softplus", "precomputed"])
@pytest.mark.parametrize("D", [128, 64])
def test_kda_modes(dtype, state_v_first, gate, D):
    kw = make_inputs(lens=[1, 17, 0, 6], H=2, HV=4, D=D, gate=gate, dtype=dtype, device="cuda",
                     state_v_first=state_v_first, mask_prob=0.05)
    _check(kw)


@pytest.mark.parametrize("gate", ["lower_bound", "softplus", "precomputed"])
@pytest.mark.parametrize("state_v_first", [True, False])
def test_gdn_modes(gate, state_v_first):
    kw = make_inputs(B=3, T=5, H=2, HV=2, D=128, gate=gate, gdn=True, dtype=torch.bfloat16, device="cuda",
                     state_v_first=state_v_first)
    _check(kw, gdn=True)


@pytest.mark.parametrize("group", [1, 2, 4])
def test_gva_and_options(group):
    kw = make_inputs(B=2, T=7, H=2, HV=2 * group, D=128, gate="softplus", dtype=torch.float32, device="cuda")
    kw.update(allow_neg_eigval=True, use_qk_l2norm_in_kernel=False, scale=0.05)
    _check(kw)


def test_bf16_initial_state_and_no_state():
    kw = make_inputs(lens=[3, 9], H=1, D=128, dtype=torch.bfloat16, device="cuda", state_dtype=torch.bfloat16)
    _check(kw)
    kw.pop("initial_state")
    _check(kw)


def test_strided_inputs():
    kw = make_inputs(B=2, T=4, H=2, D=64, dtype=torch.bfloat16, device="cuda")
    big = torch.randn(2, 4, 3, 2, 64, device="cuda", dtype=torch.bfloat16)  # q, k, v fused
    kw["q"], kw["k"], kw["v"] = big[:, :, 0], big[:, :, 1], big[:, :, 2]
    assert not kw["q"].is_contiguous()
    _check(kw)


def test_prefill_long_varlen():
    """chunk_kda on CUDA with D = 64 runs on this kernel: odd lengths, an empty sequence, 1000+ tokens."""
    kw = make_inputs(lens=[1, 17, 97, 0, 1100], H=2, D=64, dtype=torch.bfloat16, device="cuda")
    _check(kw, kind="chunk")


def test_out_buffer_is_fully_written():
    kw = make_inputs(B=4, T=2, H=2, D=128, dtype=torch.bfloat16, device="cuda")
    out = torch.full_like(kw["v"], float("nan"))
    o, _ = flashkda.fused_recurrent_kda(**kw, out=out)
    assert o is out and torch.isfinite(out).all()
    ref_o, _ = reference64(kw)
    assert rel_err(out, ref_o) <= TOL[torch.bfloat16]


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("state_v_first", [True, False])
def test_serving_pool_per_sequence(pool_dtype, state_v_first):
    N, slots, D = 6, 11, 128
    kw = make_inputs(B=N, T=1, H=2, HV=4, D=D, dtype=torch.bfloat16, device="cuda", state=False,
                     state_v_first=state_v_first)
    pool = (0.1 * torch.randn(slots, 4, D, D, device="cuda")).to(pool_dtype)
    idx = torch.tensor([7, -1, 0, 3, 10, -5], dtype=torch.int32, device="cuda")
    before = pool.clone()
    ref_pool = before.double().cpu()
    ref_o, _ = kda_reference(**as_fp64_cpu(kw), initial_state=ref_pool, ssm_state_indices=idx.cpu(),
                             core="recurrent")
    out = torch.full_like(kw["v"], float("nan"))
    o, ret = flashkda.fused_recurrent_kda(**kw, initial_state=pool, ssm_state_indices=idx, out=out)
    torch.cuda.synchronize()
    assert ret is pool and o is out
    named = {7, 0, 3, 10}
    for s in range(slots):
        if s not in named:
            assert torch.equal(pool[s], before[s]), f"slot {s} was touched"
    assert torch.count_nonzero(out[1]) == 0 and torch.count_nonzero(out[5]) == 0
    tol = TOL[torch.bfloat16] if pool_dtype == torch.float32 else 1e-2
    assert rel_err(out, ref_o) <= TOL[torch.bfloat16]
    assert rel_err(pool[sorted(named)], ref_pool[sorted(named)]) <= tol


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_serving_spec_decode(index_dtype):
    """[N, T] slots with num_accepted_tokens over varlen draft lengths, padding tokens and rows."""
    D, slots = 128, 40
    lens = [3, 1, 4, 2]
    kw = make_inputs(lens=lens, H=2, HV=4, D=D, dtype=torch.bfloat16, device="cuda", state=False,
                     state_v_first=True)
    idx = torch.tensor([[1, 2, 3, -1], [4, -1, -1, -1], [-1, 5, 6, 7], [8, 9, -1, -1]], dtype=index_dtype,
                       device="cuda")
    acc = torch.tensor([2, 1, 1, 2], dtype=index_dtype, device="cuda")
    pool = 0.1 * torch.randn(slots, 4, D, D, device="cuda")
    before = pool.clone()
    ref_pool = before.double().cpu()
    ref_o, _ = kda_reference(**as_fp64_cpu(kw), initial_state=ref_pool, ssm_state_indices=idx.cpu(),
                             num_accepted_tokens=acc.cpu(), core="recurrent")
    o, _ = flashkda.fused_recurrent_kda(**kw, initial_state=pool, ssm_state_indices=idx, num_accepted_tokens=acc)
    torch.cuda.synchronize()
    assert rel_err(o, ref_o) <= TOL[torch.bfloat16]
    assert rel_err(pool, ref_pool) <= 1e-5
    for s in range(10, slots):
        assert torch.equal(pool[s], before[s])


def test_out_of_range_slot_is_skipped_on_cuda():
    kw = make_inputs(B=2, T=1, H=1, D=64, dtype=torch.bfloat16, device="cuda", state=False)
    pool = torch.randn(3, 1, 64, 64, device="cuda")
    before = pool.clone()
    idx = torch.tensor([1, 1000], dtype=torch.int32, device="cuda")
    o, _ = flashkda.fused_recurrent_kda(**kw, initial_state=pool, ssm_state_indices=idx)
    torch.cuda.synchronize()
    assert torch.count_nonzero(o[1]) == 0
    assert torch.equal(pool[0], before[0]) and torch.equal(pool[2], before[2])
    assert not torch.equal(pool[1], before[1])


def test_debug_mode_rejects_slots_beyond_the_pool(monkeypatch):
    """FLASHKDA_DEBUG turns the device-side skip of an out-of-pool slot into an error (it syncs)."""
    from flashkda import _ext

    monkeypatch.setattr(_ext.config, "debug", True)
    kw = make_inputs(B=2, T=1, H=1, D=64, dtype=torch.bfloat16, device="cuda", state=False)
    pool = torch.zeros(3, 1, 64, 64, device="cuda")
    with pytest.raises(ValueError, match="pool has 3 slots"):
        flashkda.fused_recurrent_kda(**kw, initial_state=pool,
                                     ssm_state_indices=torch.tensor([0, 3], dtype=torch.int32, device="cuda"))
    bad_cu = torch.tensor([0, 2, 1, 2], dtype=torch.int32, device="cuda")
    kw = make_inputs(B=1, T=2, H=1, D=64, dtype=torch.bfloat16, device="cuda", state=False)
    with pytest.raises(ValueError, match="non-decreasing"):
        flashkda.chunk_kda(**kw, cu_seqlens=bad_cu)


def test_cuda_graph_replay_matches_eager():
    N, D, slots = 8, 128, 16
    gen_kw = dict(B=N, T=1, H=2, HV=2, D=D, dtype=torch.bfloat16, device="cuda", state=False, state_v_first=True)
    static = make_inputs(**gen_kw)
    pool = 0.1 * torch.randn(slots, 2, D, D, device="cuda")
    idx = torch.randperm(slots, device="cuda")[:N].to(torch.int32)
    out = torch.empty_like(static["v"])
    names = ("q", "k", "v", "g", "beta")

    def step():
        flashkda.fused_recurrent_kda(**static, initial_state=pool, ssm_state_indices=idx, out=out)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()  # warm-up outside the graph
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for _ in range(3):
        fresh = make_inputs(**gen_kw)
        for n in names:
            static[n].copy_(fresh[n])
        pool_eager = pool.clone()
        o_eager, _ = flashkda.fused_recurrent_kda(**static, initial_state=pool_eager, ssm_state_indices=idx)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, o_eager)
        assert torch.equal(pool, pool_eager)


def test_torch_compile_fullgraph_matches_eager():
    N, D, slots = 4, 128, 8
    kw = make_inputs(B=N, T=1, H=2, D=D, dtype=torch.bfloat16, device="cuda", state=False, state_v_first=True)
    idx = torch.arange(N, dtype=torch.int32, device="cuda")

    def decode_step(q, k, v, g, beta, pool):
        q = q * 1.5  # surrounding work that the compiler fuses
        o, _ = flashkda.fused_recurrent_kda(q, k, v, g, beta, A_log=kw["A_log"], dt_bias=kw["dt_bias"],
                                            initial_state=pool, ssm_state_indices=idx,
                                            use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                                            use_beta_sigmoid_in_kernel=True, lower_bound=-5.0, state_v_first=True)
        return o.float().sum(-1)

    compiled = torch.compile(decode_step, fullgraph=True)
    pool_c = 0.1 * torch.randn(slots, 2, D, D, device="cuda")
    pool_e = pool_c.clone()
    args = [kw[n] for n in ("q", "k", "v", "g", "beta")]
    out_c = compiled(*args, pool_c)
    out_e = decode_step(*args, pool_e)
    torch.cuda.synchronize()
    torch.testing.assert_close(out_c, out_e)
    torch.testing.assert_close(pool_c, pool_e)


# --------------------------------------------------------------------------------------------
# The eager fast entry (flashkda._C.fused_recurrent) against the general path
# --------------------------------------------------------------------------------------------


def _serving(gdn=False, D=128, dtype=torch.bfloat16, pool_dtype=torch.float32, state_v_first=True, **extra):
    kw = make_inputs(B=5, T=1, H=2, HV=4, D=D, dtype=dtype, gdn=gdn, device="cuda", state=False,
                     state_v_first=state_v_first)
    kw.update(initial_state=(0.1 * torch.randn(13, 4, D, D, device="cuda")).to(pool_dtype),
              ssm_state_indices=torch.tensor([7, -1, 0, 12, 3], dtype=torch.int32, device="cuda"))
    kw.update(extra)
    return kw


def _spec(index_dtype=torch.int64):
    kw = make_inputs(lens=[3, 1, 2], H=2, HV=4, D=128, dtype=torch.bfloat16, device="cuda", state=False,
                     state_v_first=True)
    idx = torch.tensor([[1, 2, 3], [4, -1, -1], [5, 6, -1]], dtype=index_dtype, device="cuda")
    kw.update(initial_state=0.1 * torch.randn(9, 4, 128, 128, device="cuda"), ssm_state_indices=idx,
              num_accepted_tokens=torch.tensor([2, 1, 1], dtype=index_dtype, device="cuda"))
    return kw


FAST_CASES = {
    "decode, out=": lambda: dict(_serving(), out=torch.empty(5, 1, 4, 128, dtype=torch.bfloat16, device="cuda")),
    "decode GDN": lambda: _serving(gdn=True),
    "decode, bf16 pool, K-first, D=64": lambda: _serving(D=64, pool_dtype=torch.bfloat16, state_v_first=False),
    "decode fp16, softplus gate, dt_bias [HV, K]": lambda: dict(
        _serving(dtype=torch.float16), lower_bound=None, dt_bias=torch.randn(4, 128, device="cuda")),
    "decode fp32, precomputed gate, scale, neg eigval, no l2norm": lambda: dict(
        _serving(dtype=torch.float32), use_gate_in_kernel=False, A_log=None, dt_bias=None, scale=0.05,
        allow_neg_eigval=True, use_qk_l2norm_in_kernel=False),
    "speculative decoding, varlen, int64 indices": _spec,
    "prefill with initial and final state": lambda: dict(
        make_inputs(lens=[5, 0, 9], H=2, HV=4, D=128, dtype=torch.bfloat16, device="cuda"), output_final_state=True),
    "batch without states": lambda: make_inputs(B=3, T=4, H=2, D=64, dtype=torch.bfloat16, device="cuda",
                                                state=False),
}


@pytest.mark.parametrize("case", FAST_CASES)
def test_fast_entry_matches_the_general_path(monkeypatch, case):
    """Bit for bit: the fast entry fills the kernel's parameters as the general path does."""
    from flashkda import api

    kw = FAST_CASES[case]()
    fn = flashkda.fused_recurrent_gated_delta_rule if kw["g"].dim() == 3 else flashkda.fused_recurrent_kda
    state = kw.get("initial_state")
    kw_general = dict(kw, initial_state=None if state is None else state.clone())
    if kw.get("out") is not None:
        kw_general["out"] = torch.empty_like(kw["out"])
    answers = fast_spy(monkeypatch)
    o, s = fn(**kw)
    assert len(answers) == 1 and isinstance(answers[0], tuple), answers
    if kw.get("out") is not None:
        assert o is kw["out"]
    if kw.get("ssm_state_indices") is not None:
        assert s is kw["initial_state"]
    monkeypatch.setattr(api, "_fast", None)
    o_general, s_general = fn(**kw_general)
    torch.cuda.synchronize()
    assert torch.equal(o, o_general)
    assert (s is None) == (s_general is None)
    if s is not None:
        assert torch.equal(s, s_general)


def test_fast_entry_leaves_strided_inputs_to_the_general_path(monkeypatch):
    kw = _serving()
    kw["q"] = torch.randn(5, 1, 2, 128, 2, device="cuda").to(torch.bfloat16)[..., 0]
    answers = fast_spy(monkeypatch)
    o, _ = flashkda.fused_recurrent_kda(**kw)
    assert answers == ["q: strided last dimension of q, k, v, g or beta"]
    assert torch.isfinite(o).all()


@pytest.mark.parametrize("case", ["bad", "serving"])
def test_bad_inputs_are_rejected_on_cuda(case):
    """The contract's bad inputs on CUDA tensors: the same errors as on the CPU (the fast entry declines
    them, the general path raises). Values that only a host copy shows are not checked on CUDA."""
    import re

    from test_api import BAD_INPUTS, SERVING_BAD, VALUE_ONLY, _bad, _serving_bad

    def to_cuda(kw):
        return {n: x.cuda() if isinstance(x, torch.Tensor) else x for n, x in kw.items()}

    cases = ([(n, e, _bad(m, D=64)) for n, e, m in BAD_INPUTS] if case == "bad" else
             [(n, e, _serving_bad(x, D=64)) for n, e, x in SERVING_BAD])
    for name, exc, kw in cases:
        if VALUE_ONLY.get(name) is exc:
            continue
        with pytest.raises(exc, match=re.escape(name) if name not in ("heads", "dtype") else None):
            flashkda.fused_recurrent_kda(**to_cuda(kw))


@pytest.mark.parametrize("traced", [False, True])
@pytest.mark.parametrize("kind", ["chunk", "recurrent"])
def test_the_device_runs_the_build_or_the_reference(kind, traced):
    """Never a CUDA error for want of a kernel image: when the build has no image for this GPU (a
    build of FLASHKDA_CUDA_ARCHS=80 without PTX on an H100 / H200) device_shortfall names it and the
    calls, eager or traced by torch.compile, run the reference; otherwise the kernels run. Either
    way, the contract's result."""
    from flashkda import _ext

    device = torch.cuda.current_device()
    image = _ext._C.kernel_image_reason(device)
    shortfall = _ext.device_shortfall(device)
    assert (image is None) == (shortfall is None), (image, shortfall)
    if image is not None:
        assert "no kernel image" in image and "no kernel image" in shortfall
    kw = make_inputs(lens=[1, 17, 97], H=2, D=128, dtype=torch.bfloat16, device="cuda", state_v_first=True)
    if traced:
        torch.compiler.reset()
    _check(kw, kind=kind, tol=CHUNK_TOL[torch.bfloat16] if kind == "chunk" else None,
           wrap=torch.compile if traced else None)


@pytest.mark.parametrize("kind", ["chunk", "recurrent"])
def test_traced_calls_on_a_device_without_kernels_run_the_reference(kind, monkeypatch):
    """torch.compile asks device_shortfall while tracing, so a traced call on a GPU that cannot run
    the kernels takes the reference (with graph breaks where it reads host values), as an eager call
    does, instead of launching a kernel that is not there."""
    from flashkda import _ext

    def no_kernel(*args):
        raise AssertionError("a kernel was launched")

    monkeypatch.setattr(_ext, "device_shortfall", lambda index: "no kernel image (test)")
    for entry in ("chunk_fwd_op", "chunk_fwd_eager", "recurrent_fwd_op", "recurrent_fwd_eager"):
        monkeypatch.setattr(_ext, entry, no_kernel)
    torch.compiler.reset()
    kw = make_inputs(lens=[1, 17, 97], H=2, D=128, dtype=torch.bfloat16, device="cuda", state_v_first=True)
    fn = public_fn(kind, False)
    o, s = torch.compile(lambda **a: fn(**a, output_final_state=True))(**kw)
    ref_o, ref_s = reference64(kw, output_final_state=True)
    # the fp32 reference: output within bf16 rounding, state far below any kernel's error
    assert rel_err(o, ref_o) <= TOL[torch.bfloat16] and rel_err(s, ref_s) <= 1e-4
