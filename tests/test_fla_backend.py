"""flashkda as a backend of FLA's registry (``flashkda.integrations.fla``); skipped without fla-core.

CPU tests: registration, the verifiers' rules, and the argument translation end to end through
FLA's dispatcher (the device check patched so that the CPU reference stands in for the kernels).
GPU tests: FLA's public entry points reach flashkda's CUDA kernels, and unsupported calls still run FLA.
"""

import inspect
import warnings

import pytest
import torch

fla_kda = pytest.importorskip("fla.ops.kda")

import fla.backends as fla_backends  # noqa: E402
from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd as fla_fused_recurrent_kda_fwd  # noqa: E402

import flashkda  # noqa: E402
from flashkda import _ext  # noqa: E402
from flashkda.cp import CPContext  # noqa: E402
from flashkda import api as kda_api  # noqa: E402
from flashkda.integrations import fla as integ  # noqa: E402

from helpers import HAS_CUDA_KERNELS, rel_err  # noqa: E402

GATE = dict(use_gate_in_kernel=True, lower_bound=-5.0, use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True)


@pytest.fixture(autouse=True)
def _env(monkeypatch):
    monkeypatch.setenv("FLA_FLASH_KDA", "0")  # FLA's adapter of the flash_kda package stays out of the way
    monkeypatch.delenv("FLASHKDA_FLA_BACKEND", raising=False)
    monkeypatch.delenv("FLA_FLASHKDA", raising=False)
    assert integ.register()


def _registries():
    chunk = fla_backends._function_registries[inspect.unwrap(fla_kda.chunk_kda)]
    op = fla_backends._get_operation_registry("kda")
    gdn = fla_backends._get_operation_registry("gated_delta_rule")
    return chunk, op, gdn


def _inputs(*, B=2, T=3, H=2, HV=4, D=128, lens=None, dtype=torch.bfloat16, device="cpu", seed=0):
    """FLA-style inputs: raw gate with A_log [HV] / dt_bias [HV*K], raw beta logits."""
    gen = torch.Generator().manual_seed(seed)
    if lens is not None:
        B, T = 1, sum(lens)

    def rnd(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=gen)).to(device)

    kw = dict(q=rnd(B, T, H, D).to(dtype), k=rnd(B, T, H, D).to(dtype), v=rnd(B, T, HV, D).to(dtype),
              g=rnd(B, T, HV, D, scale=2.0).to(dtype), beta=rnd(B, T, HV).to(dtype),
              A_log=torch.rand(HV, generator=gen).to(device), dt_bias=rnd(HV * D))
    if lens is not None:
        kw["cu_seqlens"] = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    return kw


def _state(N, HV, D, device="cpu", seed=1):
    gen = torch.Generator().manual_seed(seed)
    return (0.1 * torch.randn(N, HV, D, D, generator=gen)).to(device)


def _counting(monkeypatch, module, name, calls=None):
    calls = [] if calls is None else calls
    orig = getattr(module, name)

    def spy(*args, **kwargs):
        calls.append(name)
        return orig(*args, **kwargs)

    monkeypatch.setattr(module, name, spy)
    return calls


# ---------------------------------------------------------------------------------------------- CPU


def test_register_is_idempotent_and_first():
    registries = _registries()
    before = tuple(reg._backends[integ.BACKEND_TYPE] for reg in registries)
    assert integ.register() is True and integ.is_registered()
    assert tuple(reg._backends[integ.BACKEND_TYPE] for reg in registries) == before == integ.registered_backends()
    assert integ.BACKEND_TYPE != "flash_kda"
    chunk = registries[0]
    for reg in registries:
        ordered = reg._get_sorted_backends()
        assert ordered[0].backend_type == integ.BACKEND_TYPE
        assert [b.backend_type for b in ordered].count(integ.BACKEND_TYPE) == 1
        assert all(b.priority > ordered[0].priority for b in ordered[1:])
    assert "flash_kda" in chunk._backends  # FLA's own adapter is still there, behind ours


