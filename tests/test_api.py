"""Public API on the CPU: results, validation messages, dispatch reasons, varlen helpers."""

import contextlib
import logging
import re
import types
from pathlib import Path

import pytest
import torch

import flashkda
from flashkda import _constants as C
from flashkda import _ext
from flashkda.varlen import pack, unpack

from helpers import fast_spy, make_inputs, public_fn, reference64, rel_err

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("kind", ["chunk", "recurrent"])
@pytest.mark.parametrize("gdn", [False, True])
def test_public_functions_match_oracle(kind, gdn):
    kw = make_inputs(lens=[5, 0, 19], H=2, HV=4, D=16, gdn=gdn, gate="lower_bound")
    o, s = public_fn(kind, gdn)(**kw, output_final_state=True)
    ref_o, ref_s = reference64(kw, output_final_state=True)
    assert o.dtype == kw["v"].dtype and s.dtype == torch.float32
    assert rel_err(o, ref_o) < 1e-5 and rel_err(s, ref_s) < 1e-5


def test_fp64_inputs_stay_fp64():
    kw = make_inputs(T=9, H=1, D=8, dtype=torch.float64, state_dtype=torch.float64, gate="softplus")
    o, s = flashkda.chunk_kda(**kw, output_final_state=True)
    ref_o, ref_s = reference64(kw, output_final_state=True)
    assert o.dtype == torch.float64 and rel_err(o, ref_o) < 1e-12 and rel_err(s, ref_s) < 1e-12


def test_out_buffer_and_serving_on_cpu():
    kw = make_inputs(B=3, T=1, H=1, D=8, state=False, gate="softplus")
    pool = torch.randn(5, 1, 8, 8)
    out = torch.full_like(kw["v"], float("nan"))
    idx = torch.tensor([4, -1, 0])
    o, ret = flashkda.fused_recurrent_kda(**kw, initial_state=pool, ssm_state_indices=idx, out=out)
    assert o is out and ret is pool
    assert torch.isfinite(out).all() and torch.count_nonzero(out[1]) == 0


def test_transpose_state_layout_alias():
    kw = make_inputs(T=4, H=1, D=8, state_v_first=False)
    kw.pop("state_v_first")
    with pytest.warns(DeprecationWarning):
        a, sa = flashkda.chunk_kda(**kw, output_final_state=True, transpose_state_layout=True)
    b, sb = flashkda.chunk_kda(**kw, output_final_state=True, state_v_first=True)
    torch.testing.assert_close(a, b)
    torch.testing.assert_close(sa, sb)


# --------------------------------------------------------------------------------------------
# Validation: every bad input of the contract raises the right exception naming the argument.
# --------------------------------------------------------------------------------------------


def _bad(mutate, D=8):
    kw = make_inputs(lens=[3, 4], H=2, HV=4, D=D)
    mutate(kw)
    return kw


BAD_INPUTS = [
    ("q", TypeError, lambda kw: kw.update(q=[1, 2])),
    ("q", ValueError, lambda kw: kw.update(q=kw["q"][0])),
    ("k", ValueError, lambda kw: kw.update(k=kw["k"][..., :4])),
    ("v", ValueError, lambda kw: kw.update(v=kw["v"][:, :3])),
    ("heads", ValueError, lambda kw: kw.update(v=kw["v"][:, :, :3], g=kw["g"][:, :, :3], beta=kw["beta"][:, :, :3])),
    ("g", ValueError, lambda kw: kw.update(g=kw["g"][..., 0])),
    ("beta", ValueError, lambda kw: kw.update(beta=kw["beta"][..., None])),
    ("dtype", TypeError, lambda kw: kw.update(k=kw["k"].half())),
    ("g", TypeError, lambda kw: kw.update(g=kw["g"].int())),
    ("lower_bound", ValueError, lambda kw: kw.update(lower_bound=-6.0)),
    ("lower_bound", ValueError, lambda kw: kw.update(lower_bound=0.0)),
    ("allow_neg_eigval", ValueError, lambda kw: kw.update(allow_neg_eigval=True, use_beta_sigmoid_in_kernel=False)),
    ("A_log", ValueError, lambda kw: kw.update(A_log=torch.zeros(3))),
    ("A_log", TypeError, lambda kw: kw.update(A_log=torch.zeros(4, dtype=torch.int32))),
    ("dt_bias", ValueError, lambda kw: kw.update(dt_bias=torch.zeros(4))),
    ("cu_seqlens", TypeError, lambda kw: kw.update(cu_seqlens=kw["cu_seqlens"].float())),
    ("cu_seqlens", ValueError, lambda kw: kw.update(cu_seqlens=torch.tensor([0, 5, 4], dtype=torch.int32))),
    ("cu_seqlens", ValueError, lambda kw: kw.update(cu_seqlens=torch.tensor([0, 3, 6], dtype=torch.int32))),
    ("cu_seqlens", ValueError, lambda kw: kw.update(cu_seqlens=torch.tensor([1, 3, 7], dtype=torch.int32))),
    ("batch size", ValueError, lambda kw: kw.update({n: torch.cat([kw[n]] * 2) for n in ("q", "k", "v", "g", "beta")})),
    ("initial_state", ValueError, lambda kw: kw.update(initial_state=kw["initial_state"][:1])),
    ("initial_state", ValueError, lambda kw: kw.update(initial_state=kw["initial_state"][..., :4])),
    ("initial_state", TypeError, lambda kw: kw.update(initial_state=kw["initial_state"].half())),
    ("scale", TypeError, lambda kw: kw.update(scale="0.5")),
]


