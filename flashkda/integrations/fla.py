"""flashkda as a backend of FLA (``fla-core``, flash-linear-attention) for KDA and GDN.

FLA 0.6 routes some of its entry points through a backend registry (``fla.backends``): at call
time every registered backend, in priority order, is asked through its *verifier* whether it can
serve the call, and the first one that accepts runs it; the Triton implementation runs when none
does. :func:`register` adds a backend named ``"flashkda"`` for

* ``fla.ops.kda.chunk_kda`` (a per-function registry),
* ``fla.ops.kda.fused_recurrent.fused_recurrent_kda_fwd`` (the ``'kda'`` operation registry); it is
  what FLA's serving decode calls, and what the public ``fla.ops.kda.fused_recurrent_kda`` calls,
* ``fla.ops.gated_delta_rule.chunk_gated_delta_rule`` (the ``'gated_delta_rule'`` operation
  registry; FLA 0.6 dispatches no GDN decode function, so GDN decode stays FLA's).

Its priority (:data:`PRIORITY`) puts it ahead of FLA's built-in backends, including FLA's own
``flash_kda`` and ``flash_qla`` adapters. The verifiers accept exactly the calls that flashkda's CUDA
kernels serve with FLA's semantics, context parallelism (``cp_context``) included, and training
calls of the chunked entries where flashkda's backward is measured faster than FLA's
(:func:`_training_reason`; ``FLASHKDA_FLA_TRAINING`` widens or closes that); everything else (CPU tensors, head
dims other than 64/128, float64, decode under autograd, ...) is rejected
with a reason, logged once by FLA at INFO level, and runs FLA's Triton code as before. The decode
entry registers no verifier, to keep FLA's per-call cost low: its implementation sends the calls
the kernels take straight to them and hands the others, with the same arguments, to FLA's own
function, logging the first reason at INFO (the rules: :func:`fused_recurrent_kda_fwd_verifier`).
Results of served calls are those of :func:`flashkda.chunk_kda` / :func:`flashkda.fused_recurrent_kda`
/ :func:`flashkda.chunk_gated_delta_rule`, returned in FLA's format (see the functions of the same
names in this module).

Usage::

    import flashkda                      # registers the backend when fla is installed, or:
    from flashkda.integrations import fla as flashkda_fla
    flashkda_fla.register()              # idempotent; True when the backend is registered

    from fla.ops.kda import chunk_kda
    with torch.inference_mode():
        o, ht = chunk_kda(q, k, v, g, beta, ...)   # served by flashkda when supported

Switches (read at call time): ``FLASHKDA_FLA_BACKEND=0`` disables the backend (FLA's convention,
``FLA_FLASHKDA=1`` re-enables it); ``FLA_DISABLE_BACKEND_DISPATCH=1`` (read by FLA at import)
disables all of FLA's dispatch, and then :func:`register` returns False. The registry has no public
way to remove a backend, so there is no ``unregister``; use the environment variable.

:func:`register` first checks that FLA's signatures of both entry points are the ones this adapter
mirrors (names, order, defaults) and registers nothing (returns False) when an FLA release changed
them.
"""

from __future__ import annotations

import importlib.util
import inspect
import os
import threading
import warnings
from typing import Optional, Tuple

import torch

from flashkda import _ext
from flashkda import api as _api
from flashkda import autograd as _autograd
from flashkda._ext import log

_is_compiling = torch.compiler.is_compiling

__all__ = [
    "BACKEND_TYPE",
    "ENV_VAR",
    "TRAINING_ENV_VAR",
    "PRIORITY",
    "register",
    "is_registered",
    "registered_backends",
    "maybe_register_on_import",
    "chunk_kda_verifier",
    "fused_recurrent_kda_fwd_verifier",
    "chunk_gated_delta_rule_verifier",
    "chunk_kda",
    "fused_recurrent_kda_fwd",
    "chunk_gated_delta_rule",
]

#: ``backend_type`` in FLA's registries (FLA's own adapter of the ``flash_kda`` package is ``"flash_kda"``).
BACKEND_TYPE = "flashkda"
#: ``FLASHKDA_FLA_BACKEND=0`` disables the backend.
ENV_VAR = "FLASHKDA_FLA_BACKEND"
#: Calls under autograd (read at call time): ``FLASHKDA_FLA_TRAINING=1`` serves every one the chunked
#: entries take, ``=0`` none; unset, those whose backward runs on flashkda's CUDA kernels, measured
#: faster than FLA's (:func:`_training_reason`).
TRAINING_ENV_VAR = "FLASHKDA_FLA_TRAINING"
#: FLA tries lower priorities first; its built-ins use 0 (Ascend NPU), 3 (flash_kda) and 5 (default).
PRIORITY = -10

Verdict = Tuple[bool, Optional[str]]

