"""Gradients of the chunked prefill against fp64 autograd of the token-by-token recurrence.

On the CPU: the chunked backward (flashkda.autograd.chunk_backward, under ChunkFunction with the
reference as its forward) in every mode; the public functions record a graph on every path; decode
raises under autograd. On a GPU: the kernels' forward recorded as ChunkFunction, its gradients, and
(marked fla_compile) each gradient's error at most 1.25x FLA's on the same inputs. NaN never passes
(rel_err gives inf).
"""

import math

import pytest
import torch

import flashkda
from flashkda import _ext
from flashkda.autograd import ChunkFunction, ChunkOptions
from flashkda.reference import kda_reference

from helpers import (GRAD_INPUTS, HAS_CUDA_KERNELS, grads64, grads_of, make_inputs, public_fn, rel_err,
                     with_kernel_names)

NAMES = GRAD_INPUTS
FLAGS = ("use_qk_l2norm_in_kernel", "use_gate_in_kernel", "use_beta_sigmoid_in_kernel", "allow_neg_eigval",
         "lower_bound", "state_v_first", "cu_seqlens")


def _through_chunk_function(kw, do, dht):
    """Gradients of ChunkFunction (chunk_backward) with the reference as its forward."""
    flags = {f: kw[f] for f in FLAGS if f in kw}
    opts = ChunkOptions(kw["q"].shape[-1] ** -0.5, flags.get("use_qk_l2norm_in_kernel", False),
                        flags.get("use_gate_in_kernel", False), flags.get("lower_bound"),
                        flags.get("use_beta_sigmoid_in_kernel", False), flags.get("allow_neg_eigval", False),
                        flags.get("state_v_first", False), flags.get("cu_seqlens"), None)

    def fn(**call):
        tensors = [call.get(n) for n in NAMES]
        return ChunkFunction.apply(lambda *t: (*kda_reference(**dict(call, **dict(zip(NAMES, t)))), None), opts,
                                   *tensors)

    return grads_of(fn, kw, do, dht, output_final_state=True)


def _upstream(kw, seed=11):
    gen = torch.Generator().manual_seed(seed)
    v = kw["v"]
    N, HV, D = (len(kw["cu_seqlens"]) - 1 if kw.get("cu_seqlens") is not None else v.shape[0]), v.shape[2], v.shape[3]
    do = torch.randn(*v.shape, generator=gen).to(v.device)
    dht = torch.randn(N, HV, D, D, generator=gen).to(v.device)
    return do, dht


def _check_grads(got, ref, bound, what=""):
    for name, a, b in zip(NAMES, got, ref):
        if b is None:
            continue
        assert a is not None, f"{what}: no gradient for {name}"
        assert a.shape == b.shape, f"{what}: d{name} has shape {list(a.shape)}, expected {list(b.shape)}"
        err = rel_err(a, b)
        assert err <= bound, f"{what}: d{name} error {err:.2e} > {bound:.1e}"


CPU_CASES = {
    "lower_bound": dict(gate="lower_bound"),
    "softplus_gva": dict(gate="softplus", HV=4),
    "precomputed_masks": dict(gate="precomputed", mask_prob=0.1),
    "softplus_strong": dict(gate="softplus", g_scale=30.0),
    "varlen_odd": dict(gate="lower_bound", lens=[1, 17, 0, 97, 130]),
    "gdn_v_first": dict(gate="softplus", gdn=True, state_v_first=True),
    "gdn_varlen_precomputed": dict(gate="precomputed", gdn=True, lens=[64, 65, 3]),
}


@pytest.mark.parametrize("case", list(CPU_CASES))
def test_chunk_backward_matches_fp64(case):
    """chunk_backward (fp32) against fp64 autograd of the recurrence, with every input requiring
    grad, both upstream gradients given, the reference as ChunkFunction's forward."""
    spec = dict(CPU_CASES[case])
    g_scale = spec.pop("g_scale", 1.0)  # strong decays: pairs of tokens far apart contribute nothing
    kw = make_inputs(B=2, T=150, H=2, D=32, **spec, seed=5)
    kw["g"] = kw["g"] * g_scale
    if case == "softplus_gva":
        kw["allow_neg_eigval"] = True
    do, dht = _upstream(kw)
    _check_grads(_through_chunk_function(kw, do, dht), grads64(kw, do, dht), 2e-5, case)