@pytest.mark.parametrize("kind", ["chunk", "recurrent"])
@pytest.mark.parametrize("name,exc,mutate", BAD_INPUTS, ids=[f"{n}-{i}" for i, (n, _, _) in enumerate(BAD_INPUTS)])
def test_bad_input_is_rejected(kind, name, exc, mutate):
    kw = _bad(mutate)
    with pytest.raises(exc, match=re.escape(name) if name not in ("heads", "dtype") else None) as info:
        public_fn(kind, False)(**kw)
    assert str(info.value).startswith("flashkda:")


SERVING_BAD = [
    ("ssm_state_indices", TypeError, dict(ssm_state_indices=torch.tensor([0.0, 1.0]))),
    ("ssm_state_indices", ValueError, dict(ssm_state_indices=torch.tensor([0, 1, 2]))),
    ("pool has 4 slots", ValueError, dict(ssm_state_indices=torch.tensor([0, 4]))),
    ("num_accepted_tokens", ValueError, dict(ssm_state_indices=torch.tensor([0, 1]),
                                            num_accepted_tokens=torch.tensor([1, 1]))),
    ("T_max", ValueError, dict(ssm_state_indices=torch.tensor([[0], [1]]))),
    ("out", ValueError, dict(ssm_state_indices=torch.tensor([0, 1]), out=torch.zeros(2, 1, 1, 8))),
    ("out", TypeError, dict(ssm_state_indices=torch.tensor([0, 1]), out=torch.zeros(2, 2, 1, 8, dtype=torch.half))),
]


def _serving_bad(extra, D=8):
    kw = make_inputs(B=2, T=2, H=1, D=D, state=False)
    kw["initial_state"] = torch.zeros(4, 1, D, D)
    kw.update(extra)
    if "out" in extra:  # the cases are written for D = 8: keep each one's single defect at any D
        kw["out"] = torch.zeros(*extra["out"].shape[:-1], D, dtype=extra["out"].dtype)
    return kw


@pytest.mark.parametrize("name,exc,extra", SERVING_BAD, ids=[f"{n}-{i}" for i, (n, _, _) in enumerate(SERVING_BAD)])
def test_bad_serving_input_is_rejected(name, exc, extra):
    with pytest.raises(exc, match=re.escape(name)):
        flashkda.fused_recurrent_kda(**_serving_bad(extra))


def test_serving_needs_a_pool():
    kw = make_inputs(B=2, T=1, H=1, D=8, state=False)
    with pytest.raises(ValueError, match="initial_state"):
        flashkda.fused_recurrent_kda(**kw, ssm_state_indices=torch.tensor([0, 1]))


# --------------------------------------------------------------------------------------------
# Dispatch reasons
# --------------------------------------------------------------------------------------------


def test_cpu_inputs_log_the_fallback_reason(caplog):
    kw = make_inputs(T=3, H=1, D=8)
    with caplog.at_level(logging.DEBUG, logger="flashkda"):
        flashkda.fused_recurrent_kda(**kw)
    assert any("PyTorch reference" in r.message and "inputs are on cpu" in r.message for r in caplog.records)


def test_force_reference_is_a_reason(caplog, monkeypatch):
    monkeypatch.setattr(_ext.config, "force_reference", True)
    kw = make_inputs(T=3, H=1, D=8)
    with caplog.at_level(logging.DEBUG, logger="flashkda"):
        flashkda.chunk_kda(**kw)
    assert any("FLASHKDA_FORCE_REFERENCE=1" in r.message for r in caplog.records)


def test_unsupported_reasons():
    from flashkda.api import _kernel_unsupported, _validate

    kw = make_inputs(T=3, H=1, D=24)
    p = _validate("chunk_kda", kw["q"], kw["k"], kw["v"], kw["g"], kw["beta"], scalar_gate=False, scale=None,
                  initial_state=None, cu_seqlens=None, cu_seqlens_cpu=None, use_gate_in_kernel=True,
                  A_log=None, dt_bias=None, lower_bound=-5.0, use_beta_sigmoid_in_kernel=True,
                  allow_neg_eigval=False, state_v_first=False)
    assert "inputs are on cpu" in _kernel_unsupported(p, kw["q"], kw["g"], kw["beta"], None, None, None)
    meta = kw["q"].to("meta")
    meta.is_cuda  # meta tensors are not CUDA: the device reason comes first whatever else is wrong
    assert p.K == 24 and 24 not in C.KERNEL_HEAD_DIMS


