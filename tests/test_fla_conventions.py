"""FLA 0.6's calling conventions (docs/SPEC.md, "Tensors" and "Keywords"), for all four public functions.

A. Gate parameters and inputs in the forms FLA accepts (A_log / dt_bias of any float dtype and shape
   holding the right number of elements, raw g and beta in any float dtype): accepted on every device,
   and on CUDA served by the kernels (the PyTorch reference is forbidden by a spy), checked against
   the fp64 oracle computed from the same rounded values.
B. No keyword is silently ignored: unknown ones raise TypeError, FLA's keywords that cannot change a
   forward result give identical results, the ones flashkda does not implement raise.
C. FLA's registry: the verifiers take FLA-layer parameters (bf16 A_log [1, 1, HV, 1], dt_bias [HV, K]).
D. GPU: FLA's conventions end to end (prefill, decode from a slot pool, masks, head dims flashkda
   leaves to FLA, both state layouts, pool slots that must stay untouched).
"""

import pytest
import torch

import flashkda
from flashkda import api

from helpers import HAS_CUDA_KERNELS, make_inputs, public_fn, reference64, rel_err

BF16, FP16, FP32, FP64 = torch.bfloat16, torch.float16, torch.float32, torch.float64
needs_cuda = pytest.mark.skipif(not HAS_CUDA_KERNELS, reason="needs CUDA and flashkda's extension")
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, needs_cuda])]
FUNCTIONS = {"chunk_kda": ("chunk", False), "fused_recurrent_kda": ("recurrent", False),
             "chunk_gated_delta_rule": ("chunk", True), "fused_recurrent_gated_delta_rule": ("recurrent", True)}
TOL = 1e-2  # bf16 / fp16 inputs or parameters, against the fp64 oracle of the same rounded values


def gpu(test):
    return pytest.mark.cuda(needs_cuda(test))


def _inputs(device, gdn=False, **kw):
    """K = V = 128 (the kernels' size), GVA, varlen with an empty sequence and a partial 64-token chunk."""
    kw = {"lens": [5, 0, 70], "dtype": BF16, "seed": 0, **kw}
    return make_inputs(H=2, HV=4, D=128, gdn=gdn, device=device, **kw)


def _set_params(kw, dtype, a_shape, dt_shape, gdn=False):
    """A_log / dt_bias of make_inputs (fp32 [HV] / [HV*K]) in another dtype and shape."""
    HV, K = kw["v"].shape[2], kw["q"].shape[3]
    kw["A_log"] = kw["A_log"].to(dtype).reshape(a_shape(HV)).contiguous()
    kw["dt_bias"] = kw["dt_bias"].to(dtype).reshape((HV,) if gdn else dt_shape(HV, K)).contiguous()
    return kw


def _fla_layer_params(kw, dtype=BF16, gdn=False):
    """The parameters as serving stacks hold them: A_log [1, 1, HV, 1], dt_bias [HV, K] (GDN: [HV])."""
    return _set_params(kw, dtype, lambda HV: (1, 1, HV, 1), lambda HV, K: (HV, K), gdn)


def _oracle(kw, **extra):
    """helpers.reference64 with A_log / dt_bias flattened to the reference's [HV] / [HV*K]: the same
    (rounded) values, in fp64."""
    kw = {n: (x.reshape(-1) if n in ("A_log", "dt_bias") and x is not None else x) for n, x in kw.items()}
    return reference64(kw, **extra)


def _forbid_reference(monkeypatch, device):
    """On CUDA the kernels must serve the call: the PyTorch reference (flashkda.api.kda_reference) fails."""
    if device == "cuda":
        def forbidden(*args, **kwargs):
            raise AssertionError("served by the PyTorch reference, not by the CUDA kernels")

        monkeypatch.setattr(api, "kda_reference", forbidden)


def _poison_cuda(numel):
    """Fill freed cache blocks with NaN, so that an output the kernels leave unwritten shows up."""
    for n in (numel + 1024, 1 << 22):
        blocks = [torch.full((n,), float("nan"), device="cuda") for _ in range(4)]
        del blocks