def test_chunk_backward_without_sequences_or_final_gradient():
    """Zero-length sequences only (no chunk at all): the initial state's gradient is the final
    state's; and with no final-state gradient the gradients come from the output alone."""
    kw = make_inputs(lens=[0, 0], H=2, D=32, seed=1)
    do, dht = _upstream(kw)
    got = _through_chunk_function(kw, do, dht)
    assert torch.equal(got[-1], dht)
    kw = make_inputs(T=70, H=2, D=32, seed=2)
    do, _ = _upstream(kw)
    _check_grads(_through_chunk_function(kw, do, None), grads64(kw, do, None), 2e-5, "output only")


@pytest.mark.parametrize("gdn", [False, True])
def test_reference_path_records_graph(gdn):
    """A CPU call (the reference) under autograd returns outputs with a graph whose gradients are
    the recurrence's, A_log and dt_bias in their own shapes."""
    kw = make_inputs(lens=[5, 70], H=2, HV=4, D=16, gdn=gdn, gate="softplus", seed=3)
    kw["A_log"] = kw["A_log"].reshape(1, 1, 4, 1)
    if not gdn:
        kw["dt_bias"] = kw["dt_bias"].reshape(4, 16)
    do, dht = _upstream(kw)
    got = grads_of(public_fn("chunk", gdn), kw, do, dht, output_final_state=True)
    _check_grads(got, grads64(kw, do, dht), 2e-5, "reference")


def test_no_graph_without_grad():
    kw = make_inputs(T=20, H=2, D=16, seed=4)
    kw["q"].requires_grad_()
    with torch.no_grad():
        o, _ = flashkda.chunk_kda(**kw)
    assert o.grad_fn is None
    with torch.inference_mode():
        o, _ = flashkda.chunk_kda(**kw)
    assert not o.requires_grad


@pytest.mark.parametrize("gdn", [False, True])
@pytest.mark.parametrize("name", ["q", "g", "beta", "A_log", "initial_state"])
def test_decode_raises_under_grad(gdn, name):
    kw = make_inputs(T=3, H=2, D=16, gdn=gdn, gate="softplus", seed=6)
    kw[name].requires_grad_()
    fn = public_fn("recurrent", gdn)
    with pytest.raises(NotImplementedError, match=f"{name} requires grad"):
        fn(**kw)
    with torch.no_grad():
        o, _ = fn(**kw)
    assert o.grad_fn is None


@pytest.mark.parametrize("option", ["return_intermediate_states", "checkpoint_pool", "ssm_state_indices"])
def test_inference_options_raise_under_grad(option):
    kw = make_inputs(T=70, H=2, D=16, seed=7)
    kw["k"].requires_grad_()
    extra = {
        "return_intermediate_states": dict(return_intermediate_states=True),
        "checkpoint_pool": dict(checkpoint_pool=torch.zeros(4, 2, 16, 16),
                                checkpoint_slots=torch.zeros(1, 2, dtype=torch.int32)),
        "ssm_state_indices": dict(ssm_state_indices=torch.zeros(1, dtype=torch.int32)),
    }[option]
    with pytest.raises(ValueError, match=f"{option} is for inference"):
        flashkda.chunk_kda(**kw, **extra)


# ---------------------------------------------------------------------------------------------
# GPU: the kernels' forward under ChunkFunction.
# ---------------------------------------------------------------------------------------------

cuda = pytest.mark.skipif(not HAS_CUDA_KERNELS, reason="needs CUDA and the extension")

#: Gradients of bf16 / fp16 leaves are rounded to their dtype (relative error about 1e-3). The
#: backward's kernels multiply bf16 operands (states included) with fp32 accumulation, as the
#: forward's do: the bound of the forward's bf16 output (helpers.CHUNK_TOL). The fp16 case
#: (-1e4 masks) takes the PyTorch backward, fp32 throughout.
CUDA_TOL = {torch.bfloat16: 6e-3, torch.float16: 1e-3}