def test_env_var_disables(monkeypatch):
    for backend in (reg._backends[integ.BACKEND_TYPE] for reg in _registries()):
        assert backend.is_enabled()
        monkeypatch.setenv(integ.ENV_VAR, "0")
        assert not backend.is_enabled()
        monkeypatch.delenv(integ.ENV_VAR)
    monkeypatch.setenv(integ.ENV_VAR, "0")
    assert integ.maybe_register_on_import() is False
    monkeypatch.delenv(integ.ENV_VAR)
    monkeypatch.setattr(_ext, "HAS_EXTENSION", True)
    assert integ.maybe_register_on_import() is True


def test_verifiers_reject_cpu_tensors():
    kw = _inputs(D=128)
    ok, reason = integ.chunk_kda_verifier(**kw, **GATE)
    assert not ok and "cpu" in reason
    pool = _state(2, 4, 128)
    ok, reason = integ.fused_recurrent_kda_fwd_verifier(**kw, **GATE, initial_state=pool)
    assert not ok and "cpu" in reason


def test_verifiers_under_autograd(monkeypatch):
    """Training calls of the chunked entries: by default flashkda's for a lower-bound gate and GDN
    (only the device is wrong here), FLA's for an unbounded chunk_kda gate, head dims other than 128
    and under a context; all flashkda's with FLASHKDA_FLA_TRAINING=1, none with =0; decode under
    autograd and FLA's inference-only intermediate states never."""
    kw = _inputs(D=128)
    kw["q"].requires_grad_(True)
    softplus = {**GATE, "lower_bound": None}
    gdn = {**_gdn(_inputs(D=128)), **GDN_LAYER}
    gdn["v"].requires_grad_(True)
    monkeypatch.delenv(integ.TRAINING_ENV_VAR, raising=False)
    for verifier, call in ((integ.chunk_kda_verifier, {**kw, **GATE}), (integ.chunk_gated_delta_rule_verifier, gdn)):
        ok, reason = verifier(**call)
        assert not ok and "grad" not in reason and "cpu" in reason, reason
    small = _inputs(D=64)
    small["q"].requires_grad_(True)
    for verifier, call in ((integ.chunk_kda_verifier, {**kw, **softplus}),
                           (integ.chunk_gated_delta_rule_verifier, {**gdn, **_gdn(small)}),
                           (integ.chunk_kda_verifier, {**small, **GATE})):
        ok, reason = verifier(**call)
        assert not ok and "requires grad" in reason and integ.TRAINING_ENV_VAR in reason, reason
    assert "head dims" in reason, reason
    monkeypatch.setenv(integ.TRAINING_ENV_VAR, "0")
    ok, reason = integ.chunk_kda_verifier(**kw, **GATE)
    assert not ok and f"{integ.TRAINING_ENV_VAR}=0" in reason
    monkeypatch.setenv(integ.TRAINING_ENV_VAR, "1")
    for verifier, call in ((integ.chunk_kda_verifier, {**kw, **GATE}), (integ.chunk_kda_verifier, {**kw, **softplus}),
                           (integ.chunk_gated_delta_rule_verifier, gdn)):
        ok, reason = verifier(**call)
        assert not ok and "grad" not in reason and "cpu" in reason, reason
    ok, reason = integ.chunk_kda_verifier(**kw, **GATE, return_intermediate_states=True)
    assert not ok and "requires grad" in reason
    one = _inputs(B=1, D=128)
    one["q"].requires_grad_(True)
    cu = torch.tensor([0, one["q"].shape[1]], dtype=torch.int32)
    ctx = CPContext(group=None, cu_seqlens=cu, cu_seqlens_cpu=cu, pre_num_ranks=0, post_num_ranks=0,
                    is_first_rank=True, is_last_rank=True)
    ok, reason = integ.chunk_kda_verifier(**{**one, "initial_state": None}, **GATE, cp_context=ctx)
    assert not ok and reason == "flashkda: inputs are on cpu"  # training under a context is served
    monkeypatch.delenv(integ.TRAINING_ENV_VAR)
    ok, reason = integ.chunk_kda_verifier(**{**one, "initial_state": None}, **GATE, cp_context=ctx)
    assert not ok and "context parallelism" in reason  # by default FLA's
    ok, reason = integ.fused_recurrent_kda_fwd_verifier(**kw, **GATE, inplace_final_state=False)
    assert not ok and "grad" in reason
    with torch.no_grad():
        ok, reason = integ.fused_recurrent_kda_fwd_verifier(**kw, **GATE, inplace_final_state=False)
    assert not ok and "grad" not in reason