def _check(kind, gdn, kw, tol=TOL, **extra):
    """One call with output_final_state (recurrent calls write a NaN-filled out=) against the oracle."""
    if kw["q"].is_cuda:
        _poison_cuda(kw["v"].numel())
    out = torch.full_like(kw["v"], float("nan")) if kind == "recurrent" else None
    if out is not None:
        extra["out"] = out
    o, s = public_fn(kind, gdn)(**kw, output_final_state=True, **extra)
    assert out is None or o is out
    ref_o, ref_s = _oracle(kw, output_final_state=True)
    eo, es = rel_err(o, ref_o), rel_err(s, ref_s)
    assert eo <= tol and es <= tol, f"output error {eo:.2e}, state error {es:.2e} (tolerance {tol:.0e})"
    return o, s


# ---------------------------------------------------------------------------------------------- A

PARAM_FORMS = {  # dtype of A_log and dt_bias, A_log shape, KDA dt_bias shape (GDN: always [HV])
    "fp32-[HV]-[HV*K]": (FP32, lambda HV: (HV,), lambda HV, K: (HV * K,)),
    "bf16-[1,1,HV,1]-[HV,K]": (BF16, lambda HV: (1, 1, HV, 1), lambda HV, K: (HV, K)),
    "fp16-[HV,1]-[HV*K]": (FP16, lambda HV: (HV, 1), lambda HV, K: (HV * K,)),
    "fp64-[HV]-[HV,K]": (FP64, lambda HV: (HV,), lambda HV, K: (HV, K)),
    "bf16-[HV]-[HV*K]": (BF16, lambda HV: (HV,), lambda HV, K: (HV * K,)),
}


@pytest.mark.parametrize("form", PARAM_FORMS)
@pytest.mark.parametrize("gate", ["lower_bound", "softplus"])
@pytest.mark.parametrize("name", FUNCTIONS)
@pytest.mark.parametrize("device", DEVICES)
def test_gate_parameters_in_any_float_dtype_and_shape(monkeypatch, device, name, gate, form):
    kind, gdn = FUNCTIONS[name]
    kw = _set_params(_inputs(device, gdn, gate=gate), *PARAM_FORMS[form], gdn=gdn)
    _forbid_reference(monkeypatch, device)
    _check(kind, gdn, kw)


INPUT_DTYPES = {  # q/k/v, raw g, beta
    "bf16-g_fp32": (BF16, FP32, BF16),
    "bf16-g_bf16-beta_fp32": (BF16, BF16, FP32),
    "bf16-g_fp16-beta_fp16": (BF16, FP16, FP16),
    "fp16-g_fp16": (FP16, FP16, FP16),
    "fp16-g_fp32-beta_bf16": (FP16, FP32, BF16),
    "bf16-beta_fp64": (BF16, BF16, FP64),
}


@pytest.mark.parametrize("dtypes", INPUT_DTYPES)
@pytest.mark.parametrize("gate", ["lower_bound", "softplus"])
@pytest.mark.parametrize("name", FUNCTIONS)
@pytest.mark.parametrize("device", DEVICES)
def test_raw_gate_and_beta_in_any_float_dtype(monkeypatch, device, name, gate, dtypes):
    kind, gdn = FUNCTIONS[name]
    dtype, g_dtype, beta_dtype = INPUT_DTYPES[dtypes]
    kw = _inputs(device, gdn, gate=gate, dtype=dtype, seed=1)
    kw["g"], kw["beta"] = kw["g"].to(g_dtype), kw["beta"].to(beta_dtype)
    _forbid_reference(monkeypatch, device)
    _check(kind, gdn, kw)


BAD_PARAMS = [  # (argument, GDN?, bad value from HV, K): a wrong number of elements, whatever the dtype
    ("A_log", False, lambda HV, K: torch.zeros(HV + 1)),
    ("A_log", False, lambda HV, K: torch.zeros(2, HV, dtype=BF16)),
    ("A_log", True, lambda HV, K: torch.zeros(1, 1, HV - 1, 1, dtype=BF16)),
    ("dt_bias", False, lambda HV, K: torch.zeros(HV)),  # GDN's shape given to KDA
    ("dt_bias", False, lambda HV, K: torch.zeros(HV, K + 1, dtype=BF16)),
    ("dt_bias", True, lambda HV, K: torch.zeros(HV * K, dtype=FP16)),  # KDA's shape given to GDN
]


@pytest.mark.parametrize("kind", ["chunk", "recurrent"])
@pytest.mark.parametrize("arg,gdn,bad", BAD_PARAMS, ids=[f"{a}-{'gdn' if g else 'kda'}-{i}"
                                                        for i, (a, g, _) in enumerate(BAD_PARAMS)])