GPU_CASES = {
    "bf16_lower_bound_varlen_vfirst": dict(dtype=torch.bfloat16, gate="lower_bound", lens=[1, 17, 0, 97, 1100],
                                           state_v_first=True),
    "bf16_softplus_gva_fixed": dict(dtype=torch.bfloat16, gate="softplus", B=2, T=300, HV=8),
    "fp16_precomputed_masks": dict(dtype=torch.float16, gate="precomputed", T=200, mask_prob=0.05),
    "bf16_gdn_bf16_state": dict(dtype=torch.bfloat16, gate="softplus", gdn=True, lens=[130, 64, 3],
                                state_dtype=torch.bfloat16),
    "bf16_head_dim_64": dict(dtype=torch.bfloat16, gate="lower_bound", T=150, D=64),
    "bf16_lower_bound_gva": dict(dtype=torch.bfloat16, gate="lower_bound", lens=[200, 37], HV=8),
}


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("case", list(GPU_CASES))
def test_cuda_grads_match_fp64(case):
    spec = dict(GPU_CASES[case])
    gdn = spec.pop("gdn", False)
    kw = make_inputs(H=4, D=spec.pop("D", 128), gdn=gdn, device="cuda", **spec, seed=8)
    do, dht = _upstream(kw)
    fn = public_fn("chunk", gdn)
    o, _ = fn(**dict(kw, v=kw["v"].detach().clone().requires_grad_()))
    assert type(o.grad_fn).__name__ == "ChunkFunctionBackward", f"{case}: {o.grad_fn} (not the kernels' forward)"
    got = grads_of(fn, kw, do, dht, output_final_state=True)
    for name, gr in zip(NAMES, got):
        if gr is not None:
            assert gr.dtype == kw[name].dtype and gr.device == kw[name].device, name
    _check_grads(got, grads64(kw, do, dht), CUDA_TOL[spec["dtype"]], case)


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("case", ["bf16_lower_bound_varlen_vfirst", "bf16_gdn_bf16_state", "bf16_lower_bound_gva"])
def test_cuda_grads_match_fp64_on_the_sm80_family(case):
    """What an sm_80 GPU runs (its shared memory per block holds the gradients pass only in value
    halves), forced on this GPU: the sm_80 forward kernels and the gradients pass in value halves,
    whose two blocks add their shares (found by kernel name), within the same bound of fp64."""
    spec = dict(GPU_CASES[case])
    gdn = spec.pop("gdn", False)
    kw = make_inputs(H=4, D=128, gdn=gdn, device="cuda", **spec, seed=8)
    do, dht = _upstream(kw)
    with _ext.kernel_family("sm80"):
        got, names = with_kernel_names(lambda: grads_of(public_fn("chunk", gdn), kw, do, dht, output_final_state=True))
    assert any("chunk_local_grad_split_kernel" in n for n in names), "the gradients pass in value halves did not run"
    assert not any("chunk_local_grad_kernel" in n for n in names), "the whole gradients pass ran"
    _check_grads(got, grads64(kw, do, dht), CUDA_TOL[spec["dtype"]], case)


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("gdn", [False, True], ids=["kda", "gdn"])
def test_cuda_backward_reads_the_forwards_records(gdn, monkeypatch):
    """The chunked forward under autograd keeps its states at chunk starts and its chunk records,
    and the backward walks them: one chunk_prepare launch in a forward + backward, where without
    them the backward runs the forward kernels again (kernel names counted by the profiler); the
    gradients agree (V-first states, varlen with a one-token sequence). The GDN gate (precomputed,
    unbounded) is checked against the kernels' span by the forward, so the backward reads nothing
    back; with the records, GDN's gradients pass takes the raw q and k (the per-token pass computes
    no q̂ or k̂), without them chunk_bwd_inputs' q̂ and k̂."""
    import flashkda.api

    kw = make_inputs(H=4, D=128, gdn=gdn, gate="precomputed" if gdn else "lower_bound", lens=[100, 1, 37],
                     state_v_first=True, dtype=torch.bfloat16, device="cuda", seed=5)
    do, dht = _upstream(kw)
    fn = public_fn("chunk", gdn)

    def traced():
        got, names = with_kernel_names(lambda: grads_of(fn, kw, do, dht, output_final_state=True))
        return got, sum("chunk_prepare_kernel" in n for n in names), sum("chunk_state_grad_kernel" in n for n in names)

    import flashkda.autograd as ag

    inputs_op, qk_asked = _ext.chunk_bwd_inputs_op, []

    def spy(*args):  # chunk_bwd_inputs' optional last argument: whether it computes q̂ and k̂
        qk_asked.append(bool(args[13]) if len(args) > 13 else True)
        return inputs_op(*args)

    monkeypatch.setattr(_ext, "chunk_bwd_inputs_op", spy)

    spans_within = ag._spans_within  # the backward reads nothing back: the gate is bounded or checked ahead
    monkeypatch.setattr(ag, "_spans_within", lambda *a: pytest.fail("the backward read the gate check back"))
    kept, prepares, walks = traced()
    assert (prepares, walks) == (1, 1), f"chunk_prepare ran {prepares} times, chunk_state_grad {walks}"
    assert qk_asked == [not gdn], f"chunk_bwd_inputs asked for q̂ and k̂: {qk_asked}"
    monkeypatch.setattr(ag, "_spans_within", spans_within)
    monkeypatch.setattr(flashkda.api, "forward_records", lambda *a: None)
    again, prepares, walks = traced()
    assert (prepares, walks) == (2, 1), f"without records: chunk_prepare ran {prepares} times"
    assert qk_asked[1:] == [True], f"without records, chunk_bwd_inputs asked for q̂ and k̂: {qk_asked[1:]}"
    for name, a, b in zip(NAMES, kept, again):
        if b is not None:  # the same kernels on the same states (atomics make the sums' last bits vary)
            assert rel_err(a, b) <= 1e-3 and torch.isfinite(a).all(), f"d{name}: {rel_err(a, b):.2e}"


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("within", [True, False], ids=["gate_within", "gate_beyond"])
def test_cuda_gate_check_not_yet_reached(within, monkeypatch):
    """A backward that comes before the device has reached its forward's gate check (the event not
    passed: forced here) runs the kernels as if the gate passed, then reads the check: a gate within
    the kernels' span keeps their gradients, one beyond it gets the backward again on PyTorch; either
    way the gradients match fp64 (GDN, precomputed log decays, varlen)."""
    kw = make_inputs(H=4, D=128, gdn=True, gate="precomputed", lens=[100, 1, 37], dtype=torch.bfloat16,
                     device="cuda", seed=6)
    if not within:  # 16 tokens of -8 each: beyond the span
        kw["g"] = torch.full_like(kw["g"], -8.0)
    do, dht = _upstream(kw)
    monkeypatch.setattr(torch.cuda.Event, "query", lambda self: False)
    got, names = with_kernel_names(lambda: grads_of(public_fn("chunk", True), kw, do, dht, output_final_state=True))
    assert sum("chunk_local_grad_kernel" in n for n in names) == 1, "the gradients pass did not run as if the gate passed"
    _check_grads(got, grads64(kw, do, dht), CUDA_TOL[torch.bfloat16], f"within={within}")


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("case", ["bf16_lower_bound_varlen_vfirst", "bf16_lower_bound_gva"])
def test_cuda_backward_without_room_for_the_gradients_pass(case, monkeypatch):
    """A device without room for the gradients pass (sm_80's shared memory, stood in for here): the
    kernels' states at chunk boundaries (chunk_state_grad on the forward's records), the per-chunk
    gradients in PyTorch, within the kernel path's bound of fp64."""
    from flashkda import _ext

    monkeypatch.setattr(_ext, "chunk_bwd_shortfall", lambda index, transitions=False: "163 KB per block (stood in)")
    spec = dict(GPU_CASES[case])
    gdn = spec.pop("gdn", False)
    kw = make_inputs(H=4, D=128, gdn=gdn, device="cuda", **spec, seed=8)
    do, dht = _upstream(kw)
    got, names = with_kernel_names(lambda: grads_of(public_fn("chunk", gdn), kw, do, dht, output_final_state=True))
    assert any("chunk_state_grad_kernel" in n for n in names), "the boundary states did not come from the kernels"
    assert not any("chunk_local_grad_kernel" in n for n in names), "the gradients pass ran"
    _check_grads(got, grads64(kw, do, dht), CUDA_TOL[spec["dtype"]], case)