_lock = threading.Lock()
_registered = False
_backends: tuple = ()  # what registered_backends() returns
_fla_fused_recurrent_kda_fwd = None  # FLA's own fused_recurrent_kda_fwd (Triton), set by register()
_fallback_logged = False

# Keyword arguments of FLA's chunk_kda / chunk_gated_delta_rule (their **kwargs) that the adapters
# understand.
_CHUNK_KWARGS = frozenset({"A_log", "dt_bias", "transpose_state_layout", "chunk_size"})
_GDN_CHUNK_KWARGS = frozenset({"use_gate_in_kernel", "A_log", "dt_bias", "transpose_state_layout", "chunk_size"})


# ----------------------------------------------------------------------------------------------
# Verification. The ``*_reason`` functions mirror FLA's signatures exactly (register() checks
# that), so Python binds the raw positional/keyword arguments FLA's dispatcher passes on.
# They return None when flashkda's CUDA kernels serve the call with FLA's semantics.
# ----------------------------------------------------------------------------------------------


def _kernel_unsupported(p, q, g, beta, initial_state, A_log, dt_bias) -> Optional[str]:
    """Device, extension, FLASHKDA_FORCE_REFERENCE, head dims and dtypes (flashkda.api's rules)."""
    return _api._kernel_unsupported(p, q, g, beta, initial_state, A_log, dt_bias)


def _kernel_reason(fn: str, q, k, v, g, beta, *, initial_state, A_log, dt_bias, scalar_gate=False,
                   **validate) -> Optional[str]:
    """flashkda's own validation, then whether its kernels (not the reference) would run."""
    try:
        p = _api._validate(fn, q, k, v, g, beta, scalar_gate=scalar_gate, initial_state=initial_state, A_log=A_log,
                           dt_bias=dt_bias, **validate)
    except Exception as e:  # noqa: BLE001 - any invalid input is a rejection, FLA then reports it
        return str(e)
    return _kernel_unsupported(p, q, g, beta, initial_state, A_log, dt_bias)


def _training_reason(tensors, cp_context, lower_bound, scalar_gate: bool) -> Optional[str]:
    """Why a call with an input that requires grad under autograd stays FLA's, or None (also for a
    call without one). ``FLASHKDA_FLA_TRAINING=1``: none; ``=0``: every one. Unset: flashkda takes
    the calls whose backward runs on its CUDA kernels, measured faster than FLA's
    (BENCHMARK_H200.md, "Training"): K = V = 128, bf16 / fp16 inputs, a device that runs the
    backward's whole gradients pass, no context parallelism, and a chunk_kda gate with a lower
    bound (no look at the data) or GDN's scalar gate (checked against the kernels' span by the
    forward, the answer read by the backward after its launches; under CUDA graph capture, where
    that read is not allowed, the call stays FLA's). Unbounded chunk_kda gates (the check over
    every channel) and the gradients pass in value halves of sm_80 are not measured faster."""
    q = tensors[0]
    if not _api._needs_grad(*tensors):
        return None
    mode = os.environ.get(TRAINING_ENV_VAR, "").strip()
    if mode == "1":
        return None
    why = f"{TRAINING_ENV_VAR}=0" if mode == "0" else None
    if why is None and scalar_gate and q.is_cuda and torch.cuda.is_current_stream_capturing():
        why = "under CUDA graph capture flashkda's GDN backward cannot read its check of the gate's span"
    if why is None and not scalar_gate and lower_bound is None:
        why = "without a lower-bound gate flashkda's backward reads the gate back and is not measured faster"
    if why is None and cp_context is not None:
        why = "context parallelism under autograd is not measured faster than FLA's"
    if why is None and q.dtype not in (torch.bfloat16, torch.float16):
        why = f"{q.dtype} inputs (flashkda's measured backward: bfloat16 / float16)"
    v = tensors[2]
    if why is None and isinstance(v, torch.Tensor):
        why = _autograd.head_dim_shortfall(q.shape[-1], v.shape[-1])
    if why is None and q.is_cuda and _ext.HAS_EXTENSION:
        short = _ext.chunk_bwd_shortfall(q.get_device())
        if short is None and not scalar_gate and not _autograd._gate_bounded(True, lower_bound):
            short = f"lower_bound={lower_bound} (16 tokens may decay beyond the kernels' span)"
        if short is not None:
            why = f"flashkda's backward kernels do not serve it: {short}"
        elif _ext.chunk_bwd_in_value_halves(q.get_device()):
            why = "flashkda's gradients pass in value halves (sm_80) is not measured faster than FLA's"
    if why is None:
        return None
    return f"an input requires grad: {why} ({TRAINING_ENV_VAR}=1 serves training calls)"