@pytest.mark.parametrize("device", DEVICES)
def test_gate_parameter_with_wrong_element_count_is_rejected(device, arg, gdn, bad, kind):
    kw = _inputs(device, gdn)
    kw[arg] = bad(4, 128).to(device)
    with pytest.raises(ValueError, match=arg):
        public_fn(kind, gdn)(**kw)


# ---------------------------------------------------------------------------------------------- B


@pytest.mark.parametrize("name", FUNCTIONS)
@pytest.mark.parametrize("device", DEVICES)
def test_unknown_keyword_is_a_type_error(device, name):
    kind, gdn = FUNCTIONS[name]
    with pytest.raises(TypeError, match="foo"):
        public_fn(kind, gdn)(**_inputs(device, gdn), foo=1)


NEUTRAL = [(gdn, extra) for gdn in (False, True) for extra in (
    dict(disable_recompute=True), dict(disable_recompute=False), dict(use_graph=True, max_num_seqs=3),
    dict(use_graph=False), dict(max_num_seqs=3), dict(cp_context=None), dict(chunk_size=64), dict(chunk_size=32),
    dict(return_intermediate_states=False))] + [(True, dict(chunk_indices=None)), (True, dict(chunk_size=16))]


@pytest.mark.parametrize("gdn,extra", NEUTRAL, ids=[f"{'gdn' if g else 'kda'}-{e}" for g, e in NEUTRAL])
@pytest.mark.parametrize("device", DEVICES)
def test_chunk_keywords_that_cannot_change_the_result(monkeypatch, device, gdn, extra):
    kw = _inputs(device, gdn, state_v_first=True)
    fn = public_fn("chunk", gdn)
    want = fn(**kw, output_final_state=True)
    _forbid_reference(monkeypatch, device)
    got = fn(**kw, output_final_state=True, **extra)
    assert len(got) == 2 and torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("gdn,size", [(False, 16), (False, 128), (True, 128), (True, 8)])
def test_chunk_size_outside_flas_choices_is_rejected(gdn, size):
    with pytest.raises(ValueError, match="chunk_size"):
        public_fn("chunk", gdn)(**_inputs("cpu", gdn), chunk_size=size)


@pytest.mark.parametrize("gdn", [False, True], ids=["kda", "gdn"])
def test_context_parallelism_restrictions(gdn):
    """FLA's restrictions under cp_context (tests/test_cp.py runs it on process groups)."""
    kw = _inputs("cpu", gdn)
    with pytest.raises(ValueError, match="initial_state"):
        public_fn("chunk", gdn)(**kw, cp_context=object())
    kw.pop("initial_state")
    with pytest.raises(ValueError, match="cp_context must be a context"):
        public_fn("chunk", gdn)(**kw, cp_context=object())


@pytest.mark.parametrize("gdn", [False, True], ids=["kda", "gdn"])
@pytest.mark.parametrize("device", DEVICES)
def test_return_intermediate_states(device, gdn):
    """Not implemented yet (prefix caching): NotImplementedError naming it. Once implemented, the result
    is docs/SPEC.md's (o, final_state, h), h[:, i] the state at the start of 64-token chunk i."""
    kw = make_inputs(B=2, T=70, H=2, HV=4, D=128, gdn=gdn, dtype=BF16, device=device, seed=2)
    fn = public_fn("chunk", gdn)
    with torch.inference_mode():
        try:
            res = fn(**kw, output_final_state=True, return_intermediate_states=True)
        except NotImplementedError as e:
            assert "return_intermediate_states" in str(e)
            return
    assert isinstance(res, tuple) and len(res) == 3, "return_intermediate_states=True was ignored"
    o, s, h = res
    assert h.shape == (2, 2, 4, 128, 128) and h.dtype == kw["k"].dtype
    prefix = {n: (x[:, :64] if n in ("q", "k", "v", "g", "beta") else x) for n, x in kw.items()}
    assert rel_err(h[:, 0], kw["initial_state"]) <= TOL
    assert rel_err(h[:, 1], _oracle(prefix, output_final_state=True)[1]) <= TOL
    ref_o, ref_s = _oracle(kw, output_final_state=True)
    assert rel_err(o, ref_o) <= TOL and rel_err(s, ref_s) <= TOL