@pytest.mark.parametrize("option, word", [
    (dict(cp_context=object()), "cp_context"),
    (dict(chunk_size=128), "chunk_size"),
    (dict(foo=1), "foo"),
    (dict(state_v_first=True, transpose_state_layout=True), "transpose_state_layout"),
    (dict(lower_bound=None, A_log=None), "A_log"),
])
def test_chunk_verifier_rejects_fla_only_options(option, word):
    kw = {**_inputs(D=128), **GATE, **option}
    ok, reason = integ.chunk_kda_verifier(**kw)
    assert not ok and word in reason


@pytest.mark.parametrize("option", [dict(disable_recompute=True), dict(chunk_size=32), dict(use_graph=True)])
def test_chunk_verifier_accepts_options_without_forward_effect(option):
    ok, reason = integ.chunk_kda_verifier(**{**_inputs(D=128), **GATE, **option})
    assert not ok and reason == "flashkda: inputs are on cpu"  # only the device is wrong


@pytest.mark.parametrize("case, word", [
    ("indices_1d_multi_token", "1-D"),
    ("indices_not_inplace", "inplace_final_state"),
    ("inplace_without_state", "initial_state"),
    ("unknown_kwarg", "transpose_state_layout"),
    ("gate_without_A_log", "A_log"),
])
def test_recurrent_verifier_rules(case, word):
    kw = {**_inputs(B=2, T=2, D=128), **GATE, "initial_state": _state(10, 4, 128)}
    if case == "indices_1d_multi_token":
        kw["ssm_state_indices"] = torch.tensor([3, 5], dtype=torch.int32)
    elif case == "indices_not_inplace":
        kw.update(ssm_state_indices=torch.tensor([[3, 4], [5, 6]], dtype=torch.int32), inplace_final_state=False)
    elif case == "inplace_without_state":
        kw["initial_state"] = None
    elif case == "unknown_kwarg":
        kw["transpose_state_layout"] = True
    else:
        kw.update(A_log=None, lower_bound=None)
    ok, reason = integ.fused_recurrent_kda_fwd_verifier(**kw)
    assert not ok and word in reason


def test_verifier_never_raises():
    ok, reason = integ.chunk_kda_verifier(torch.zeros(1))
    assert not ok and "TypeError" in reason
    kw = _inputs(D=128)
    kw["g"] = kw["g"][..., :64]  # wrong shape: flashkda's validation message
    ok, reason = integ.fused_recurrent_kda_fwd_verifier(**kw, inplace_final_state=False)
    assert not ok and "g must have shape" in reason


def _gdn(kw):
    """KDA-style inputs of _inputs made GDN's: a scalar gate g [B, T, HV], dt_bias [HV]."""
    HV = kw["v"].shape[2]
    return dict(kw, g=kw["g"][..., 0].contiguous(), dt_bias=kw["dt_bias"][:HV].contiguous())


GDN_LAYER = dict(use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                 state_v_first=True)  # what fla.layers.GatedDeltaNet passes in chunk mode


@pytest.mark.parametrize("case, word", [
    ("cpu", "cpu"),
    ("unknown_kwarg", "lower_bound"),
    ("chunk_size", "chunk_size"),
    ("gate_without_A_log", "A_log"),
    ("both_layout_names", "transpose_state_layout"),
])
def test_gdn_verifier_rules(case, word):
    kw = {**_gdn(_inputs(D=128)), **GDN_LAYER}
    extra = {"cpu": {}, "unknown_kwarg": {"lower_bound": -5.0}, "chunk_size": {"chunk_size": 8},
             "gate_without_A_log": {"A_log": None}, "both_layout_names": {"transpose_state_layout": True}}[case]
    ok, reason = integ.chunk_gated_delta_rule_verifier(**{**kw, **extra})
    assert not ok and word in reason, reason