def _chunk_options_reason(tensors, cp_context, kwargs, known_kwargs, chunk_sizes, state_v_first,
                          training_reason: Optional[str]) -> Tuple[Optional[str], bool]:
    """The rules that FLA's chunk_kda and chunk_gated_delta_rule share: autograd
    (``training_reason``, :func:`_training_reason`), their ``**kwargs``, ``chunk_size`` and the
    deprecated layout name. Returns the reason (None: none of them rejects the call) and the state
    layout."""
    if training_reason is not None:
        return training_reason, state_v_first
    unknown = sorted(set(kwargs) - known_kwargs)
    if unknown:
        return f"keyword arguments {unknown} are not supported", state_v_first
    if kwargs.get("chunk_size", 64) not in chunk_sizes:
        return f"chunk_size={kwargs['chunk_size']!r} (FLA raises its error)", state_v_first
    if "transpose_state_layout" in kwargs:
        if state_v_first:
            return "both state_v_first and the deprecated transpose_state_layout are given", state_v_first
        state_v_first = bool(kwargs["transpose_state_layout"])
    return None, state_v_first


def _context_reason(cp_context, initial_state, states_out) -> Optional[str]:
    """FLA's restrictions under context parallelism (FLA asserts them), or None."""
    if getattr(cp_context, "cu_seqlens", None) is None:
        return "cp_context without cu_seqlens (FLA asserts it)"
    if initial_state is not None or states_out:
        return "cp_context with initial_state or states to return (FLA asserts neither is given)"
    return None


def _chunk_kda_reason(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                      use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False,
                      allow_neg_eigval=False, safe_gate=False, lower_bound=None, disable_recompute=False,
                      return_intermediate_states=False, state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None,
                      cp_context=None, use_graph=False, max_num_seqs=None, **kwargs) -> Optional[str]:
    if not isinstance(q, torch.Tensor):
        return f"q must be a torch.Tensor, got {type(q).__name__}"
    A_log, dt_bias = (kwargs.get("A_log"), kwargs.get("dt_bias")) if use_gate_in_kernel else (None, None)
    tensors = (q, k, v, g, beta, initial_state, A_log, dt_bias)
    training = _training_reason(tensors, cp_context, lower_bound if use_gate_in_kernel else None, False)
    reason, state_v_first = _chunk_options_reason(tensors, cp_context, kwargs, _CHUNK_KWARGS, _api._KDA_CHUNK_SIZES,
                                                  state_v_first, training)
    if reason is not None:
        return reason
    if cp_context is not None:
        why = _context_reason(cp_context, initial_state, output_final_state or return_intermediate_states)
        if why is not None:
            return why
        cu_seqlens, cu_seqlens_cpu = cp_context.cu_seqlens, cp_context.cu_seqlens_cpu
    if return_intermediate_states and _api._needs_grad(q, k, v, g, beta, initial_state, A_log, dt_bias):
        return "return_intermediate_states with an input that requires grad (FLA asserts inference mode)"
    if use_gate_in_kernel:
        if A_log is None and lower_bound is None:
            return "use_gate_in_kernel=True needs A_log when lower_bound is not set"
        if safe_gate and lower_bound is None:
            return "safe_gate=True with use_gate_in_kernel=True needs lower_bound"
    else:
        lower_bound = None  # FLA reads lower_bound only for the fused gate
    if (use_graph and max_num_seqs is not None and isinstance(cu_seqlens, torch.Tensor)
            and cu_seqlens.shape[0] - 1 != max_num_seqs):
        return f"use_graph needs cu_seqlens padded to max_num_seqs + 1 = {max_num_seqs + 1} entries"
    return _kernel_reason("chunk_kda", q, k, v, g, beta, initial_state=initial_state, A_log=A_log,
                          dt_bias=dt_bias, scale=scale, cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu,
                          use_gate_in_kernel=use_gate_in_kernel, lower_bound=lower_bound,
                          use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
                          allow_neg_eigval=allow_neg_eigval, state_v_first=state_v_first)