@pytest.mark.parametrize("name", FUNCTIONS)
@pytest.mark.parametrize("device", DEVICES)
def test_transpose_state_layout_is_a_deprecated_alias(device, name):
    kind, gdn = FUNCTIONS[name]
    kw = _inputs(device, gdn, state_v_first=True)
    del kw["state_v_first"]
    fn = public_fn(kind, gdn)
    want = fn(**kw, state_v_first=True, output_final_state=True)
    with pytest.warns(DeprecationWarning):
        got = fn(**kw, transpose_state_layout=True, output_final_state=True)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    for alias in (True, False):  # FLA: "Cannot pass both `state_v_first` and ... `transpose_state_layout`"
        with pytest.raises(ValueError, match="transpose_state_layout"):
            fn(**kw, state_v_first=True, transpose_state_layout=alias)


@pytest.mark.parametrize("device", DEVICES)
def test_gdn_recurrent_takes_flas_gk_gv_keywords(device):
    kw = _inputs(device, gdn=True)
    fn = flashkda.fused_recurrent_gated_delta_rule
    want = fn(**kw, output_final_state=True)
    got = fn(**kw, output_final_state=True, gk=None, gv=None)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    B, T, HV, V = kw["v"].shape
    decay = dict(gk=torch.zeros(B, T, HV, kw["q"].shape[3], device=device), gv=torch.zeros(B, T, HV, V, device=device))
    for name, x in decay.items():
        with pytest.raises(NotImplementedError, match=name):
            fn(**kw, **{name: x})


# ---------------------------------------------------------------------------------------------- C


@pytest.fixture
def fla_backend(monkeypatch):
    """flashkda registered in FLA's registry, FLA's adapter of the flash_kda package out of the way
    (as in test_fla_backend.py); skipped without fla-core."""
    pytest.importorskip("fla.ops.kda")
    from flashkda.integrations import fla as integ

    monkeypatch.setenv("FLA_FLASH_KDA", "0")
    monkeypatch.delenv("FLASHKDA_FLA_BACKEND", raising=False)
    monkeypatch.delenv("FLA_FLASHKDA", raising=False)
    assert integ.register()
    return integ


def _fla_calls(device):
    """A prefill (chunk_kda) and a serving decode (fused_recurrent_kda_fwd) with FLA-layer parameters."""
    opts = dict(use_gate_in_kernel=True, lower_bound=-5.0, state_v_first=True)
    prefill = _fla_layer_params(_inputs(device, state_v_first=True, seed=3))
    prefill.update(opts, safe_gate=True, output_final_state=True)
    decode = _fla_layer_params(make_inputs(B=3, T=1, H=2, HV=4, D=128, dtype=BF16, device=device, state=False,
                                           seed=4))
    pool = (0.1 * torch.randn(7, 4, 128, 128, generator=torch.Generator().manual_seed(5))).to(device)
    decode.update(opts, initial_state=pool, ssm_state_indices=torch.tensor([5, 0, 2], dtype=torch.int32,
                                                                            device=device))
    return prefill, decode


@pytest.mark.parametrize("device", DEVICES)
def test_verifiers_take_fla_layer_parameters(monkeypatch, fla_backend, device):
    prefill, decode = _fla_calls(device)
    for verifier, call in ((fla_backend.chunk_kda_verifier, prefill),
                           (fla_backend.fused_recurrent_kda_fwd_verifier, decode)):
        with torch.no_grad():
            ok, reason = verifier(**call)
        if device == "cuda":
            assert (ok, reason) == (True, None)
        else:  # rejected for the device only
            assert not ok and "cpu" in reason and "A_log" not in reason and "dt_bias" not in reason, reason
    if device != "cuda":
        return
    # End to end through FLA's entry points: flashkda's kernels serve them, with the contract's result.
    from fla.ops.kda import chunk_kda as fla_chunk_kda
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd

    want_o, want_s = _oracle({n: x for n, x in prefill.items() if n not in ("safe_gate", "output_final_state")},
                             output_final_state=True)
    ref_pool = decode["initial_state"].double().cpu()
    want_d, _ = _oracle({n: x for n, x in decode.items() if n not in ("initial_state", "ssm_state_indices")},
                        initial_state=ref_pool, ssm_state_indices=decode["ssm_state_indices"].cpu())
    _forbid_reference(monkeypatch, device)
    with torch.inference_mode():
        o, s = fla_chunk_kda(**prefill)
        od, pool = fused_recurrent_kda_fwd(**decode)
    assert rel_err(o, want_o) <= TOL and rel_err(s, want_s) <= TOL
    assert pool is decode["initial_state"] and rel_err(od, want_d) <= TOL and rel_err(pool, ref_pool) <= TOL