def test_import_reports_extension_state():
    assert isinstance(flashkda.HAS_EXTENSION, bool)
    if not flashkda.HAS_EXTENSION:
        assert _ext.EXTENSION_ERROR


# --------------------------------------------------------------------------------------------
# The eager fast entry (flashkda._C.fused_recurrent): its checks, run on CPU tensors. It declines
# CPU inputs at its last check, so a call that gets that answer passed every other one.
# --------------------------------------------------------------------------------------------

needs_extension = pytest.mark.skipif(not _ext.HAS_EXTENSION, reason="needs the compiled extension")
#: The fast entry's answer for inputs it would launch on, but on the CPU (kNotCuda in csrc/binding/fast_entry.cpp).
PASSED_ALL_BUT_DEVICE = "q: not on a CUDA device"
#: Errors of values that only a host copy shows: the CUDA path never syncs to look (docs/SPEC.md, "Errors"), so
#: the fast entry passes them, and on the CPU the general path raises them.
VALUE_ONLY = {"cu_seqlens": ValueError, "pool has 4 slots": ValueError}


def _fast_answers(monkeypatch, fn, kw, entry="_fast"):
    """What the fast entry answers to fn(**kw), which then goes on along the general path."""
    answers = fast_spy(monkeypatch, entry)
    try:
        fn(**kw)
    except (TypeError, ValueError):
        pass
    return answers


def _decode(gdn=False, D=64, dtype=torch.bfloat16, **extra):
    """A serving decode call the kernel takes as given (but on the CPU): bench/test_decode.py's kind."""
    kw = make_inputs(B=3, T=1, H=2, HV=4, D=D, dtype=dtype, gdn=gdn, state=False, state_v_first=True)
    kw.update(initial_state=torch.zeros(7, 4, D, D), ssm_state_indices=torch.tensor([5, -1, 0], dtype=torch.int32),
              out=torch.empty_like(kw["v"]))
    kw.update(extra)
    return kw


@needs_extension
def test_fast_entry_takes_the_public_arguments_in_order():
    import inspect

    names = list(inspect.signature(_ext.fused_recurrent_fast).parameters)
    for fn in (flashkda.fused_recurrent_kda, flashkda.fused_recurrent_gated_delta_rule):
        public = [n for n, p in inspect.signature(fn).parameters.items() if p.kind == p.POSITIONAL_OR_KEYWORD]
        assert names == public + ["scalar_gate"]
    with pytest.raises(TypeError, match="21 positional arguments"):
        _ext.fused_recurrent_fast(1, 2)


def _varlen_spec_decode():
    kw = make_inputs(lens=[2, 0, 3], H=2, HV=4, D=64, dtype=torch.float16, state=False)
    kw.update(initial_state=torch.zeros(9, 4, 64, 64, dtype=torch.bfloat16),
              ssm_state_indices=torch.tensor([[1, 2, -1], [3, 4, 5], [6, 7, 8]]),
              num_accepted_tokens=torch.tensor([1, 2, 3]))
    return kw


VALID_FOR_THE_KERNEL = {
    "decode": lambda: _decode(),
    "decode GDN": lambda: _decode(gdn=True),
    "decode D=128, fp32, out allocated": lambda: _decode(D=128, dtype=torch.float32, out=None),
    "decode K-first, dt_bias [HV, K], int scale": lambda: dict(_decode(state_v_first=False), scale=1,
                                                                   dt_bias=torch.zeros(4, 64)),
    "A_log as a Parameter, softplus gate": lambda: dict(_decode(), lower_bound=None,
                                                        A_log=torch.nn.Parameter(torch.zeros(4), requires_grad=False)),
    "precomputed gate": lambda: dict(_decode(), use_gate_in_kernel=False, A_log=None, dt_bias=None),
    "varlen speculative decoding": _varlen_spec_decode,
    "prefill with a new final state": lambda: dict(make_inputs(lens=[5, 1], H=2, D=64), output_final_state=True),
    "fused q and k (strided rows)": lambda: dict(
        _decode(), **dict(zip("qk", torch.randn(3, 1, 2, 2, 64).to(torch.bfloat16).unbind(2)))),
}


@needs_extension
@pytest.mark.parametrize("case", VALID_FOR_THE_KERNEL)
def test_fast_entry_passes_calls_the_kernel_takes(monkeypatch, case):
    kw = VALID_FOR_THE_KERNEL[case]()
    fn = flashkda.fused_recurrent_gated_delta_rule if kw["g"].dim() == 3 else flashkda.fused_recurrent_kda
    assert _fast_answers(monkeypatch, fn, kw) == [PASSED_ALL_BUT_DEVICE]