def _chunk_gated_delta_rule_reason(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                                   use_qk_l2norm_in_kernel=False, use_beta_sigmoid_in_kernel=False,
                                   allow_neg_eigval=False, state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None,
                                   chunk_indices=None, cp_context=None, **kwargs) -> Optional[str]:
    if not isinstance(q, torch.Tensor):
        return f"q must be a torch.Tensor, got {type(q).__name__}"
    use_gate_in_kernel = bool(kwargs.get("use_gate_in_kernel", False))
    A_log, dt_bias = (kwargs.get("A_log"), kwargs.get("dt_bias")) if use_gate_in_kernel else (None, None)
    tensors = (q, k, v, g, beta, initial_state, A_log, dt_bias)
    reason, state_v_first = _chunk_options_reason(tensors, cp_context, kwargs, _GDN_CHUNK_KWARGS,
                                                  _api._GDN_CHUNK_SIZES, state_v_first,
                                                  _training_reason(tensors, cp_context, None, True))
    if reason is not None:
        return reason
    if cp_context is not None:
        why = _context_reason(cp_context, initial_state, output_final_state)
        if why is not None:
            return why
        cu_seqlens, cu_seqlens_cpu = cp_context.cu_seqlens, cp_context.cu_seqlens_cpu
    if use_gate_in_kernel and A_log is None:
        return "use_gate_in_kernel=True needs A_log (FLA asserts it)"
    return _kernel_reason("chunk_gated_delta_rule", q, k, v, g, beta, initial_state=initial_state, A_log=A_log,
                          dt_bias=dt_bias, scale=scale, cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu,
                          use_gate_in_kernel=use_gate_in_kernel, lower_bound=None,
                          use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
                          allow_neg_eigval=allow_neg_eigval, state_v_first=state_v_first, scalar_gate=True)


def _num_seqs(q: torch.Tensor, cu_seqlens) -> int:
    return q.shape[0] if cu_seqlens is None else len(cu_seqlens) - 1


def _fast_args(q, k, v, g, beta, A_log, dt_bias, initial_state, scale, output_final_state, inplace_final_state,
               state_v_first, cu_seqlens, ssm_state_indices, num_accepted_tokens, use_qk_l2norm_in_kernel,
               use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, lower_bound, out, kwargs):
    """The arguments of flashkda's fast entry (``flashkda.api._fast``) for FLA's
    ``fused_recurrent_kda_fwd`` call, or None when the call needs the general rules.

    The common serving calls map one to one: a pool with ``ssm_state_indices`` (in place), or a
    new final state (``inplace_final_state=False``, FLA's public ``fused_recurrent_kda``). The fast
    entry applies flashkda's own rules in C++; what is tested here are the FLA rules of
    :func:`_fused_recurrent_kda_fwd_reason` that such a call may break, in a few attribute reads.
    """
    idx = ssm_state_indices
    if (kwargs or q.__class__ is not torch.Tensor or q.dim() != 4
            or bool(inplace_final_state) is (idx is None)  # rows [0, N) in place, or slots not in place
            or (use_gate_in_kernel and A_log is None and lower_bound is None)
            # 1-D slots: FLA and flashkda agree when there is one token in all (see the reason)
            or (idx.__class__ is torch.Tensor and idx.dim() == 1 and q.shape[1] != 1)
            or torch.is_grad_enabled()):
        return None
    if not use_gate_in_kernel:
        A_log = dt_bias = lower_bound = None  # FLA reads them only for the fused gate
    return (q, k, v, g, beta, A_log, dt_bias, scale, initial_state, output_final_state and idx is None,
            use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel,
            allow_neg_eigval and use_beta_sigmoid_in_kernel, lower_bound, state_v_first, cu_seqlens, idx,
            num_accepted_tokens if idx is not None else None, out, False)


def _fused_recurrent_kda_fwd_reason(q, k, v, g, beta, A_log=None, dt_bias=None, initial_state=None, scale=None,
                                    output_final_state=False, inplace_final_state=True, state_v_first=False,
                                    cu_seqlens=None, ssm_state_indices=None, num_accepted_tokens=None,
                                    use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False,
                                    use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, lower_bound=None,
                                    out=None, **kwargs) -> Optional[str]:
    if kwargs:
        return f"keyword arguments {sorted(kwargs)} are not supported"
    if use_gate_in_kernel and A_log is None and lower_bound is None:
        # FLA's kernel then scales the softplus gate by exp(1.0); flashkda's A_log=None means a scale of 1.
        return "use_gate_in_kernel=True without A_log and lower_bound (FLA's gate differs from flashkda's)"
    if ssm_state_indices is not None and not inplace_final_state:
        return "ssm_state_indices with inplace_final_state=False is not supported"
    if not isinstance(q, torch.Tensor):
        return f"q must be a torch.Tensor, got {type(q).__name__}"
    if not use_gate_in_kernel:
        A_log = dt_bias = lower_bound = None  # FLA reads them only for the fused gate
    if _api._needs_grad(q, k, v, g, beta, initial_state, A_log, dt_bias):
        return "an input requires grad with autograd enabled (decode is forward-only)"
    if ssm_state_indices is not None:
        if isinstance(ssm_state_indices, torch.Tensor) and ssm_state_indices.dim() == 1:
            if q.dim() >= 2 and q.shape[1] > 1:
                # FLA writes the state after token t to slot indices[n + t]; flashkda writes the state
                # after the last token to indices[n]. They agree when no sequence has two tokens,
                # which the shapes prove only when there is at most one token in all.
                what = "with cu_seqlens, more than one token in all" if cu_seqlens is not None else \
                    "more than one token per sequence"
                return f"1-D ssm_state_indices {what} (use [N, T_max] indices)"
        pool = initial_state
    else:
        num_accepted_tokens = None  # FLA ignores it without ssm_state_indices
        if inplace_final_state:
            if initial_state is None:
                return "inplace_final_state=True needs initial_state"
            if not isinstance(initial_state, torch.Tensor):
                return f"initial_state must be a torch.Tensor, got {type(initial_state).__name__}"
            # FLA updates rows [0, N) of initial_state in place; flashkda's pool mode with slots
            # arange(N) does the same.
            N = _num_seqs(q, cu_seqlens)
            if initial_state.dim() != 4 or initial_state.shape[0] < N:
                return f"initial_state must have shape [>= {N}, HV, ...], got {list(initial_state.shape)}"
            why = _api.pool_layout_reason(initial_state)
            if why is not None:
                return f"initial_state: {why}"
            pool = initial_state[:N]
        else:
            pool = initial_state
    return _kernel_reason("fused_recurrent_kda_fwd", q, k, v, g, beta, initial_state=pool, A_log=A_log,
                          dt_bias=dt_bias, scale=scale, cu_seqlens=cu_seqlens, cu_seqlens_cpu=None,
                          use_gate_in_kernel=use_gate_in_kernel, lower_bound=lower_bound,
                          use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
                          allow_neg_eigval=allow_neg_eigval and use_beta_sigmoid_in_kernel,
                          state_v_first=state_v_first, ssm_state_indices=ssm_state_indices,
                          num_accepted_tokens=num_accepted_tokens, out=out)