# ---------------------------------------------------------------------------------------------- D


@pytest.mark.parametrize("param_dtype", [BF16, FP16], ids=["params_bf16", "params_fp16"])
@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("gate", ["lower_bound", "softplus"])
@pytest.mark.parametrize("lens", [None, [1, 17, 97, 1000, 0]], ids=["B2xT150", "varlen"])
@gpu
def test_gpu_prefill_with_fla_layer_parameters(monkeypatch, lens, gate, dtype, param_dtype):
    kw = make_inputs(B=2, T=150, lens=lens, H=2, HV=4, D=128, gate=gate, dtype=dtype, device="cuda",
                     state_v_first=True, seed=6)
    _fla_layer_params(kw, param_dtype)  # raw g stays in the input dtype (fp16 g with fp16 inputs)
    _forbid_reference(monkeypatch, "cuda")
    _check("chunk", False, kw, safe_gate=gate == "lower_bound")


@pytest.mark.parametrize("state_v_first", [True, False], ids=["v_first", "k_first"])
@pytest.mark.parametrize("param_dtype", [BF16, FP16], ids=["params_bf16", "params_fp16"])
@pytest.mark.parametrize("indices", ["1d", "2d_spec"])
@pytest.mark.parametrize("pool_dtype", [FP32, BF16], ids=["pool_fp32", "pool_bf16"])
@gpu
def test_gpu_serving_decode_leaves_other_slots_bit_identical(monkeypatch, pool_dtype, indices, param_dtype,
                                                             state_v_first):
    N, HV, D, slots = 4, 8, 128, 16
    if indices == "1d":
        idx, acc, T = torch.tensor([9, -1, 2, 14]), None, 1
    else:  # a padding row, a padding token, reads from idx[n, acc - 1]
        idx = torch.tensor([[9, 10, 11], [-1, -1, -1], [2, 5, -1], [14, 0, 7]])
        acc, T = torch.tensor([2, 1, 1, 3]), 3
    kw = make_inputs(B=N, T=T, H=4, HV=HV, D=D, dtype=BF16, device="cuda", state=False,
                     state_v_first=state_v_first, seed=7)
    _fla_layer_params(kw, param_dtype)
    named = sorted({int(s) for s in idx.flatten() if s >= 0})
    untouched = [s for s in range(slots) if s not in named]
    pool = torch.full((slots, HV, D, D), 1e30, dtype=pool_dtype, device="cuda")
    pool[named] = (0.1 * torch.randn(len(named), HV, D, D, generator=torch.Generator().manual_seed(8))).to(
        "cuda", pool_dtype)
    before = pool.clone()
    ref_pool = before.double().cpu()
    serving = dict(ssm_state_indices=idx, num_accepted_tokens=acc)
    ref_o, _ = _oracle(kw, initial_state=ref_pool, **serving)
    out = torch.full_like(kw["v"], float("nan"))
    _forbid_reference(monkeypatch, "cuda")
    o, ret = flashkda.fused_recurrent_kda(**kw, initial_state=pool, out=out, **{
        n: (x.to("cuda", torch.int32) if x is not None else None) for n, x in serving.items()})
    torch.cuda.synchronize()
    assert o is out and ret is pool
    assert torch.equal(pool[untouched], before[untouched]), "a slot not named by ssm_state_indices was written"
    assert torch.count_nonzero(out[1]) == 0 and (indices == "1d" or torch.count_nonzero(out[2, 2]) == 0)
    assert rel_err(out, ref_o) <= TOL
    assert rel_err(pool[named], ref_pool[named]) <= TOL