def test_adapter_hands_back_a_call_flashkda_cannot_serve(monkeypatch, caplog):
    """FLA asks no verifier for the decode entry; a call that the fast entry declines and flashkda's
    rules reject (here: CPU tensors) runs FLA's own function with the same arguments."""
    monkeypatch.setattr(kda_api, "_fast", lambda *args: "declined")
    seen = []
    monkeypatch.setattr(integ, "_fla_fused_recurrent_kda_fwd", lambda *a, **k: seen.append((a, k)) or "FLA's")
    monkeypatch.setattr(integ, "_fallback_logged", False)
    kw = {**_inputs(B=2, T=1, D=128), **GATE, "initial_state": _state(4, 4, 128),
          "ssm_state_indices": torch.tensor([3, 1], dtype=torch.int32)}
    monkeypatch.setattr(_ext, "HAS_EXTENSION", True)  # the backend's is_available()
    with caplog.at_level("INFO", logger="flashkda"), torch.inference_mode():
        assert integ.fused_recurrent_kda_fwd(**kw) == "FLA's"
        assert fla_fused_recurrent_kda_fwd(**kw) == "FLA's"  # FLA's dispatcher -> the adapter -> FLA's function
    assert len(seen) == 2
    bound = inspect.signature(inspect.unwrap(fla_fused_recurrent_kda_fwd)).bind(*seen[0][0], **seen[0][1])
    assert all(bound.arguments[name] is x for name, x in kw.items() if isinstance(x, torch.Tensor))
    assert bound.arguments["out"] is None and bound.arguments["lower_bound"] == -5.0
    infos = [r for r in caplog.records if r.levelname == "INFO"]
    assert len(infos) == 1 and "cpu" in infos[0].getMessage()  # once, with flashkda's reason


@pytest.fixture
def cpu_dispatch(monkeypatch):
    """Make the verifiers accept CPU tensors; flashkda's public functions then run the reference on the CPU."""
    monkeypatch.setattr(integ, "_kernel_unsupported", lambda *args: None)
    monkeypatch.setattr(_ext, "HAS_EXTENSION", True)  # the backend's is_available()
    return {"chunk_kda": _counting(monkeypatch, kda_api, "chunk_kda"),
            "fused_recurrent_kda": _counting(monkeypatch, kda_api, "fused_recurrent_kda"),
            "chunk_gated_delta_rule": _counting(monkeypatch, kda_api, "chunk_gated_delta_rule")}


def test_cpu_inplace_pool_without_indices(cpu_dispatch):
    D, HV = 16, 4
    kw = _inputs(B=2, T=3, D=D, dtype=torch.float32)
    pool = _state(2, HV, D)
    want_o, want_s = flashkda.fused_recurrent_kda(**kw, **GATE, initial_state=pool.clone(), state_v_first=True,
                                                  output_final_state=True)
    q, k, v, g, beta, A_log, dt_bias = (kw[n] for n in ("q", "k", "v", "g", "beta", "A_log", "dt_bias"))
    # positional, as FLA's serving code may call it: (..., initial_state, scale, output_final_state,
    # inplace_final_state, state_v_first)
    o, s = fla_fused_recurrent_kda_fwd(q, k, v, g, beta, A_log, dt_bias, pool, None, False, True, True, **GATE)
    assert cpu_dispatch["fused_recurrent_kda"] == ["fused_recurrent_kda"]
    assert s is pool
    torch.testing.assert_close(o, want_o)
    torch.testing.assert_close(pool, want_s)


@pytest.mark.parametrize("indices", ["1d", "2d", "2d_varlen"])
def test_cpu_pool_with_indices(cpu_dispatch, indices):
    D, HV, N = 16, 4, 3
    if indices == "1d":
        kw = _inputs(B=N, T=1, D=D, dtype=torch.float32)
        idx = torch.tensor([7, 0, 4], dtype=torch.int32)
    elif indices == "2d":
        kw = _inputs(B=N, T=2, D=D, dtype=torch.float32)
        idx = torch.tensor([[7, 8], [0, 1], [4, 5]], dtype=torch.int32)
    else:
        kw = _inputs(lens=[2, 0, 1], D=D, dtype=torch.float32)
        idx = torch.tensor([[7, 8], [0, 1], [4, 5]], dtype=torch.int32)
    pool = _state(N + 8, HV, D)
    want_pool = pool.clone()
    want_o, _ = flashkda.fused_recurrent_kda(**kw, **GATE, initial_state=want_pool, ssm_state_indices=idx,
                                             state_v_first=True)
    o, s = fla_fused_recurrent_kda_fwd(**kw, **GATE, initial_state=pool, ssm_state_indices=idx, state_v_first=True)
    assert cpu_dispatch["fused_recurrent_kda"] == ["fused_recurrent_kda"]
    assert s is pool
    torch.testing.assert_close(o, want_o)
    torch.testing.assert_close(pool, want_pool)