def _verdict(reason_fn, args, kwargs) -> Verdict:
    try:
        reason = reason_fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - e.g. a TypeError from binding the arguments
        reason = f"{type(e).__name__}: {e}"
    if reason is None:
        return True, None
    return False, reason if reason.startswith("flashkda: ") else f"flashkda: {reason}"


def chunk_kda_verifier(*args, **kwargs) -> Verdict:
    """``(True, None)`` when flashkda serves ``fla.ops.kda.chunk_kda(*args, **kwargs)``, else ``(False, reason)``."""
    return _verdict(_chunk_kda_reason, args, kwargs)


def chunk_gated_delta_rule_verifier(*args, **kwargs) -> Verdict:
    """``(True, None)`` when flashkda serves ``fla.ops.gated_delta_rule.chunk_gated_delta_rule(*args,
    **kwargs)``, else ``(False, reason)``."""
    return _verdict(_chunk_gated_delta_rule_reason, args, kwargs)


def fused_recurrent_kda_fwd_verifier(q, k, v, g, beta, A_log=None, dt_bias=None, initial_state=None, scale=None,
                                     output_final_state=False, inplace_final_state=True, state_v_first=False,
                                     cu_seqlens=None, ssm_state_indices=None, num_accepted_tokens=None,
                                     use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False,
                                     use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, lower_bound=None,
                                     out=None, **kwargs) -> Verdict:
    """``(True, None)`` when flashkda serves FLA's ``fused_recurrent_kda_fwd`` with these arguments, else
    ``(False, reason)``; never raises.

    Not registered as FLA's verifier: a decode step would pay for it on every call. The backend
    registers no verifier for this entry, so FLA hands every call to :func:`fused_recurrent_kda_fwd`,
    which sends the calls its fast entry takes straight to the kernels and applies these rules to
    the others, running FLA's own function for those they reject.
    """
    return _verdict(_fused_recurrent_kda_fwd_reason,
                    (q, k, v, g, beta, A_log, dt_bias, initial_state, scale, output_final_state, inplace_final_state,
                     state_v_first, cu_seqlens, ssm_state_indices, num_accepted_tokens, use_qk_l2norm_in_kernel,
                     use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, lower_bound, out), kwargs)


# ----------------------------------------------------------------------------------------------
# Implementations with FLA's signatures and return values.
# ----------------------------------------------------------------------------------------------


def _fla_fallback(reason: str, *args, **kwargs):
    """FLA's own ``fused_recurrent_kda_fwd`` for a call that FLA handed to flashkda (no verifier asked)
    and flashkda's rules reject; the first such call is logged at INFO (FLA's level for a
    rejection), every one at DEBUG."""
    global _fallback_logged
    if not _fallback_logged:
        _fallback_logged = True
        log.info("flashkda: FLA's fused_recurrent_kda_fwd runs FLA's kernel: %s", reason)
    else:
        log.debug("flashkda: FLA's fused_recurrent_kda_fwd runs FLA's kernel: %s", reason)
    fla_fn = _fla_fused_recurrent_kda_fwd
    if fla_fn is None:  # the adapter called before register(): FLA's function as registered would be
        from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd as dispatched
        fla_fn = inspect.unwrap(dispatched)
    return fla_fn(*args, **kwargs)