@pytest.mark.parametrize("g_dtype", [FP32, BF16], ids=["g_fp32", "g_bf16"])
@pytest.mark.parametrize("kind", ["chunk", "recurrent"])
@gpu
def test_gpu_masked_precomputed_gate(monkeypatch, kind, g_dtype):
    kw = make_inputs(lens=[1, 17, 97, 0, 130], H=2, HV=4, D=128, gate="precomputed", dtype=BF16, device="cuda",
                     state_v_first=True, seed=9)
    gen = torch.Generator().manual_seed(10)
    g = kw["g"].cpu()
    g[:, torch.rand(g.shape[1], generator=gen) < 0.1] = -1000.0  # masked tokens (every channel)
    g[torch.rand(g.shape, generator=gen) < 0.05] = -1000.0  # masked channels
    g[:, [18, 82, 83, 115, 179]] = -1000.0  # first tokens of the 97- and 130-token sequences' chunks
    kw["g"] = g.to("cuda", g_dtype)
    _forbid_reference(monkeypatch, "cuda")
    o, s = _check(kind, False, kw)
    assert torch.isfinite(o).all() and torch.isfinite(s).all()


@pytest.mark.fla_compile
@pytest.mark.parametrize("D", [60, 100, 256])
@gpu
def test_gpu_other_head_dims_fall_back_to_fla(monkeypatch, fla_backend, D):
    from fla.ops.kda import chunk_kda as fla_chunk_kda

    kw = make_inputs(lens=[37, 1, 70], H=2, HV=4, D=D, dtype=BF16, device="cuda", seed=11)
    kw["cu_seqlens"] = kw["cu_seqlens"].long()
    calls = []
    for n in ("_run_chunk_kernel", "_run_recurrent_kernel", "kda_reference"):  # none of flashkda runs
        monkeypatch.setattr(api, n, lambda *a, _n=n, **k: calls.append(_n))
    with torch.no_grad():
        o, s = fla_chunk_kda(**kw, safe_gate=True, output_final_state=True)
    assert calls == []
    ref_o, ref_s = _oracle(kw, output_final_state=True)
    # FLA's Triton path keeps more in bf16 than flashkda's kernels: 2e-2 as in test_fla_backend.py.
    assert rel_err(o, ref_o) <= 2e-2 and rel_err(s, ref_s) <= 2e-2


@pytest.mark.parametrize("gdn", [False, True], ids=["kda", "gdn"])
@pytest.mark.parametrize("kind", ["chunk", "recurrent"])
@gpu
def test_gpu_state_layouts_agree(monkeypatch, kind, gdn):
    """The same call in both layouts, the states transposed. The chunked kernels differ by layout only
    in their state addresses: bit-identical. The decode kernels reduce in another order per layout
    (V-first: lanes along K and shuffles; K-first: another kernel), so decode runs on fp32 inputs,
    whose outputs show that order (≈1e-7) instead of bf16 rounding flips, and is compared at 1e-6."""
    if kind == "chunk":
        kw = make_inputs(lens=[1, 17, 97, 0, 300], H=2, HV=4, D=128, gdn=gdn, dtype=BF16, device="cuda",
                         seed=12)
        extra, tol = dict(output_final_state=True), 0.0
    else:  # serving decode, every slot of the pool named
        kw = make_inputs(B=6, T=1, H=2, HV=4, D=128, gdn=gdn, dtype=FP32, device="cuda", seed=12)
        extra, tol = dict(ssm_state_indices=torch.tensor([3, 0, 5, 1, 4, 2], dtype=torch.int32, device="cuda")), 1e-6
    _fla_layer_params(kw, BF16, gdn)
    h0 = kw.pop("initial_state")
    _forbid_reference(monkeypatch, "cuda")
    fn = public_fn(kind, gdn)
    o_k, s_k = fn(**dict(kw, state_v_first=False), initial_state=h0.clone(), **extra)
    o_v, s_v = fn(**dict(kw, state_v_first=True), initial_state=h0.transpose(-1, -2).contiguous(), **extra)
    s_v = s_v.transpose(-1, -2)
    if tol == 0.0:
        assert torch.equal(o_k, o_v) and torch.equal(s_k, s_v)
    else:
        assert rel_err(o_v, o_k) <= tol and rel_err(s_v, s_k) <= tol
    ref_extra = {n: x.cpu() if isinstance(x, torch.Tensor) else x for n, x in extra.items()}
    ref_o, ref_s = _oracle(dict(kw, state_v_first=False), initial_state=h0.double().cpu(), **ref_extra)
    assert rel_err(o_k, ref_o) <= TOL and rel_err(s_k, ref_s) <= TOL