@cuda
@pytest.mark.cuda
def test_cuda_fast_entry_declines_grad(monkeypatch):
    """The eager C++ entries decline inputs that require grad (the general path records the graph
    or raises); a call without grad still takes them."""
    from helpers import fast_spy

    answers = fast_spy(monkeypatch, "_chunk_fast")
    kw = make_inputs(T=64, H=2, D=128, dtype=torch.bfloat16, device="cuda", seed=9)
    flashkda.chunk_kda(**kw)
    kw["v"].requires_grad_()
    o, _ = flashkda.chunk_kda(**kw)
    assert isinstance(answers[0], tuple) and "requires grad" in answers[1]
    assert o.grad_fn is not None


# FLA's error on the accuracy case, the bound 1.25x of it (T = 300 fixed and varlen, H = 4,
# K = V = 128, bf16 inputs, lower-bound and softplus gates).
FLA_RATIO = 1.25


@cuda
@pytest.mark.cuda
@pytest.mark.fla_compile
@pytest.mark.parametrize("lens", [None, [37, 1, 200, 62]], ids=["fixed", "varlen"])
@pytest.mark.parametrize("gate", ["lower_bound", "softplus"])
def test_cuda_grads_against_fla(gate, lens, monkeypatch):
    fla_chunk_kda = pytest.importorskip("fla.ops.kda").chunk_kda
    from flashkda.integrations import fla as integ

    monkeypatch.setenv("FLA_FLASH_KDA", "0")

    kw = make_inputs(H=4, D=128, T=300, lens=lens, gate=gate, dtype=torch.bfloat16, device="cuda", seed=12)
    do, dht = _upstream(kw)
    ref = grads64(kw, do, dht)
    ours = grads_of(flashkda.chunk_kda, kw, do, dht, output_final_state=True)
    monkeypatch.setenv(integ.ENV_VAR, "0")  # FLA's own kernels
    theirs = grads_of(fla_chunk_kda, kw, do, dht, output_final_state=True, safe_gate=gate == "lower_bound")
    for name, a, b, r in zip(NAMES, ours, theirs, ref):
        if r is None:
            continue
        ea, eb = rel_err(a, r), rel_err(b, r)
        assert ea <= FLA_RATIO * eb and not math.isnan(ea), f"d{name}: flashkda {ea:.2e} > {FLA_RATIO} x FLA {eb:.2e}"