def _renamed_state_layout(state_v_first, kwargs):
    """``state_v_first``, or FLA's deprecated name for it in ``kwargs``, warned as FLA warns (the
    verifier has rejected a call that gives both)."""
    if "transpose_state_layout" not in kwargs:
        return state_v_first
    # stacklevel: the caller of FLA's dispatcher, as FLA's own warning points at
    warnings.warn("`transpose_state_layout` is deprecated and renamed to `state_v_first`.",
                  DeprecationWarning, stacklevel=5)
    return bool(kwargs["transpose_state_layout"])


def chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
              use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False,
              allow_neg_eigval=False, safe_gate=False, lower_bound=None, disable_recompute=False,
              return_intermediate_states=False, state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None,
              cp_context=None, use_graph=False, max_num_seqs=None, **kwargs):
    """``fla.ops.kda.chunk_kda`` computed by :func:`flashkda.chunk_kda`; returns ``(o, final_state)``,
    or ``(o, final_state, h)`` with ``return_intermediate_states``.

    Meant for calls that :func:`chunk_kda_verifier` accepts (FLA's dispatcher guarantees it);
    ``disable_recompute``, ``use_graph`` and ``max_num_seqs`` do not change a forward result.
    """
    state_v_first = _renamed_state_layout(state_v_first, kwargs)
    if use_gate_in_kernel:
        A_log, dt_bias = kwargs.get("A_log"), kwargs.get("dt_bias")
    else:
        A_log = dt_bias = lower_bound = None
    return _api.chunk_kda(
        q, k, v, g, beta, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
        use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
        safe_gate=safe_gate, lower_bound=lower_bound, state_v_first=state_v_first, cu_seqlens=cu_seqlens,
        cu_seqlens_cpu=cu_seqlens_cpu, A_log=A_log, dt_bias=dt_bias,
        return_intermediate_states=return_intermediate_states, cp_context=cp_context)


def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                           use_qk_l2norm_in_kernel=False, use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False,
                           state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None, chunk_indices=None,
                           cp_context=None, **kwargs):
    """``fla.ops.gated_delta_rule.chunk_gated_delta_rule`` computed by
    :func:`flashkda.chunk_gated_delta_rule`; returns ``(o, final_state)``.

    Meant for calls that :func:`chunk_gated_delta_rule_verifier` accepts; ``chunk_indices`` and
    ``chunk_size`` do not change a forward result. With ``use_gate_in_kernel`` (a keyword of FLA's
    ``**kwargs``, as ``A_log`` and ``dt_bias``) the gate is ``-exp(A_log) * softplus(g + dt_bias)``.
    """
    state_v_first = _renamed_state_layout(state_v_first, kwargs)
    use_gate_in_kernel = bool(kwargs.get("use_gate_in_kernel", False))
    A_log, dt_bias = (kwargs.get("A_log"), kwargs.get("dt_bias")) if use_gate_in_kernel else (None, None)
    return _api.chunk_gated_delta_rule(
        q, k, v, g, beta, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
        use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
        state_v_first=state_v_first, cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu, A_log=A_log,
        dt_bias=dt_bias, chunk_size=kwargs.get("chunk_size", 64), cp_context=cp_context)