@needs_extension
@pytest.mark.parametrize("entry", ["_fast", "_chunk_fast"])
def test_fast_entries_decline_inputs_that_require_grad(monkeypatch, entry):
    """Under autograd an input that requires grad takes the general path, which records a graph
    (prefill) or raises (decode); without autograd the entry passes the same call."""
    kw = dict(_decode(D=128), lower_bound=None, A_log=torch.nn.Parameter(torch.zeros(4)))
    if entry == "_chunk_fast":
        for name in ("ssm_state_indices", "out"):
            del kw[name]
        kw["initial_state"] = None
        fn = flashkda.chunk_kda
    else:
        fn = flashkda.fused_recurrent_kda
    answers = fast_spy(monkeypatch, entry)
    with pytest.raises(NotImplementedError) if entry == "_fast" else contextlib.nullcontext():
        fn(**kw)
    assert answers and "requires grad" in answers[0]
    with torch.no_grad():
        assert _fast_answers(monkeypatch, fn, kw, entry)[-1] == PASSED_ALL_BUT_DEVICE


def _assert_declined(answer, name, exc, named):
    """A bad input: the fast entry declines it naming the argument (`named(answer)`), except where
    only the device's data shows it (VALUE_ONLY), where its checks all pass."""
    if VALUE_ONLY.get(name) is exc:
        assert answer == PASSED_ALL_BUT_DEVICE
    else:
        assert answer != PASSED_ALL_BUT_DEVICE and named(answer), answer


@needs_extension
@pytest.mark.parametrize("name,exc,mutate", BAD_INPUTS, ids=[f"{n}-{i}" for i, (n, _, _) in enumerate(BAD_INPUTS)])
def test_fast_entry_declines_bad_inputs(monkeypatch, name, exc, mutate):
    """Every bad input of the contract is caught by the fast entry too (the general path then raises)."""
    (answer,) = _fast_answers(monkeypatch, flashkda.fused_recurrent_kda, _bad(mutate, D=64))
    _assert_declined(answer, name, exc,
                     lambda a: a.startswith(f"{name}:") or name in ("heads", "dtype", "batch size"))


@needs_extension
@pytest.mark.parametrize("name,exc,extra", SERVING_BAD, ids=[f"{n}-{i}" for i, (n, _, _) in enumerate(SERVING_BAD)])
def test_fast_entry_declines_bad_serving_inputs(monkeypatch, name, exc, extra):
    (answer,) = _fast_answers(monkeypatch, flashkda.fused_recurrent_kda, _serving_bad(extra, D=64))
    _assert_declined(answer, name, exc, lambda a: name in a)


class _FloatSub(float):
    pass


class _TensorSub(torch.Tensor):
    pass


GENERAL_PATH_ONLY = [
    # inputs the general path copies first
    ("q", lambda kw: kw.update(q=torch.randn(3, 1, 2, 64, 2).to(torch.bfloat16)[..., 0])),
    ("initial_state", lambda kw: kw.update(initial_state=torch.zeros(7, 4, 64, 128)[..., ::2])),
    ("cu_seqlens", lambda kw: kw.update(make_inputs(lens=[2, 1], H=2, HV=4, D=64), out=None,
                                        cu_seqlens=torch.tensor([0, 9, 2, 9, 3], dtype=torch.int32)[::2],
                                        ssm_state_indices=None)),
    # inputs the reference serves
    ("q", lambda kw: kw.update({n: kw[n].double() for n in ("q", "k", "v", "out")})),
    ("v", lambda kw: kw.update(_decode(D=32))),
    ("initial_state", lambda kw: kw.update(initial_state=kw["initial_state"].double())),
    ("A_log", lambda kw: kw.update(A_log=kw["A_log"].double())),
    ("A_log", lambda kw: kw.update(use_gate_in_kernel=False)),  # given, but no gate in the kernel
    # arguments that Python judges by their own rules
    ("state_v_first", lambda kw: kw.update(state_v_first=1)),
    ("scale", lambda kw: kw.update(scale=_FloatSub(0.1))),
    ("q", lambda kw: kw.update(q=kw["q"].as_subclass(_TensorSub))),
]


@needs_extension
@pytest.mark.parametrize("name,mutate", GENERAL_PATH_ONLY,
                         ids=[f"{n}-{i}" for i, (n, _) in enumerate(GENERAL_PATH_ONLY)])
def test_fast_entry_leaves_copies_and_the_reference_to_the_general_path(monkeypatch, name, mutate):
    kw = _decode()
    mutate(kw)
    (answer,) = _fast_answers(monkeypatch, flashkda.fused_recurrent_kda, kw)
    assert answer.startswith(f"{name}:"), answer