def test_cpu_public_fused_recurrent(cpu_dispatch):
    D, HV = 16, 4
    kw = _inputs(lens=[3, 1], D=D, dtype=torch.float32)
    h0 = _state(2, HV, D)
    want_o, want_s = flashkda.fused_recurrent_kda(**kw, **GATE, initial_state=h0, output_final_state=True)
    o, s = fla_kda.fused_recurrent_kda(**kw, **GATE, initial_state=h0, output_final_state=True)
    assert cpu_dispatch["fused_recurrent_kda"] == ["fused_recurrent_kda"]
    torch.testing.assert_close(o, want_o)
    torch.testing.assert_close(s, want_s)


@pytest.mark.parametrize("layout_arg", ["state_v_first", "transpose_state_layout"])
def test_cpu_chunk_kda(cpu_dispatch, layout_arg):
    D, HV = 16, 4
    kw = _inputs(lens=[5, 0, 9], D=D, dtype=torch.float32)
    kw["dt_bias"] = kw["dt_bias"].view(HV, D)  # [HV, K] works as well as [HV * K]
    h0 = _state(3, HV, D)
    want_o, want_s = flashkda.chunk_kda(**kw, **GATE, initial_state=h0, output_final_state=True, state_v_first=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        o, s = fla_kda.chunk_kda(**kw, **GATE, safe_gate=True, initial_state=h0, output_final_state=True,
                                 **{layout_arg: True})
    assert cpu_dispatch["chunk_kda"] == ["chunk_kda"]
    deprecations = [w for w in caught if issubclass(w.category, DeprecationWarning)]
    assert bool(deprecations) == (layout_arg != "state_v_first")
    assert all(w.filename == __file__ for w in deprecations)  # points at the caller, as FLA's own warning
    torch.testing.assert_close(o, want_o)
    torch.testing.assert_close(s, want_s)


@pytest.mark.parametrize("allow_neg_eigval", [False, True])
def test_cpu_chunk_gated_delta_rule(cpu_dispatch, allow_neg_eigval):
    """FLA's chunk_gated_delta_rule through its registry, as FLA's GatedDeltaNet layer calls it: bf16
    gate parameters, varlen, V-first state."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk_gdn

    D, HV = 16, 4
    kw = _gdn(_inputs(lens=[5, 0, 9], D=D, dtype=torch.float32))
    kw.update(A_log=kw["A_log"].bfloat16(), dt_bias=kw["dt_bias"].bfloat16())
    h0 = _state(3, HV, D)
    opts = dict(use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True, state_v_first=True,
                allow_neg_eigval=allow_neg_eigval, initial_state=h0, output_final_state=True)
    want_o, want_s = flashkda.chunk_gated_delta_rule(**kw, **opts, use_gate_in_kernel=True)
    o, s = fla_chunk_gdn(**kw, **opts, use_gate_in_kernel=True)
    assert cpu_dispatch["chunk_gated_delta_rule"] == ["chunk_gated_delta_rule"]
    torch.testing.assert_close(o, want_o, rtol=0, atol=0)
    torch.testing.assert_close(s, want_s, rtol=0, atol=0)
    # without use_gate_in_kernel FLA takes g as the log decay and ignores A_log / dt_bias
    g = -torch.nn.functional.softplus(kw["g"])
    want_o, _ = flashkda.chunk_gated_delta_rule(**dict(kw, g=g, A_log=None, dt_bias=None), **opts)
    o, _ = fla_chunk_gdn(**dict(kw, g=g), **opts)
    torch.testing.assert_close(o, want_o, rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------- GPU

cuda = pytest.mark.skipif(not HAS_CUDA_KERNELS, reason="needs CUDA and flashkda's extension")


@pytest.fixture
def kernel_calls(monkeypatch):
    """flashkda kernel launches: the general path's (recurrent and chunked) and the eager fast entries'."""
    calls = _counting(monkeypatch, kda_api, "_run_recurrent_kernel")
    _counting(monkeypatch, kda_api, "_run_chunk_kernel", calls)

    def counted(entry, name):
        def spy(*args):
            answer = entry(*args)
            if isinstance(answer, tuple):
                calls.append(name)
            return answer
        return spy

    monkeypatch.setattr(kda_api, "_fast", counted(_ext.fused_recurrent_fast, "fused_recurrent_fast"))
    monkeypatch.setattr(kda_api, "_chunk_fast", counted(_ext.chunk_fast, "chunk_fast"))
    return calls


def _serving_case(indices):
    """bf16, K = V = 128, GVA, fp32 pool [N + 8, HV, V, K], int32 slots, lower-bound gate in kernel."""
    N, HV, D = 3, 4, 128
    T = 1 if indices == "1d" else 3
    kw = _inputs(B=N, T=T, H=2, HV=HV, D=D, device="cuda")
    slots = torch.randperm(N + 8, generator=torch.Generator().manual_seed(2))
    idx = slots[:N] if indices == "1d" else slots[:N * T].view(N, T)
    kw.update(GATE, state_v_first=True, ssm_state_indices=idx.to("cuda", torch.int32))
    return kw, _state(N + 8, HV, D, device="cuda")


@cuda
@pytest.mark.parametrize("indices", ["1d", "2d"])
def test_gpu_fused_recurrent_reaches_flashkda(kernel_calls, monkeypatch, indices):
    kw, pool = _serving_case(indices)
    pool0 = pool.clone()
    want_pool = pool.clone()
    want_o, _ = flashkda.fused_recurrent_kda(**kw, initial_state=want_pool)
    n = len(kernel_calls)
    with torch.inference_mode():
        o, s = fla_fused_recurrent_kda_fwd(**kw, initial_state=pool)
    assert len(kernel_calls) == n + 1 and s is pool
    torch.testing.assert_close(o, want_o)
    torch.testing.assert_close(pool, want_pool)

    # FLA's own Triton kernel, our backend switched off, agrees.
    monkeypatch.setenv(integ.ENV_VAR, "0")
    fla_pool = pool0.clone()
    fla_o, fla_s = fla_fused_recurrent_kda_fwd(**kw, initial_state=fla_pool)
    assert fla_s is fla_pool
    assert len(kernel_calls) == n + 1
    assert rel_err(fla_o, o) < 1e-2
    assert rel_err(fla_pool, pool) < 1e-2


@cuda
def test_gpu_fused_recurrent_inplace_without_indices(kernel_calls):
    kw, _ = _serving_case("2d")
    del kw["ssm_state_indices"]
    h0 = _state(3, 4, 128, device="cuda")
    want_o, want_s = flashkda.fused_recurrent_kda(**kw, initial_state=h0, output_final_state=True)
    n = len(kernel_calls)
    o, s = fla_fused_recurrent_kda_fwd(**kw, initial_state=h0)
    assert len(kernel_calls) == n + 1 and s is h0
    torch.testing.assert_close(o, want_o)
    torch.testing.assert_close(h0, want_s)


@cuda
@pytest.mark.fla_compile
def test_gpu_chunk_kda_reaches_flashkda(kernel_calls, monkeypatch):
    kw = _inputs(lens=[37, 1, 70], H=2, HV=4, D=128, device="cuda")
    kw["cu_seqlens"] = kw["cu_seqlens"].long()  # FLA documents int64 offsets for chunk_kda
    h0 = _state(3, 4, 128, device="cuda")
    opts = dict(**GATE, safe_gate=True, state_v_first=True, initial_state=h0, output_final_state=True)
    want_o, want_s = flashkda.chunk_kda(**kw, **opts)
    n = len(kernel_calls)
    with torch.no_grad():
        o, s = fla_kda.chunk_kda(**kw, **opts)
    assert len(kernel_calls) == n + 1
    torch.testing.assert_close(o, want_o)
    torch.testing.assert_close(s, want_s)

    monkeypatch.setenv(integ.ENV_VAR, "0")
    with torch.no_grad():
        fla_o, fla_s = fla_kda.chunk_kda(**kw, **opts)
    assert len(kernel_calls) == n + 1
    assert rel_err(fla_o, o) < 2e-2
    assert rel_err(fla_s, s) < 2e-2


@cuda
def test_gpu_unservable_decode_call_handed_back_to_fla(kernel_calls, monkeypatch):
    """K = 128, V = 64 reaches the adapter (FLA asks no verifier for the decode entry); the kernels
    cannot serve it and FLA's Triton kernel computes the result."""
    kw, pool = _serving_case("1d")
    kw["v"] = kw["v"][..., :64].contiguous()
    pool = pool[:, :, :64].contiguous()  # V-first: [slots, HV, V, K]
    fla_pool = pool.clone()
    n = len(kernel_calls)
    with torch.inference_mode():
        assert not integ.fused_recurrent_kda_fwd_verifier(**kw, initial_state=pool)[0]
        o, s = fla_fused_recurrent_kda_fwd(**kw, initial_state=pool)
        monkeypatch.setenv(integ.ENV_VAR, "0")
        want_o, _ = fla_fused_recurrent_kda_fwd(**kw, initial_state=fla_pool)
    assert len(kernel_calls) == n and s is pool
    torch.testing.assert_close(o, want_o, rtol=0, atol=0)
    torch.testing.assert_close(pool, fla_pool, rtol=0, atol=0)


@cuda
def test_gpu_chunk_gated_delta_rule_reaches_flashkda(kernel_calls):
    """FLA's chunk_gated_delta_rule as FLA's GatedDeltaNet layer calls it runs flashkda's chunked
    kernels, with the result of the direct call, bit for bit."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk_gdn

    kw = _gdn(_inputs(lens=[37, 1, 70, 0, 130], H=2, HV=4, D=128, device="cuda"))
    kw.update(A_log=kw["A_log"].bfloat16(), dt_bias=kw["dt_bias"].bfloat16(), cu_seqlens=kw["cu_seqlens"].long())
    h0 = _state(5, 4, 128, device="cuda")
    opts = dict(GDN_LAYER, initial_state=h0, output_final_state=True)
    want_o, want_s = flashkda.chunk_gated_delta_rule(**kw, **opts)
    n = len(kernel_calls)
    with torch.inference_mode():
        o, s = fla_chunk_gdn(**kw, **opts)
    assert len(kernel_calls) == n + 1
    torch.testing.assert_close(o, want_o, rtol=0, atol=0)
    torch.testing.assert_close(s, want_s, rtol=0, atol=0)


@cuda
@pytest.mark.fla_compile
def test_gpu_unsupported_falls_back_to_fla(kernel_calls):
    n = len(kernel_calls)
    # K = V = 32: no flashkda kernel
    kw = _inputs(B=2, T=1, H=2, HV=2, D=32, device="cuda")
    pool = _state(10, 2, 32, device="cuda")
    idx = torch.tensor([4, 9], dtype=torch.int32, device="cuda")
    assert not integ.fused_recurrent_kda_fwd_verifier(**kw, **GATE, initial_state=pool, ssm_state_indices=idx)[0]
    o, s = fla_fused_recurrent_kda_fwd(**kw, **GATE, initial_state=pool, ssm_state_indices=idx)
    assert s is pool and o.shape == kw["v"].shape and torch.isfinite(o).all()
    assert len(kernel_calls) == n


@cuda
def test_gpu_training_call_served(kernel_calls, monkeypatch):
    """By default a chunk_kda call with a lower-bound gate that requires grad runs flashkda's kernels
    and records flashkda's backward."""
    monkeypatch.delenv(integ.TRAINING_ENV_VAR, raising=False)
    n = len(kernel_calls)
    kw = _inputs(B=1, T=64, H=2, HV=2, D=128, device="cuda")
    kw["q"].requires_grad_(True)
    o, _ = fla_kda.chunk_kda(**kw, **GATE, safe_gate=True)
    assert type(o.grad_fn).__name__ == "ChunkFunctionBackward" and torch.isfinite(o).all()
    assert len(kernel_calls) == n + 1
    (dq,) = torch.autograd.grad(o.float().square().sum(), [kw["q"]])
    assert dq.shape == kw["q"].shape and torch.isfinite(dq).all()
    with _ext.kernel_family("sm80"):  # the gradients pass in value halves: not measured against FLA
        ok, reason = integ.chunk_kda_verifier(**kw, **GATE, safe_gate=True)
    assert not ok and "value halves" in reason and integ.TRAINING_ENV_VAR in reason, reason


@cuda
def test_gpu_gdn_training_call_served(kernel_calls, monkeypatch):
    """By default FLA's chunk_gated_delta_rule under autograd, as FLA's GatedDeltaNet layer calls it,
    runs flashkda's kernels, records flashkda's backward and gives the direct call's output and
    gradients; under CUDA graph capture, where that backward could not read its gate check, the
    verifier leaves the call to FLA."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk_gdn

    monkeypatch.delenv(integ.TRAINING_ENV_VAR, raising=False)
    kw = _gdn(_inputs(lens=[37, 1, 70], H=2, HV=4, D=128, device="cuda"))
    kw.update(A_log=kw["A_log"].bfloat16(), dt_bias=kw["dt_bias"].bfloat16(), cu_seqlens=kw["cu_seqlens"].long())
    names = ("q", "k", "v", "g", "beta", "A_log", "dt_bias")

    def run(fn):
        call = dict(kw, **{n: kw[n].detach().clone().requires_grad_() for n in names})
        o, _ = fn(**call, **GDN_LAYER)
        o.float().square().sum().backward()
        return o, [call[n].grad for n in names], call

    n = len(kernel_calls)
    o, got, call = run(fla_chunk_gdn)
    assert type(o.grad_fn).__name__ == "ChunkFunctionBackward" and len(kernel_calls) == n + 1
    want_o, want, _ = run(flashkda.chunk_gated_delta_rule)
    torch.testing.assert_close(o, want_o, rtol=0, atol=0)
    for name, a, b in zip(names, got, want):  # shared-memory atomics sum some partials in any order
        assert a is not None and rel_err(a, b) <= 1e-5, f"d{name}: {rel_err(a, b):.2e}"
    x = torch.zeros(1, device="cuda")
    with torch.cuda.graph(torch.cuda.CUDAGraph()):
        x.add_(1)
        ok, reason = integ.chunk_gated_delta_rule_verifier(**call, **GDN_LAYER)
    assert not ok and "capture" in reason and integ.TRAINING_ENV_VAR in reason, reason


@pytest.mark.skipif(not _ext.HAS_EXTENSION, reason="spies on the extension's fast entry")
@pytest.mark.parametrize("inplace", [True, False])
def test_declined_decode_takes_the_general_path_once(monkeypatch, inplace):
    """A decode call that the fast entry declines goes to the general path once, not through the
    fast entry again (the kernels stubbed: on the CPU the entry declines every call)."""
    from helpers import fast_spy

    answers = fast_spy(monkeypatch, "_fast")
    monkeypatch.setattr(integ, "_kernel_unsupported", lambda *args: None)
    monkeypatch.setattr(kda_api, "_kernel_unsupported", lambda *args: None)
    general = []

    def stub(p, q, k, v, g, beta, *rest):
        general.append(q)
        return torch.zeros_like(v), None

    monkeypatch.setattr(kda_api, "_run_recurrent_kernel", stub)
    kw = _inputs(T=1, D=128)
    extra = (dict(initial_state=_state(6, 4, 128), ssm_state_indices=torch.tensor([4, 1], dtype=torch.int32))
             if inplace else dict(initial_state=_state(2, 4, 128), inplace_final_state=False))
    with torch.no_grad():
        integ.fused_recurrent_kda_fwd(**kw, **GATE, **extra, state_v_first=True)
    assert len(answers) == 1 and isinstance(answers[0], str) and len(general) == 1