def test_decayed_grams_pivot_equals_exact():
    """The two diagonal-block forms of the decayed Gram matrices agree where both apply."""
    from flashkda.autograd import _decayed_grams, _decays

    gen = torch.Generator().manual_seed(3)
    q, k = (torch.randn(2, 3, 64, 16, generator=gen, dtype=torch.float64) for _ in range(2))
    g = -5 * torch.rand(2, 3, 64, 16, generator=gen, dtype=torch.float64)
    for pivoted, exact in zip(_decayed_grams(q, k, _decays(g, True)), _decayed_grams(q, k, _decays(g, False))):
        torch.testing.assert_close(pivoted, exact, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("passed", [True, False], ids=["event_passed", "event_ahead"])
@pytest.mark.parametrize("within", [True, False])
def test_forward_gate_check_reaches_the_backward(monkeypatch, within, passed):
    """The answer of a forward's gate check (ForwardRecords.gate_check) reaches the backward's choice
    of path after its event, not a read of the device; the forward's states and records reach the
    backward op (here on the CPU, where the PyTorch path runs whatever they say). An event the
    device has not passed yet is waited for only after the backward ran as if the gate passed; a
    gate that fails the check then gets the backward again."""
    import flashkda.autograd as ag

    class Event:
        synchronized = False

        def query(self):
            return passed

        def synchronize(self):
            Event.synchronized = True

    seen = []
    gate_shortfall = ag._gate_shortfall
    monkeypatch.setattr(ag, "_gate_shortfall", lambda *a: seen.append(a[2]) or gate_shortfall(*a))
    monkeypatch.setattr(ag, "_spans_within", lambda *a: pytest.fail("the backward read the gate check back"))
    # A device the kernels would take but for the gradients pass's room: the gate decides the rest.
    monkeypatch.setattr(ag, "_device_shortfall", lambda *a: None)
    monkeypatch.setattr(ag._ext, "chunk_bwd_shortfall", lambda index, transitions=False: "no room", raising=False)
    monkeypatch.setattr(ag._ext, "CHUNK_BWD_MAX_SUBCHUNK_SPAN", 80.0, raising=False)
    kw = make_inputs(T=70, H=2, D=16, gate="softplus", seed=23)
    do, dht = _upstream(kw)
    opts = ChunkOptions(16 ** -0.5, True, True, None, True, False, False, None, None)
    kept = ag.ForwardRecords(torch.zeros(2, 2, 16, 16), torch.zeros(8, dtype=torch.uint8),
                             ag.GateCheck(torch.tensor(within), Event()))

    def fn(**call):
        def run(*t):
            o, ht = kda_reference(**dict(call, **dict(zip(NAMES, t))))
            return o, ht, kept

        return ChunkFunction.apply(run, opts, *[call.get(n) for n in NAMES])

    got = grads_of(fn, kw, do, dht, output_final_state=True)
    assert Event.synchronized != passed and seen == ([within] if passed else [True] if within else [True, False])
    _check_grads(got, grads64(kw, do, dht), 2e-5)


def test_gate_check_under_capture_names_it(monkeypatch):
    """A backward under CUDA graph capture that would have to read an unbounded gate's span check
    from the device (the forward skipped it) raises an error naming the capture and the way out,
    not CUDA's; a bounded gate or the forward's answer needs no read and passes."""
    import flashkda.autograd as ag

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    monkeypatch.setattr(ag, "_spans_within", lambda *a: pytest.fail("the backward read the device under capture"))
    monkeypatch.setattr(ag._ext, "HAS_EXTENSION", True)  # a lower bound counts only where the kernels exist
    monkeypatch.setattr(ag._ext, "CHUNK_BWD_MAX_SUBCHUNK_SPAN", 80.0, raising=False)
    softplus = ChunkOptions(1.0, True, True, None, True, False, False, None, None)
    gp = torch.zeros(1, 16, 2)
    with pytest.raises(RuntimeError, match="CUDA graph capture.*lower_bound >= -5"):
        ag._gate_shortfall(softplus, gp, None)
    assert ag._gate_shortfall(softplus, gp, True) is None
    assert ag._gate_shortfall(softplus._replace(lower_bound=-5.0), gp, None) is None


@pytest.mark.parametrize("name", ["q", "initial_state", "A_log"])
def test_chunk_backward_one_input_requires_grad(name):
    """Only one input requires grad (q reaches the output alone, the initial state both outputs)."""
    kw = make_inputs(T=100, H=2, D=32, seed=13)
    do, dht = _upstream(kw)
    ref = grads64(kw, do, dht)[NAMES.index(name)]
    flags = {f: kw[f] for f in FLAGS if f in kw}
    opts = ChunkOptions(32 ** -0.5, True, True, -5.0, True, False, False, None, None)
    leaf = kw[name].detach().clone().requires_grad_()
    call = dict(kw, **{name: leaf})
    o, ht = ChunkFunction.apply(
        lambda *t: (*kda_reference(**dict(call, **dict(zip(NAMES, t))), output_final_state=True), None), opts,
        *[call.get(n) for n in NAMES])
    (got,) = torch.autograd.grad([t for t in (o, ht) if t.requires_grad],
                                 [leaf], [u for t, u in ((o, do), (ht, dht)) if t.requires_grad])
    assert rel_err(got, ref) <= 2e-5


@pytest.mark.parametrize("pivot", [True, False])
def test_gram_grads_match_autograd(pivot):
    """The decayed Gram matrices' explicit gradients (flashkda.autograd._gram_grads) against autograd
    of their forward, in fp64, for both diagonal-block forms."""
    from flashkda.autograd import _decayed_grams, _decays, _gram_grads

    gen = torch.Generator().manual_seed(4)
    x, y = (torch.randn(2, 3, 64, 16, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(2))
    g = (-5 * torch.rand(2, 3, 64, 16, generator=gen, dtype=torch.float64)).requires_grad_()
    dZ = torch.randn(2, 3, 64, 64, generator=gen, dtype=torch.float64).tril()
    Z, _ = _decayed_grams(x, y, _decays(g, pivot))
    want = torch.autograd.grad(Z, [x, y, g], dZ)
    for name, got, ref in zip("xyg", _gram_grads(dZ, x.detach(), y.detach(), _decays(g.detach(), pivot)), want):
        torch.testing.assert_close(got, ref, rtol=1e-9, atol=1e-11, msg=f"d{name}")


def test_backward_op_passes_opcheck():
    """The backward is one registered op (flashkda::chunk_bwd) with a fake implementation, so
    torch.compile traces ChunkFunction without looking inside it."""
    import flashkda.autograd  # noqa: F401  (registers the op)

    kw = make_inputs(lens=[70, 0, 5], H=2, HV=4, D=16, gate="softplus", seed=21)
    do, dht = _upstream(kw)
    args = (do, dht, *[kw.get(n) for n in NAMES], None, None, -1, kw["cu_seqlens"], None, 0.25, True, True, None,
            True, False, False, 0b11111111)
    torch.library.opcheck(torch.ops.flashkda.chunk_bwd.default, args)


@cuda
@pytest.mark.cuda
def test_cuda_training_call_compiles():
    """torch.compile(fullgraph=True) traces a training call (the kernels' forward op, the opaque
    backward op) and gives the eager gradients."""
    kw = make_inputs(T=130, H=2, D=128, dtype=torch.bfloat16, device="cuda", seed=31)
    do, dht = _upstream(kw)
    eager = grads_of(flashkda.chunk_kda, kw, do, dht, output_final_state=True)
    torch.compiler.reset()
    got = grads_of(torch.compile(flashkda.chunk_kda, fullgraph=True), kw, do, dht, output_final_state=True)
    for name, a, b in zip(NAMES, got, eager):
        if b is not None:
            torch.testing.assert_close(a, b, msg=f"d{name}")


@cuda
@pytest.mark.cuda
def test_cuda_training_call_captures_in_a_graph():
    """Forward and backward of a training call (lower-bound gate, varlen without cu_seqlens_cpu)
    captured in one CUDA graph: nothing on the kernels' path reads the device back. A replay with
    new input values gives the eager gradients of those values."""
    lens = [100, 37, 200]
    kw = make_inputs(lens=lens, H=2, HV=4, D=128, dtype=torch.bfloat16, device="cuda", seed=41)
    do, dht = _upstream(kw)
    leaves = [kw[n].detach().clone().requires_grad_() for n in NAMES]
    call = dict(kw, **dict(zip(NAMES, leaves)))

    def step():
        o, s = flashkda.chunk_kda(**call, output_final_state=True)
        return torch.autograd.grad([o, s], leaves, [do, dht])

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    fresh = make_inputs(lens=lens, H=2, HV=4, D=128, dtype=torch.bfloat16, device="cuda", seed=42)
    with torch.no_grad():
        for leaf, n in zip(leaves, NAMES):
            leaf.copy_(fresh[n])
    graph.replay()
    torch.cuda.synchronize()
    want = grads_of(flashkda.chunk_kda, fresh, do, dht, output_final_state=True)
    # Not bit-equal: the gradients pass sums some partials (dg's chunk-end term, dβ) with shared-memory
    # atomics, in the order the warps arrive (measured 1.1e-6 on dg between replay and eager).
    for name, a, b in zip(NAMES, captured, want):
        assert rel_err(a, b) <= 1e-5, f"d{name}: {rel_err(a, b):.2e}"


@cuda
@pytest.mark.cuda
def test_cuda_unbounded_gate_under_capture_names_it():
    """A GDN training step (softplus gate in the kernel, no lower bound) captured in a CUDA graph:
    the forward makes no gate check under capture, so the backward would have to read the gate's
    spans from the device; it raises the error naming the capture, not CUDA's."""
    kw = make_inputs(T=100, H=2, D=128, gdn=True, gate="softplus", dtype=torch.bfloat16, device="cuda", seed=43)
    do, _ = _upstream(kw)
    leaves = {n: kw[n].detach().clone().requires_grad_() for n in ("q", "k", "v", "g", "beta")}
    call = dict(kw, **leaves)

    def step():
        o, _ = flashkda.chunk_gated_delta_rule(**call)
        return torch.autograd.grad([o], list(leaves.values()), [do])

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # outside capture the backward reads the forward's check
    torch.cuda.current_stream().wait_stream(side)
    with pytest.raises(RuntimeError, match="CUDA graph capture.*lower_bound >= -5"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            step()


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("gdn", [False, True], ids=["kda", "gdn"])
def test_cuda_decays_at_the_span_edge_on_the_kernels(gdn):
    """Log decays of -4.9 on every token (78.4 over 16 tokens, just inside the kernels' span of 80)
    take the kernel path (the gradients pass found by name), and its gradients stay within the bf16
    bound of fp64: the span's edge is inside what the kernels compute accurately."""
    kw = make_inputs(H=4, D=128, gdn=gdn, gate="precomputed", lens=[130, 17, 64], dtype=torch.bfloat16,
                     device="cuda", seed=44)
    kw["g"] = torch.full_like(kw["g"], -4.9)
    do, dht = _upstream(kw)
    got, names = with_kernel_names(lambda: grads_of(public_fn("chunk", gdn), kw, do, dht, output_final_state=True))
    assert any("chunk_local_grad_kernel" in n for n in names), "the gradients pass did not run"
    _check_grads(got, grads64(kw, do, dht), CUDA_TOL[torch.bfloat16], f"gdn={gdn}")


def test_chunk_function_traces_fullgraph():
    """torch.compile(fullgraph=True) traces ChunkFunction: its forward (here the reference; on a GPU the
    kernels' registered op) and the opaque backward op, with the eager gradients."""
    kw = make_inputs(T=40, H=2, D=16, seed=1)
    opts = ChunkOptions(16 ** -0.5, True, True, -5.0, True, False, False, None, None)

    def fn(q, k, v, g, beta, A_log, dt_bias, initial_state):
        def run(q, k, v, g, beta, A_log, dt_bias, initial_state):
            o, ht = kda_reference(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, initial_state=initial_state,
                                  output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                                  lower_bound=-5.0, use_beta_sigmoid_in_kernel=True, scale=opts.scale)
            return o, ht, None

        return ChunkFunction.apply(run, opts, q, k, v, g, beta, A_log, dt_bias, initial_state)

    def grads(f):
        leaves = [kw[n].detach().clone().requires_grad_() for n in NAMES]
        o, s = f(*leaves)
        return torch.autograd.grad([o.square().sum(), s.sum()], leaves)

    torch.compiler.reset()
    # fp32 tolerance, not bit equality: the traced forward may round differently.
    for name, a, b in zip(NAMES, grads(torch.compile(fn, fullgraph=True, backend="aot_eager")), grads(fn)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"d{name}: {m}")


def test_chunk_backward_half_precision_leaves():
    """bf16 inputs and a bf16 initial state: each gradient comes back in its input's dtype and shape,
    within bf16 rounding of the fp64 gradients (A_log as [1, 1, HV, 1], dt_bias as [HV, K])."""
    kw = make_inputs(lens=[33, 70], H=2, HV=4, D=16, gate="softplus", dtype=torch.bfloat16,
                     state_dtype=torch.bfloat16, seed=17)
    kw["A_log"] = kw["A_log"].reshape(1, 1, 4, 1)
    kw["dt_bias"] = kw["dt_bias"].reshape(4, 16)
    do, dht = _upstream(kw)
    got = _through_chunk_function(kw, do, dht)
    for name, gr in zip(NAMES, got):
        assert gr.dtype == kw[name].dtype and gr.shape == kw[name].shape, name
    _check_grads(got, grads64(kw, do, dht), 6e-3, "bf16")