@needs_extension
@pytest.mark.parametrize("switch", ["force_reference", "debug", "kwargs"])
def test_fast_entry_is_not_tried_under_switches_or_extra_kwargs(monkeypatch, switch):
    kw = _decode()
    if switch == "kwargs":
        kw.update(state_v_first=False, transpose_state_layout=True)
    else:
        monkeypatch.setattr(_ext.config, switch, True)
    with pytest.warns(DeprecationWarning) if switch == "kwargs" else contextlib.nullcontext():
        assert _fast_answers(monkeypatch, flashkda.fused_recurrent_kda, kw) == []


# --------------------------------------------------------------------------------------------
# The eager fast entry of the chunked functions (flashkda._C.chunk), on CPU tensors likewise
# --------------------------------------------------------------------------------------------


def _prefill(gdn=False, dtype=torch.bfloat16, **extra):
    """A varlen prefill the chunked kernels take as given (but on the CPU)."""
    kw = make_inputs(lens=[5, 0, 70], H=2, HV=4, D=128, dtype=dtype, gdn=gdn, state_v_first=True)
    kw.update(output_final_state=True, **extra)
    return kw


def _prefill_serving(**extra):
    kw = _prefill(initial_state=torch.zeros(6, 4, 128, 128), ssm_state_indices=torch.tensor([4, -1, 0]),
                  has_initial_state=torch.tensor([True, False, True]))
    kw.update(extra)
    return kw


def _chunk_fast_answers(monkeypatch, kw, gdn=False):
    fn = flashkda.chunk_gated_delta_rule if gdn else flashkda.chunk_kda
    return _fast_answers(monkeypatch, fn, kw, entry="_chunk_fast")


@needs_extension
def test_chunk_fast_entry_takes_the_token_arguments_as_the_decode_entry():
    import inspect

    names = list(inspect.signature(_ext.chunk_fast).parameters)
    decode = list(inspect.signature(_ext.fused_recurrent_fast).parameters)
    shared = decode[:decode.index("cu_seqlens") + 1]
    assert names == shared + ["cu_seqlens_cpu", "ssm_state_indices", "has_initial_state", "value_split",
                              "segment_chunks", "scalar_gate"]
    with pytest.raises(TypeError, match="23 positional arguments"):
        _ext.chunk_fast(1, 2)


VALID_FOR_THE_CHUNKED_KERNELS = {
    "varlen with states": _prefill,
    "GDN": lambda: _prefill(gdn=True),
    "GDN, softplus gate": lambda: _prefill(gdn=True, lower_bound=None),
    "fp16, fixed length, K-first, no states": lambda: make_inputs(B=2, T=65, H=2, D=128, dtype=torch.float16,
                                                                  state=False),
    "host offsets": lambda: dict(_prefill(), cu_seqlens_cpu=torch.tensor([0, 5, 5, 75])),
    "serving pool, has_initial_state": _prefill_serving,
    "FLA's options that change nothing": lambda: _prefill(chunk_size=32, disable_recompute=True, safe_gate=True,
                                                          max_num_seqs=8),
    "odd row offsets (the binding copies)": lambda: dict(
        _prefill(), q=torch.randn(1, 75, 2, 129).to(torch.bfloat16)[..., 1:]),
}


@needs_extension
@pytest.mark.parametrize("case", VALID_FOR_THE_CHUNKED_KERNELS)
def test_chunk_fast_entry_passes_calls_the_kernels_take(monkeypatch, case):
    kw = VALID_FOR_THE_CHUNKED_KERNELS[case]()
    assert _chunk_fast_answers(monkeypatch, kw, gdn=kw["g"].dim() == 3) == [PASSED_ALL_BUT_DEVICE]


@needs_extension
@pytest.mark.parametrize("name,exc,mutate", BAD_INPUTS, ids=[f"{n}-{i}" for i, (n, _, _) in enumerate(BAD_INPUTS)])
def test_chunk_fast_entry_declines_bad_inputs(monkeypatch, name, exc, mutate):
    kw = make_inputs(lens=[3, 4], H=2, HV=4, D=128, dtype=torch.bfloat16)
    mutate(kw)
    (answer,) = _chunk_fast_answers(monkeypatch, kw)
    _assert_declined(answer, name, exc,
                     lambda a: a.startswith(f"{name}:") or name in ("heads", "dtype", "batch size"))


CHUNK_GENERAL_PATH_ONLY = [
    # the token-by-token kernel serves these
    ("v", lambda kw: kw.update(make_inputs(lens=[5, 0, 70], H=2, HV=4, D=64, dtype=torch.bfloat16))),
    ("q", lambda kw: kw.update({n: kw[n].float() for n in ("q", "k", "v")})),
    # the general path raises for these
    ("cu_seqlens_cpu", lambda kw: kw.update(cu_seqlens_cpu=torch.tensor([0, 5, 4, 75]))),
    ("cu_seqlens_cpu", lambda kw: kw.update(cu_seqlens_cpu=torch.tensor([0, 5, 75]))),
    ("ssm_state_indices", lambda kw: kw.update(_prefill_serving(ssm_state_indices=torch.tensor([[4], [1], [0]])))),
    ("has_initial_state", lambda kw: kw.update(has_initial_state=torch.tensor([True, False, True]))),
    ("has_initial_state", lambda kw: kw.update(_prefill_serving(has_initial_state=torch.tensor([1, 0, 1])))),
    # and copies these
    ("ssm_state_indices", lambda kw: kw.update(_prefill_serving(ssm_state_indices=torch.tensor([4, 9, 1, 7, 0])[::2]))),
]