def fused_recurrent_kda_fwd(q, k, v, g, beta, A_log=None, dt_bias=None, initial_state=None, scale=None,
                            output_final_state=False, inplace_final_state=True, state_v_first=False,
                            cu_seqlens=None, ssm_state_indices=None, num_accepted_tokens=None,
                            use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False,
                            use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, lower_bound=None,
                            out=None, **kwargs):
    """FLA's ``fused_recurrent_kda_fwd`` computed by :func:`flashkda.fused_recurrent_kda`.

    Returns ``(out, final_state)`` like FLA: with ``inplace_final_state=True`` (FLA's default)
    ``final_state`` is ``initial_state`` itself, updated in place (per slot of ``ssm_state_indices``,
    or rows ``[0, N)`` without indices); otherwise a new float32 state when ``output_final_state``,
    else None. Takes every call of FLA's entry: one that :func:`fused_recurrent_kda_fwd_verifier`
    rejects runs FLA's own function with the same arguments (logged once at INFO).
    """
    args = None
    if _api._fast is not None and not (_ext.config.force_reference or _ext.config.debug) and not _is_compiling():
        args = _fast_args(q, k, v, g, beta, A_log, dt_bias, initial_state, scale, output_final_state,
                          inplace_final_state, state_v_first, cu_seqlens, ssm_state_indices, num_accepted_tokens,
                          use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval,
                          lower_bound, out, kwargs)
        if args is not None:
            r = _api._fast(*args)
            if r.__class__ is tuple:
                return r  # serving: (out, the pool); otherwise (out, new state or None), as FLA returns
    declined = args is not None  # the fast entry has seen these arguments: not again below
    # FLA asked no verifier (the backend registers none for this entry): the rules decide here.
    reason = fused_recurrent_kda_fwd_verifier(
        q, k, v, g, beta, A_log, dt_bias, initial_state, scale, output_final_state, inplace_final_state,
        state_v_first, cu_seqlens, ssm_state_indices, num_accepted_tokens, use_qk_l2norm_in_kernel,
        use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, lower_bound, out, **kwargs)[1]
    if reason is not None:
        return _fla_fallback(reason, q, k, v, g, beta, A_log, dt_bias, initial_state, scale, output_final_state,
                             inplace_final_state, state_v_first, cu_seqlens, ssm_state_indices, num_accepted_tokens,
                             use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval,
                             lower_bound, out, **kwargs)
    if not use_gate_in_kernel:
        A_log = dt_bias = lower_bound = None
    allow_neg_eigval = allow_neg_eigval and use_beta_sigmoid_in_kernel  # FLA ignores it without the sigmoid

    def decode(output_final_state, ssm_state_indices, num_accepted_tokens):
        if declined:  # straight to the general path, which words the errors and copies what it must
            return _api._recurrent("fused_recurrent_kda", False, q, k, v, g, beta, A_log, dt_bias, scale,
                                   initial_state, output_final_state, use_qk_l2norm_in_kernel, use_gate_in_kernel,
                                   use_beta_sigmoid_in_kernel, allow_neg_eigval, lower_bound, state_v_first,
                                   cu_seqlens, ssm_state_indices, num_accepted_tokens, out)
        return _api.fused_recurrent_kda(
            q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, scale=scale, initial_state=initial_state,
            output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
            use_gate_in_kernel=use_gate_in_kernel, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
            allow_neg_eigval=allow_neg_eigval, lower_bound=lower_bound, state_v_first=state_v_first,
            cu_seqlens=cu_seqlens, ssm_state_indices=ssm_state_indices, num_accepted_tokens=num_accepted_tokens,
            out=out)

    if inplace_final_state:
        if ssm_state_indices is None:
            N = _num_seqs(q, cu_seqlens)
            ssm_state_indices = torch.arange(N, dtype=torch.int32, device=q.device)
            num_accepted_tokens = None
        o, _ = decode(False, ssm_state_indices, num_accepted_tokens)
        return o, initial_state
    return decode(output_final_state, None, None)


# ----------------------------------------------------------------------------------------------
# Registration.
# ----------------------------------------------------------------------------------------------


def _signature(fn):
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


def _make_backends(BaseBackend):
    class _FlashKDABackend(BaseBackend):
        backend_type = BACKEND_TYPE
        package_name = None
        env_var = ENV_VAR
        default_enable = True
        priority = PRIORITY

        @classmethod
        def is_available(cls) -> bool:
            return _ext.HAS_EXTENSION

        def is_enabled(self) -> bool:
            # FLA's rule (FLA_FLASHKDA=1 forces the backend on, else FLASHKDA_FLA_BACKEND=0 turns it
            # off), read at every call as FLA does, with one environment lookup in the usual case.
            env = os.environ
            return env.get(ENV_VAR, "1") != "0" or env.get("FLA_FLASHKDA", "0") != "0"

    class FlashKDAChunkBackend(_FlashKDABackend):
        """flashkda for ``fla.ops.kda.chunk_kda``."""

        # Static: FLA finds them by name and calls them with the call's own arguments, which bind
        # once, to FLA's signature (no bound method, no repacking on the way).
        chunk_kda_verifier = staticmethod(chunk_kda_verifier)
        chunk_kda = staticmethod(chunk_kda)

    class FlashKDAOpBackend(_FlashKDABackend):
        """flashkda for the ``'kda'`` operation registry (only ``fused_recurrent_kda_fwd``)."""

        # No verifier: FLA then calls the implementation at once, and it decides (a decode step
        # pays for FLA's dispatcher on every call; a verifier would add a second pass over the
        # arguments).
        fused_recurrent_kda_fwd = staticmethod(fused_recurrent_kda_fwd)

    class FlashKDAGatedDeltaRuleBackend(_FlashKDABackend):
        """flashkda for the ``'gated_delta_rule'`` operation registry (only ``chunk_gated_delta_rule``)."""

        chunk_gated_delta_rule_verifier = staticmethod(chunk_gated_delta_rule_verifier)
        chunk_gated_delta_rule = staticmethod(chunk_gated_delta_rule)

    return FlashKDAChunkBackend, FlashKDAOpBackend, FlashKDAGatedDeltaRuleBackend