@needs_extension
@pytest.mark.parametrize("name,mutate", CHUNK_GENERAL_PATH_ONLY,
                         ids=[f"{n}-{i}" for i, (n, _) in enumerate(CHUNK_GENERAL_PATH_ONLY)])
def test_chunk_fast_entry_leaves_other_kernels_and_errors_to_the_general_path(monkeypatch, name, mutate):
    kw = _prefill()
    mutate(kw)
    (answer,) = _chunk_fast_answers(monkeypatch, kw)
    assert answer.startswith(f"{name}:"), answer


@needs_extension
@pytest.mark.parametrize("extra", [
    dict(return_intermediate_states=True), dict(checkpoint_pool=torch.zeros(4, 4, 128, 128),
                                                checkpoint_slots=torch.zeros(3, 2, dtype=torch.int32)),
    dict(chunk_size=16), dict(use_graph=True), dict(cp_context=object()), "force_reference", "debug"])
def test_chunk_fast_entry_is_not_tried_for_states_at_chunk_starts_fla_checks_or_switches(monkeypatch, extra):
    kw = _prefill()
    if isinstance(extra, str):
        monkeypatch.setattr(_ext.config, extra, True)
    else:
        kw.update(extra)
    try:
        answers = _chunk_fast_answers(monkeypatch, kw)
    except NotImplementedError:  # cp_context
        answers = []
    assert answers == []


# --------------------------------------------------------------------------------------------
# Varlen helpers
# --------------------------------------------------------------------------------------------


def test_pack_unpack_roundtrip():
    seqs = [torch.randn(n, 3, 2) for n in (4, 0, 1, 7)]
    packed, cu = pack(seqs)
    assert packed.shape == (1, 12, 3, 2) and cu.tolist() == [0, 4, 4, 5, 12] and cu.dtype == torch.int32
    back = unpack(packed, cu)
    assert all(torch.equal(a, b) for a, b in zip(seqs, back))
    padded = unpack(packed, cu, padded=True)
    assert padded.shape == (4, 7, 3, 2) and torch.count_nonzero(padded[1]) == 0
    packed2, cu2 = pack(padded, lengths=[4, 0, 1, 7])
    assert torch.equal(packed2, packed) and torch.equal(cu2, cu)


def test_pack_errors():
    with pytest.raises(ValueError, match="lengths"):
        pack(torch.zeros(2, 3, 1))
    with pytest.raises(ValueError, match="lengths"):
        pack(torch.zeros(2, 3, 1), lengths=[1, 4])
    with pytest.raises(ValueError, match="trailing shape"):
        pack([torch.zeros(2, 3), torch.zeros(2, 4)])


def test_varlen_call_equals_separate_calls():
    seqs = [make_inputs(T=n, H=1, D=8, state=False, seed=n) for n in (3, 6)]
    names = ("q", "k", "v", "g", "beta")
    packed = {n: pack([s[n][0] for s in seqs])[0] for n in names}
    _, cu = pack([s["q"][0] for s in seqs])
    rest = {n: x for n, x in seqs[0].items() if n not in names}
    rest["A_log"], rest["dt_bias"] = seqs[0]["A_log"], seqs[0]["dt_bias"]
    o, _ = flashkda.chunk_kda(**packed, **rest, cu_seqlens=cu)
    for s, part in zip(seqs, unpack(o, cu)):
        s = dict(s, A_log=rest["A_log"], dt_bias=rest["dt_bias"])
        single, _ = flashkda.chunk_kda(**s)
        torch.testing.assert_close(part, single[0])


# --------------------------------------------------------------------------------------------
# One fact in one place: constants shared by Python and CUDA
# --------------------------------------------------------------------------------------------


def test_cuda_constants_match_python():
    text = (ROOT / "csrc" / "flashkda" / "common" / "constants.h").read_text()
    eps = float(re.search(r"kL2NormEps = ([0-9.e+-]+)f", text).group(1))
    thr = float(re.search(r"kSoftplusThreshold = ([0-9.e+-]+)f", text).group(1))
    assert eps == C.L2NORM_EPS and thr == C.SOFTPLUS_THRESHOLD
    assert float(re.search(r"kLowerBoundMin = ([0-9.e+-]+);", text).group(1)) == C.LOWER_BOUND_MIN
    switch = (ROOT / "csrc" / "flashkda" / "common" / "static_switch.h").read_text()
    dims = sorted(int(d) for d in re.findall(r"CONST_NAME = (\d+);", switch))
    assert tuple(dims) == C.KERNEL_HEAD_DIMS
    params = (ROOT / "csrc" / "flashkda" / "common" / "recurrent_params.h").read_text()
    from flashkda import api

    for name, value in (("kPrecomputed", C.GATE_PRECOMPUTED), ("kLowerBound", C.GATE_LOWER_BOUND),
                        ("kSoftplus", C.GATE_SOFTPLUS)):
        assert re.search(rf"{name} = {value},", params)
    chunk = (ROOT / "csrc" / "flashkda" / "prefill" / "chunk_params.h").read_text()
    assert int(re.search(r"constexpr int kHeadDim = (\d+);", chunk).group(1)) == C.CHUNK_HEAD_DIM
    assert int(re.search(r"constexpr int kChunk = (\d+);", chunk).group(1)) == C.CHUNK_STATE_TOKENS
    binding = (ROOT / "csrc" / "binding" / "device.cpp").read_text()
    assert int(re.search(r"constexpr int kMinComputeMajor = (\d+);", binding).group(1)) == \
        _ext.MIN_COMPUTE_CAPABILITY[0]


@pytest.mark.parametrize("cc, ok", [((7, 5), False), ((8, 0), True), ((8, 9), True), ((12, 0), True)])
def test_devices_without_a_kernel_image_are_named(monkeypatch, cc, ok):
    """Below compute capability 8.0 the build has no kernel image: the reference runs, with the reason."""
    class Image:  # the build has an image for every capable device
        @staticmethod
        def kernel_image_reason(index):
            return None

    monkeypatch.setattr(_ext, "_device_shortfall", {})
    monkeypatch.setattr(_ext, "_C", Image, raising=False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: cc)
    reason = _ext.device_shortfall(0)
    assert (reason is None) == ok
    if not ok:
        assert f"compute capability {cc[0]}.{cc[1]}" in reason


def test_a_build_without_an_image_for_the_device_is_named(monkeypatch, caplog):
    """A capable GPU that the build has no image for (e.g. FLASHKDA_CUDA_ARCHS=90a on an A100): the
    extension's answer becomes the reason, warned once per device."""
    class NoImage:
        @staticmethod
        def kernel_image_reason(index):
            return "no kernel image of this build for the GPU (FLASHKDA_CUDA_ARCHS)"

    monkeypatch.setattr(_ext, "_device_shortfall", {})
    monkeypatch.setattr(_ext, "HAS_EXTENSION", True)
    monkeypatch.setattr(_ext, "_C", NoImage, raising=False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: (12, 0))
    with caplog.at_level(logging.WARNING, logger="flashkda"):
        reason = _ext.device_shortfall(0)
        assert _ext.device_shortfall(0) == reason
    assert reason == "compute capability 12.0: no kernel image of this build for the GPU (FLASHKDA_CUDA_ARCHS)"
    assert [r.levelname for r in caplog.records] == ["WARNING"] and reason in caplog.records[0].getMessage()


@pytest.mark.skipif(not _ext.HAS_EXTENSION, reason="needs the extension")
def test_kernel_image_reason_without_a_gpu_query():
    """The binding's image probe answers None when the device cannot be asked (no GPU here), so that
    the kernels launch and report a CUDA error themselves; on a GPU, None for the default build."""
    if torch.cuda.is_available():
        pytest.skip("the GPU form runs in tests/test_cuda_recurrent.py")
    assert _ext._C.kernel_image_reason(0) is None


def test_kernel_family_switch(monkeypatch):
    """FLASHKDA_KERNEL_FAMILY names map to the extension's KernelFamily values; bad names raise."""
    params = (ROOT / "csrc" / "flashkda" / "common" / "recurrent_params.h").read_text()
    enums = {"auto": "kAuto", "sm80": "kSm80", "sm90": "kSm90"}
    assert set(enums) == set(_ext.KERNEL_FAMILIES)
    for name, value in _ext.KERNEL_FAMILIES.items():
        assert re.search(rf"{enums[name]} = {value},", params)
    for raw, name in (("", "auto"), ("SM80", "sm80"), (" sm90 ", "sm90")):
        monkeypatch.setenv("FLASHKDA_KERNEL_FAMILY", raw)
        assert _ext.Config.from_env().kernel_family == name
    monkeypatch.setenv("FLASHKDA_KERNEL_FAMILY", "sm100")
    with pytest.raises(ValueError, match="FLASHKDA_KERNEL_FAMILY"):
        _ext.Config.from_env()
    before = _ext.config.kernel_family
    with _ext.kernel_family("sm80"):
        assert _ext.config.kernel_family == "sm80"
        with pytest.raises(ValueError, match="kernel family"):
            _ext.set_kernel_family("fast")
    assert _ext.config.kernel_family == before