def register() -> bool:
    """Register flashkda in FLA's backend registries; True when it is registered.

    Idempotent: a second call changes nothing. Imports ``fla.ops.kda`` (raises ImportError when FLA,
    or what it needs, is missing). Returns False, registering nothing, when FLA's dispatch is
    disabled (``FLA_DISABLE_BACKEND_DISPATCH=1``) or FLA's KDA signatures differ from the ones
    mirrored here. The GDN backend (``chunk_gated_delta_rule``) is registered beside them when FLA's
    signature of that function is the mirrored one too, else left out (logged at debug level).
    """
    global _registered
    with _lock:
        if _registered:
            return True
        import fla.backends as fla_backends
        from fla.ops.kda import chunk_kda as fla_chunk_kda
        from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd as fla_fused_recurrent_kda_fwd

        if getattr(fla_backends, "_DISPATCH_DISABLED", False):
            log.debug("flashkda: FLA_DISABLE_BACKEND_DISPATCH=1; the FLA backend is not registered")
            return False
        kda_pairs = ((fla_chunk_kda, (_chunk_kda_reason, chunk_kda)),
                     (fla_fused_recurrent_kda_fwd, (_fused_recurrent_kda_fwd_reason, fused_recurrent_kda_fwd,
                                                    fused_recurrent_kda_fwd_verifier)))
        if not _signatures_match(kda_pairs):
            return False
        chunk_backend, op_backend, gdn_backend = _make_backends(fla_backends.BaseBackend)
        fla_backends.register(fla_chunk_kda)(chunk_backend)
        fla_backends.register("kda")(op_backend)
        global _backends, _fla_fused_recurrent_kda_fwd
        _fla_fused_recurrent_kda_fwd = inspect.unwrap(fla_fused_recurrent_kda_fwd)
        gdn_registered = False
        try:
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk_gdn
        except ImportError as e:
            log.debug("flashkda: FLA's chunk_gated_delta_rule not importable (%s); no GDN backend", e)
        else:
            if _signatures_match(((fla_chunk_gdn, (_chunk_gated_delta_rule_reason, chunk_gated_delta_rule)),)):
                fla_backends.register("gated_delta_rule")(gdn_backend)
                gdn_registered = True
        _backends = (fla_backends._function_registries[inspect.unwrap(fla_chunk_kda)]._backends[BACKEND_TYPE],
                     fla_backends._get_operation_registry("kda")._backends[BACKEND_TYPE],
                     fla_backends._get_operation_registry("gated_delta_rule")._backends[BACKEND_TYPE]
                     if gdn_registered else None)
        _registered = True
        log.debug("flashkda: registered as FLA backend %r (priority %d) for chunk_kda, fused_recurrent_kda_fwd%s",
                  BACKEND_TYPE, PRIORITY, " and chunk_gated_delta_rule" if gdn_registered else "")
        return True


def _signatures_match(pairs) -> bool:
    """Whether each FLA function of ``pairs`` has the signature of the flashkda functions beside it."""
    for theirs, ours in pairs:
        if any(_signature(theirs) != _signature(fn) for fn in ours):
            log.debug("flashkda: FLA's %s has signature %s, not the one flashkda mirrors; its backend is not "
                      "registered", theirs.__name__, inspect.signature(theirs))
            return False
    return True


def is_registered() -> bool:
    """Whether :func:`register` has registered the backend in this process."""
    return _registered


def registered_backends() -> tuple:
    """The backend objects in FLA's registries, ``(chunk_kda's, the 'kda' operations', the
    'gated_delta_rule' operations')`` (the last None when FLA's GDN function was not mirrored), or
    ``()`` before :func:`register`. FLA calls their methods by name (``chunk_kda``,
    ``fused_recurrent_kda_fwd``, ``chunk_gated_delta_rule``, and the two chunk entries'
    ``*_verifier``), so an attribute set on one of them (a counting wrapper, say) is what FLA calls."""
    return _backends


def maybe_register_on_import() -> bool:
    """:func:`register` when FLA is installed and ``FLASHKDA_FLA_BACKEND`` is not ``0``; never raises.

    Imports nothing heavy when FLA is not installed, the variable is ``0``, or flashkda's CUDA
    extension is missing (the backend could serve nothing). Failures are logged at debug level
    on the ``flashkda`` logger.
    """
    if os.environ.get(ENV_VAR, "1").strip() == "0" or not _ext.HAS_EXTENSION:
        return False
    try:
        if importlib.util.find_spec("fla") is None:
            return False
    except (ImportError, ValueError):
        return False
    try:
        return register()
    except Exception as e:  # noqa: BLE001 - an optional integration must never break importing flashkda
        log.debug("flashkda: FLA backend not registered: %s: %s", type(e).__name__, e)
        return False