@pytest.mark.skipif(not _ext.HAS_EXTENSION, reason="needs the extension")
def test_chunk_smem_shortfall(monkeypatch):
    """Devices with less shared memory per block than the chunked kernels need (sm_86, sm_89: 99 KB)
    are named as such, so that prefill runs on the token-by-token kernel there."""
    need = _ext._C.chunk_smem_bytes()
    assert 100 * 1024 < need <= 227 * 1024
    for have, fits in ((227 * 1024, True), (need, True), (need - 1, False), (99 * 1024, False)):
        props = types.SimpleNamespace(shared_memory_per_block_optin=have)
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index, props=props: props)
        for cache in ("_smem_optin", "_chunk_smem_shortfall", "_chunk_bwd_shortfall"):  # real caches untouched
            monkeypatch.setattr(_ext, cache, {})
        reason = _ext.chunk_smem_shortfall(0)
        assert (reason is None) == fits, (have, reason)
        if not fits:
            assert f"{have} bytes of shared memory per block" in reason and str(need) in reason
        # the gradients pass: in value halves where the whole one does not fit (sm_80 has room for
        # them); the transitions pass (fp32 inputs' state maps) needs the whole block
        bwd, trans = _ext.chunk_bwd_shortfall(0), _ext.chunk_bwd_shortfall(0, transitions=True)
        assert (bwd is None) == (have >= _ext._C.chunk_local_grad_split_smem_bytes()), (have, bwd)
        assert (trans is None) == (have >= _ext._C.chunk_local_grad_smem_bytes()), (have, trans)
    assert _ext._C.chunk_local_grad_split_smem_bytes() <= 163 * 1024 < _ext._C.chunk_local_grad_smem_bytes()


def test_chunk_kernel_reasons_and_gate_parameters():
    from flashkda._ext import kernel_param as _kernel_param
    from flashkda.api import _chunk_kernel_unsupported, _validate

    def problem(D, dtype):
        kw = make_inputs(T=3, H=1, D=D, dtype=dtype)
        return _validate("chunk_kda", kw["q"], kw["k"], kw["v"], kw["g"], kw["beta"], scalar_gate=False, scale=None,
                         initial_state=None, cu_seqlens=None, cu_seqlens_cpu=None, use_gate_in_kernel=True,
                         A_log=kw["A_log"], dt_bias=kw["dt_bias"], lower_bound=-5.0,
                         use_beta_sigmoid_in_kernel=True, allow_neg_eigval=False, state_v_first=False), kw["q"]

    assert _chunk_kernel_unsupported(*problem(128, torch.bfloat16)) is None
    assert _chunk_kernel_unsupported(*problem(128, torch.float16)) is None
    assert "head dim 64" in _chunk_kernel_unsupported(*problem(64, torch.bfloat16))
    assert "float32 inputs" in _chunk_kernel_unsupported(*problem(128, torch.float32))
    # Gate parameters reach the kernels as given when contiguous (they index them flat): no copy.
    for t in (torch.randn(4, 128), torch.randn(1, 1, 4, 1), torch.randn(4)):
        assert _kernel_param(t) is t
    strided, wide = torch.randn(128, 4).t(), torch.randn(4, 128, dtype=torch.float64)
    assert _kernel_param(strided).is_contiguous() and torch.equal(_kernel_param(strided), strided)
    assert _kernel_param(wide).dtype == torch.float32


def test_chunk_segment_switch(monkeypatch):
    """FLASHKDA_CHUNK_SEGMENT: chunks per segment of the chunked recurrence, 0 for none, auto
    (default, -1) for the binding's choice."""
    for raw, value in (("", -1), (" Auto", -1), ("0", 0), (" 8 ", 8)):
        monkeypatch.setenv("FLASHKDA_CHUNK_SEGMENT", raw)
        assert _ext.Config.from_env().chunk_segment == value
    for bad in ("-1", "two"):
        monkeypatch.setenv("FLASHKDA_CHUNK_SEGMENT", bad)
        with pytest.raises(ValueError, match="FLASHKDA_CHUNK_SEGMENT"):
            _ext.Config.from_env()


@pytest.mark.parametrize("gdn", [False, True])
def test_decode_takes_the_chunked_functions_keywords(gdn):
    """Model code passes the chunked function's keywords to decode too (FLA accepts them there):
    safe_gate, chunk_size and disable_recompute change nothing; cu_seqlens_cpu is checked."""
    kw = make_inputs(lens=[3, 1, 0], H=2, D=16, gdn=gdn, seed=0)
    fn = public_fn("recurrent", gdn)
    o1, s1 = fn(**kw, output_final_state=True)
    o2, s2 = fn(**kw, output_final_state=True, safe_gate=True, chunk_size=64, disable_recompute=True,
                cu_seqlens_cpu=kw["cu_seqlens"].cpu())
    assert torch.equal(o1, o2) and torch.equal(s1, s2)
    with pytest.raises(ValueError, match="cu_seqlens_cpu"):
        fn(**kw, cu_seqlens_cpu=torch.tensor([0, 2, 5, 5], dtype=torch.int32))
