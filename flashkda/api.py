"""The public functions of the contract (``docs/SPEC.md``): validation, then dispatch.

Every function validates its arguments first (``ValueError``/``TypeError`` naming the argument),
then runs a CUDA kernel when the extension is present and the inputs are supported, and the
PyTorch reference (:mod:`flashkda.reference`) otherwise. The reason for every fallback is logged at
debug level on the ``flashkda`` logger. The CUDA path never synchronises with the device.

Eager CUDA calls first try one C++ entry point that checks every argument and launches (the host
time of a decode step, or of a short prefill, matters as much as the kernels'): see :data:`_fast`
and :data:`_chunk_fast`.
"""

from __future__ import annotations

import warnings
from typing import Any, Optional, Tuple

import torch

from flashkda import _constants as C
from flashkda import _ext
from flashkda._ext import log
from flashkda.autograd import ChunkFunction, ChunkOptions, forward_gate_check, forward_records
from flashkda.reference import kda_reference

__all__ = ["chunk_kda", "fused_recurrent_kda", "chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule"]

_FLOAT_TYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_STATE_TYPES = (torch.float32, torch.bfloat16, torch.float64)
_INDEX_TYPES = (torch.int32, torch.int64)


#: ``flashkda._C.fused_recurrent`` (None without the extension): the public ``fused_recurrent_*``
#: arguments, positional, plus ``scalar_gate``. It applies every rule of :func:`_validate` and
#: :func:`_kernel_unsupported` in C++ and, when the kernel takes the inputs as they are (nothing
#: to copy), launches it and returns ``(o, final_state)``; otherwise it returns a str saying why
#: not, and the call takes the general path (:func:`_recurrent`), which raises the documented
#: errors, copies strided inputs or runs the reference. Compiled code (it needs the registered
#: op) and ``FLASHKDA_FORCE_REFERENCE`` / ``FLASHKDA_DEBUG`` always take the general path.
_fast = _ext.fused_recurrent_fast if _ext.HAS_EXTENSION else None
#: ``flashkda._C.chunk`` (None without the extension), the same for ``chunk_kda`` and
#: ``chunk_gated_delta_rule``: the tensor and gate arguments as :data:`_fast` takes them up to
#: ``cu_seqlens``, then ``cu_seqlens_cpu``, ``ssm_state_indices``, ``has_initial_state``, the
#: chunked kernels' ``value_split`` and ``segment_chunks`` (``_ext.config``) and ``scalar_gate``.
#: It adds the rules of :func:`_chunk_kernel_unsupported`. Calls with FLA's options that need
#: checking, or with states at chunk starts, take the general path (:func:`_chunk`) at once.
_chunk_fast = _ext.chunk_fast if _ext.HAS_EXTENSION else None
_is_compiling = torch.compiler.is_compiling


def _tensor(x: Any, name: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"flashkda: {name} must be a torch.Tensor, got {type(x).__name__}")
    return x


def _opt_tensor(x: Any, name: str) -> Optional[torch.Tensor]:
    return None if x is None else _tensor(x, name)


def _dtype(x: torch.Tensor, name: str, allowed) -> None:
    if x.dtype not in allowed:
        names = ", ".join(str(d).replace("torch.", "") for d in allowed)
        raise TypeError(f"flashkda: {name} must have dtype in ({names}), got {str(x.dtype).replace('torch.', '')}")


def _shape(x: torch.Tensor, name: str, expected: Tuple[int, ...], what: str) -> None:
    if x.shape != expected:
        raise ValueError(f"flashkda: {name} must have shape {what} = {list(expected)}, got {list(x.shape)}")


def _device(x: torch.Tensor, name: str, device: torch.device) -> None:
    # get_device() is an int (-1 on the CPU): far cheaper than building torch.device objects.
    if x.get_device() != device.index if device.type == "cuda" else x.device != device:
        raise ValueError(f"flashkda: {name} is on {x.device}, expected {device} (the device of q)")


class _Problem:
    """Validated arguments plus the derived sizes the dispatch needs."""

    __slots__ = ("B", "T", "H", "HV", "K", "V", "N", "scalar_gate", "scale", "gate_mode", "serving")


def _validate(
    fn: str, q, k, v, g, beta, *, scalar_gate: bool, scale, initial_state, cu_seqlens, cu_seqlens_cpu,
    use_gate_in_kernel: bool, A_log, dt_bias, lower_bound, use_beta_sigmoid_in_kernel: bool,
    allow_neg_eigval: bool, state_v_first: bool, ssm_state_indices=None, num_accepted_tokens=None, out=None,
    has_initial_state=None,
) -> _Problem:
    _tensor(q, "q"), _tensor(k, "k"), _tensor(v, "v"), _tensor(g, "g"), _tensor(beta, "beta")
    if q.dim() != 4:
        raise ValueError(f"flashkda: q must be 4-D [B, T, H, K], got shape {list(q.shape)}")
    B, T, H, K = q.shape
    _shape(k, "k", (B, T, H, K), "[B, T, H, K] like q")
    if v.dim() != 4 or v.shape[0] != B or v.shape[1] != T:
        raise ValueError(f"flashkda: v must have shape [B, T, HV, V] = [{B}, {T}, HV, V], got {list(v.shape)}")
    HV, V = v.shape[2], v.shape[3]
    if H == 0 or HV % H != 0:
        raise ValueError(f"flashkda: the value heads of v ({HV}) must be a multiple of the heads of q ({H})")
    if scalar_gate:
        _shape(g, "g", (B, T, HV), "[B, T, HV]")
    else:
        _shape(g, "g", (B, T, HV, K), "[B, T, HV, K]")
    _shape(beta, "beta", (B, T, HV), "[B, T, HV]")
    _dtype(q, "q", _FLOAT_TYPES)
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"flashkda: q, k and v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    _dtype(g, "g", _FLOAT_TYPES)
    _dtype(beta, "beta", _FLOAT_TYPES)
    dev = q.device
    di = q.get_device()
    if k.get_device() != di or v.get_device() != di or g.get_device() != di or beta.get_device() != di:
        for x, n in ((k, "k"), (v, "v"), (g, "g"), (beta, "beta")):
            _device(x, n, dev)

    if scale is not None and not isinstance(scale, (int, float)):
        raise TypeError(f"flashkda: scale must be a float or None, got {type(scale).__name__}")
    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
        raise ValueError("flashkda: allow_neg_eigval=True needs use_beta_sigmoid_in_kernel=True")
    if lower_bound is not None:
        if not isinstance(lower_bound, (int, float)):
            raise TypeError(f"flashkda: lower_bound must be a float or None, got {type(lower_bound).__name__}")
        if not (C.LOWER_BOUND_MIN <= lower_bound < 0):
            raise ValueError(f"flashkda: lower_bound must lie in [{C.LOWER_BOUND_MIN}, 0), got {lower_bound}")
    if use_gate_in_kernel:
        if A_log is not None:
            A_log = _tensor(A_log, "A_log")
            _dtype(A_log, "A_log", _FLOAT_TYPES)
            if A_log.numel() != HV:
                raise ValueError(f"flashkda: A_log must hold HV = {HV} elements (shape [HV], [1, 1, HV, 1] or "
                                 f"[HV, 1]), got shape {list(A_log.shape)}")
            _device(A_log, "A_log", dev)
        if dt_bias is not None:
            dt_bias = _tensor(dt_bias, "dt_bias")
            _dtype(dt_bias, "dt_bias", _FLOAT_TYPES)
            if scalar_gate:
                if dt_bias.numel() != HV:
                    raise ValueError(f"flashkda: dt_bias must hold HV = {HV} elements ([HV]), got shape "
                                     f"{list(dt_bias.shape)}")
            elif tuple(dt_bias.shape) not in ((HV * K,), (HV, K)):
                raise ValueError(f"flashkda: dt_bias must have shape [HV*K] = [{HV * K}] or [HV, K] = "
                                 f"[{HV}, {K}], got {list(dt_bias.shape)}")
            _device(dt_bias, "dt_bias", dev)

    cu_seqlens = _opt_tensor(cu_seqlens, "cu_seqlens")
    if cu_seqlens is not None:
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
            raise ValueError(f"flashkda: cu_seqlens must be 1-D [N+1], got shape {list(cu_seqlens.shape)}")
        _dtype(cu_seqlens, "cu_seqlens", _INDEX_TYPES)
        _device(cu_seqlens, "cu_seqlens", dev)
        if B != 1:
            raise ValueError(f"flashkda: with cu_seqlens the batch size must be 1, got B={B}")
        N = cu_seqlens.numel() - 1
        host = cu_seqlens_cpu if cu_seqlens_cpu is not None else (cu_seqlens if cu_seqlens.device.type == "cpu" else None)
        if host is None and _ext.config.debug:
            host = cu_seqlens.cpu()  # FLASHKDA_DEBUG: synchronising check
        if host is not None:
            _check_offsets(host, T, "cu_seqlens_cpu" if cu_seqlens_cpu is not None else "cu_seqlens", N)
    else:
        N = B

    serving = ssm_state_indices is not None
    initial_state = _opt_tensor(initial_state, "initial_state")
    if serving:
        idx = _tensor(ssm_state_indices, "ssm_state_indices")
        if initial_state is None:
            raise ValueError("flashkda: ssm_state_indices needs initial_state (the state pool [num_slots, HV, ...])")
        _dtype(idx, "ssm_state_indices", _INDEX_TYPES)
        _device(idx, "ssm_state_indices", dev)
        if idx.dim() not in (1, 2) or idx.shape[0] != N:
            raise ValueError(f"flashkda: ssm_state_indices must have shape [N] or [N, T_max] with N = {N}, "
                             f"got {list(idx.shape)}")
        if idx.dim() == 2 and cu_seqlens is None and idx.shape[1] < T:
            raise ValueError(f"flashkda: ssm_state_indices [N, T_max] needs T_max >= T = {T}, got {idx.shape[1]}")
        if num_accepted_tokens is not None:
            acc = _tensor(num_accepted_tokens, "num_accepted_tokens")
            if idx.dim() != 2:
                raise ValueError("flashkda: num_accepted_tokens needs ssm_state_indices of shape [N, T_max]")
            _dtype(acc, "num_accepted_tokens", _INDEX_TYPES)
            _shape(acc, "num_accepted_tokens", (N,), "[N]")
            _device(acc, "num_accepted_tokens", dev)
        if has_initial_state is not None:
            has = _tensor(has_initial_state, "has_initial_state")
            _dtype(has, "has_initial_state", (torch.bool,))
            _shape(has, "has_initial_state", (N,), "[N]")
            _device(has, "has_initial_state", dev)
        _pool_layout(initial_state, "initial_state")
        slots = initial_state.shape[0]
        if idx.device.type == "cpu" or _ext.config.debug:
            hi = int(idx.max()) if idx.numel() else -1
            if hi >= slots:
                raise ValueError(f"flashkda: ssm_state_indices names slot {hi}, but the pool has {slots} slots")
    elif num_accepted_tokens is not None:
        raise ValueError("flashkda: num_accepted_tokens needs ssm_state_indices")
    elif has_initial_state is not None:
        raise ValueError("flashkda: has_initial_state needs ssm_state_indices")
    if initial_state is not None:
        _dtype(initial_state, "initial_state", _STATE_TYPES)
        _device(initial_state, "initial_state", dev)
        layout = "[N, HV, V, K]" if state_v_first else "[N, HV, K, V]"
        tail = (HV, V, K) if state_v_first else (HV, K, V)
        if initial_state.dim() != 4 or tuple(initial_state.shape[1:]) != tail or (
                not serving and initial_state.shape[0] != N):
            want = ["num_slots" if serving else N, *tail]
            raise ValueError(f"flashkda: initial_state must have shape {layout} = {want}, got "
                             f"{list(initial_state.shape)}")
    if out is not None:
        out = _tensor(out, "out")
        _shape(out, "out", tuple(v.shape), "v.shape")
        if out.dtype != v.dtype:
            raise TypeError(f"flashkda: out must have the dtype of v ({v.dtype}), got {out.dtype}")
        _device(out, "out", dev)
        if not out.is_contiguous():
            raise ValueError("flashkda: out must be contiguous")

    p = _Problem()
    p.B, p.T, p.H, p.HV, p.K, p.V, p.N = B, T, H, HV, K, V, N
    p.scalar_gate = scalar_gate
    p.scale = float(K ** -0.5 if scale is None else scale)
    p.gate_mode = C.gate_mode(use_gate_in_kernel, lower_bound)
    p.serving = serving
    return p


def _check_offsets(host: torch.Tensor, T: int, name: str, N: int) -> None:
    vals = host.tolist()
    if len(vals) != N + 1:
        raise ValueError(f"flashkda: {name} has {len(vals)} entries, expected N+1 = {N + 1}")
    if vals[0] != 0:
        raise ValueError(f"flashkda: {name}[0] must be 0, got {vals[0]}")
    if vals[-1] != T:
        raise ValueError(f"flashkda: {name}[-1] must equal T = {T}, got {vals[-1]}")
    if any(b < a for a, b in zip(vals, vals[1:])):
        raise ValueError(f"flashkda: {name} must be non-decreasing")


def _kernel_unsupported(p: _Problem, q, g, beta, initial_state, A_log, dt_bias) -> Optional[str]:
    """Why the CUDA kernels cannot serve these inputs, or None when they can."""
    if _ext.config.force_reference:
        return "FLASHKDA_FORCE_REFERENCE=1"
    if not q.is_cuda:
        return f"inputs are on {q.device}"
    if not _ext.HAS_EXTENSION:
        return f"CUDA extension not available ({_ext.EXTENSION_ERROR})"
    shortfall = _ext.device_shortfall(q.get_device())
    if shortfall is not None:
        return shortfall
    if p.K != p.V or p.K not in C.KERNEL_HEAD_DIMS:
        return f"head dims K={p.K}, V={p.V} (kernels: K == V in {C.KERNEL_HEAD_DIMS})"
    if q.dtype not in _ext.KERNEL_DTYPES:
        return "float64 inputs"
    if initial_state is not None and initial_state.dtype not in (torch.float32, torch.bfloat16):
        return f"initial_state dtype {initial_state.dtype}"
    # Data pointers are not traceable; under torch.compile the binding's check stands guard.
    if initial_state is not None and not torch.compiler.is_compiling() and initial_state.data_ptr() % 16 != 0:
        return "initial_state not 16-byte aligned (the kernels move states in 16-byte pieces)"
    return None


def pool_layout_reason(pool: torch.Tensor) -> Optional[str]:
    """Why ``pool`` [slots, HV, ·, ·] cannot be a state pool, or None. A pool is updated in place, so
    it is used as given: each slot dense, slots at least a slot and a multiple of 16 bytes apart.
    Serving engines pitch one slot across all layers, so a layer's pool is a view whose slot stride
    is larger than a slot."""
    slot = pool.shape[1] * pool.shape[2] * pool.shape[3]
    wants = ((3, 1), (2, pool.shape[3]), (1, pool.shape[2] * pool.shape[3]))
    stride = pool.stride(0) if pool.shape[0] > 1 else slot
    if any(pool.shape[d] > 1 and pool.stride(d) != want for d, want in wants) or stride < slot or (
            stride * pool.element_size()) % 16:
        return (f"its slots must be dense [HV, ·, ·], at least a slot and a multiple of 16 bytes apart (it is updated "
                f"in place); got strides {list(pool.stride())}")
    return None


def _pool_layout(pool: torch.Tensor, name: str) -> None:
    if pool.dim() == 4 and (why := pool_layout_reason(pool)) is not None:  # other shapes: the shape checks
        raise ValueError(f"flashkda: the state pool {name}: {why}")


def _gate_params(p: _Problem, A_log, dt_bias):
    """A_log / dt_bias as the kernels take them: dropped for a precomputed gate, else _ext.kernel_param."""
    if p.gate_mode == C.GATE_PRECOMPUTED:
        return None, None
    return _ext.kernel_param(A_log), _ext.kernel_param(dt_bias)


def _states(p: _Problem, initial_state, output_final_state, state_v_first, device):
    """Contiguous initial state (or None) and a fresh fp32 final state in the requested layout (or None)."""
    h0 = None if initial_state is None else initial_state.contiguous()
    ht = None
    if output_final_state:
        shape = (p.N, p.HV, p.V, p.K) if state_v_first else (p.N, p.HV, p.K, p.V)
        ht = torch.empty(shape, dtype=torch.float32, device=device)
    return h0, ht


def _run_recurrent_kernel(p: _Problem, q, k, v, g, beta, A_log, dt_bias, cu_seqlens, initial_state,
                          output_final_state, l2norm, beta_sigmoid, allow_neg_eigval, lower_bound, state_v_first,
                          ssm_state_indices, num_accepted_tokens, out):
    q, k, v = _ext.last_dim_contiguous(q), _ext.last_dim_contiguous(k), _ext.last_dim_contiguous(v)
    g, beta = _ext.last_dim_contiguous(_ext.kernel_float(g)), _ext.last_dim_contiguous(_ext.kernel_float(beta))
    o = out if out is not None else torch.empty_like(v, memory_format=torch.contiguous_format)
    A_log, dt_bias = _gate_params(p, A_log, dt_bias)
    if cu_seqlens is not None:
        cu_seqlens = cu_seqlens.contiguous()
    if p.serving:
        pool = initial_state
        h0, ht = None, pool
        if ssm_state_indices.stride(-1) != 1:
            ssm_state_indices = ssm_state_indices.contiguous()
        if num_accepted_tokens is not None:
            num_accepted_tokens = num_accepted_tokens.contiguous()
    else:
        h0, ht = _states(p, initial_state, output_final_state, state_v_first, q.device)
    # Eager calls skip the dispatcher's boxing; traced code needs the registered op.
    run = _ext.recurrent_fwd_op if torch.compiler.is_compiling() else _ext.recurrent_fwd_eager
    run(q, k, v, g, beta, A_log, dt_bias, cu_seqlens, h0, ht, ssm_state_indices, num_accepted_tokens, o,
        p.scale, p.gate_mode, float(lower_bound) if lower_bound is not None else 0.0, l2norm, beta_sigmoid,
        allow_neg_eigval, state_v_first)
    return o, ht


def _chunk_kernel_unsupported(p: _Problem, q) -> Optional[str]:
    """Why the chunked kernels cannot serve a prefill the recurrent kernel can, or None."""
    if p.K != C.CHUNK_HEAD_DIM:
        return f"head dim {p.K} (chunked kernels: {C.CHUNK_HEAD_DIM})"
    if q.dtype not in (torch.bfloat16, torch.float16):
        return f"{q.dtype} inputs (chunked kernels: bfloat16, float16)"
    if q.is_cuda:
        return _ext.chunk_smem_shortfall(q.get_device())
    return None


def _run_chunk_kernel(p: _Problem, q, k, v, g, beta, A_log, dt_bias, cu_seqlens, initial_state, output_final_state,
                      l2norm, beta_sigmoid, allow_neg_eigval, lower_bound, state_v_first, chunk_states=None,
                      chunk_state_slots=None, ssm_state_indices=None, has_initial_state=None, records=None):
    g, beta = _ext.chunk_gate_beta(g, beta)
    o = torch.empty_like(v, memory_format=torch.contiguous_format)
    A_log, dt_bias = _gate_params(p, A_log, dt_bias)
    if p.serving:  # the pool is read and written in place
        h0, ht = None, initial_state
    else:
        h0, ht = _states(p, initial_state, output_final_state, state_v_first, q.device)
    if cu_seqlens is not None:
        cu_seqlens = cu_seqlens.contiguous()
    run = _ext.chunk_fwd_op if torch.compiler.is_compiling() else _ext.chunk_fwd_eager
    run(q, k, v, g, beta, A_log, dt_bias, cu_seqlens, h0, ht, o, p.scale, p.gate_mode,
        float(lower_bound) if lower_bound is not None else 0.0, l2norm, beta_sigmoid, allow_neg_eigval,
        state_v_first, _ext.config.chunk_value_split, _ext.config.chunk_segment, chunk_states, chunk_state_slots,
        ssm_state_indices, has_initial_state, records)
    return o, ht


def _reference(p: _Problem, reason: str, q, k, v, g, beta, **kw):
    log.debug("flashkda: using the PyTorch reference: %s", reason)
    return kda_reference(q, k, v, g, beta, scale=p.scale, **kw)


def _state_v_first(state_v_first: bool, transpose_state_layout) -> bool:
    """``state_v_first``, or its deprecated alias ``transpose_state_layout`` (FLA's rules)."""
    if transpose_state_layout is None:
        return state_v_first
    if state_v_first:
        raise ValueError("flashkda: pass state_v_first or the deprecated transpose_state_layout, not both")
    warnings.warn("flashkda: transpose_state_layout is deprecated; use state_v_first", DeprecationWarning,
                  stacklevel=4)
    return bool(transpose_state_layout)


#: Chunk sizes that FLA's chunked functions accept (KDA, GDN). The result does not depend on it:
#: flashkda's kernels always work in 64-token chunks.
_KDA_CHUNK_SIZES, _GDN_CHUNK_SIZES = (32, 64), (16, 32, 64)


def _fla_chunk_options(fn: str, chunk_sizes, chunk_size, use_graph, max_num_seqs, cu_seqlens) -> None:
    """FLA's keywords of the chunked functions: checked as FLA checks them; none changes the result."""
    if chunk_size not in chunk_sizes:
        raise ValueError(f"flashkda: chunk_size must be one of {chunk_sizes} for {fn}, got {chunk_size!r}")
    if (use_graph and max_num_seqs is not None and isinstance(cu_seqlens, torch.Tensor)
            and cu_seqlens.shape[0] - 1 != max_num_seqs):
        raise ValueError(f"flashkda: use_graph with max_num_seqs={max_num_seqs} needs cu_seqlens of "
                         f"max_num_seqs + 1 entries, got {cu_seqlens.shape[0]}")


def _chunk_with_context(fn, public, cp_context, q, k, v, g, beta, initial_state, output_final_state, state_v_first,
                        return_intermediate_states, checkpoint_pool, ssm_state_indices, **kw):
    """A chunked call under context parallelism (:mod:`flashkda.cp`), with FLA's restrictions."""
    for name, value in (("initial_state", initial_state), ("output_final_state", output_final_state or None),
                        ("return_intermediate_states", return_intermediate_states or None),
                        ("checkpoint_pool", checkpoint_pool), ("ssm_state_indices", ssm_state_indices)):
        if value is not None:
            raise ValueError(f"flashkda: {fn} with cp_context takes no {name} (the context's ranks share the states)")
    if getattr(cp_context, "cu_seqlens", None) is None:
        raise ValueError(f"flashkda: {fn}: cp_context must be a context with this rank's cu_seqlens (FLA's "
                         f"FLACPContext or flashkda.cp.build_context), got {type(cp_context).__name__}")
    from flashkda.cp import chunk_with_context

    return chunk_with_context(public, cp_context, q, k, v, g, beta, state_v_first=state_v_first, **kw)


def _num_chunks_total(p: _Problem, cu_seqlens, cu_seqlens_cpu) -> int:
    """FLA's NT of return_intermediate_states: ceil(T / 64) per row, or Σ ceil(len_n / 64) with
    cu_seqlens (from a host copy; a CUDA cu_seqlens alone is read back, which synchronises)."""
    c = C.CHUNK_STATE_TOKENS
    if cu_seqlens is None:
        return -(-p.T // c)
    host = cu_seqlens_cpu if cu_seqlens_cpu is not None else cu_seqlens
    bounds = host.tolist()
    return sum(-(-(b - a) // c) for a, b in zip(bounds, bounds[1:]))


def _chunk_state_dest(fn: str, p: _Problem, q, k, cu_seqlens, cu_seqlens_cpu, state_v_first,
                      return_intermediate_states, checkpoint_pool, checkpoint_slots):
    """(destination, slots, h): where the states at chunk starts go (ChunkParams::chunk_states), the
    pool's slot table, and the h tensor to return (or None)."""
    tail = (p.HV, p.V, p.K) if state_v_first else (p.HV, p.K, p.V)
    if return_intermediate_states:
        if checkpoint_pool is not None:
            raise ValueError(f"flashkda: {fn} takes return_intermediate_states or checkpoint_pool, not both")
        B = 1 if cu_seqlens is not None else p.B
        h = torch.empty((B, _num_chunks_total(p, cu_seqlens, cu_seqlens_cpu), *tail), dtype=k.dtype, device=q.device)
        return h, None, h
    if checkpoint_pool is None:
        if checkpoint_slots is not None:
            raise ValueError("flashkda: checkpoint_slots needs checkpoint_pool")
        return None, None, None
    pool, slots = _tensor(checkpoint_pool, "checkpoint_pool"), _tensor(checkpoint_slots, "checkpoint_slots")
    # The kernels' pools: float32 or bfloat16 (float64 only beside float64 inputs, on the reference).
    _dtype(pool, "checkpoint_pool", _STATE_TYPES if q.dtype == torch.float64 else (torch.float32, torch.bfloat16))
    _device(pool, "checkpoint_pool", q.device)
    if pool.dim() != 4 or tuple(pool.shape[1:]) != tail:
        raise ValueError(f"flashkda: checkpoint_pool must be a [num_slots, {', '.join(map(str, tail))}] state pool, "
                         f"got shape {list(pool.shape)}")
    _pool_layout(pool, "checkpoint_pool")
    _dtype(slots, "checkpoint_slots", _INDEX_TYPES)
    _device(slots, "checkpoint_slots", q.device)
    if slots.dim() != 2 or slots.shape[0] != p.N:
        raise ValueError(f"flashkda: checkpoint_slots must have shape [N, chunks] with N = {p.N}, got "
                         f"{list(slots.shape)}")
    if slots.stride(-1) != 1:
        slots = slots.contiguous()
    return pool, slots, None


def _plain_chunk_call(cp_context, use_graph, transpose_state_layout, return_intermediate_states, checkpoint_pool,
                      checkpoint_slots) -> bool:
    """Whether a chunked call may try :data:`_chunk_fast`: eager, no switch asking for the general
    path, and none of the options that it handles (FLA's ``cp_context`` and ``use_graph``, the
    deprecated layout alias, states at chunk starts)."""
    return (cp_context is None and not use_graph and transpose_state_layout is None and not return_intermediate_states
            and checkpoint_pool is None and checkpoint_slots is None
            and not (_ext.config.force_reference or _ext.config.debug) and not _is_compiling())


def _chunk(fn, scalar_gate, q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
           use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, safe_gate, lower_bound, state_v_first,
           cu_seqlens, cu_seqlens_cpu, A_log, dt_bias, return_intermediate_states=False, checkpoint_pool=None,
           checkpoint_slots=None, ssm_state_indices=None, has_initial_state=None):
    p = _validate(fn, q, k, v, g, beta, scalar_gate=scalar_gate, scale=scale, initial_state=initial_state,
                  cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu, use_gate_in_kernel=use_gate_in_kernel,
                  A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound,
                  use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
                  state_v_first=state_v_first, ssm_state_indices=ssm_state_indices,
                  has_initial_state=has_initial_state)
    if p.serving:
        if ssm_state_indices.dim() != 1:
            raise ValueError(f"flashkda: {fn} takes ssm_state_indices of shape [N] (one slot per sequence), got "
                             f"{list(ssm_state_indices.shape)}")
        if ssm_state_indices.stride(-1) != 1:
            ssm_state_indices = ssm_state_indices.contiguous()
    if has_initial_state is not None:
        has_initial_state = has_initial_state.contiguous()
    lb = lower_bound if use_gate_in_kernel else None
    gate_params = (A_log, dt_bias) if use_gate_in_kernel else (None, None)
    if _needs_grad(q, k, v, g, beta, initial_state, *gate_params):
        return _chunk_with_grad(fn, p, q, k, v, g, beta, *gate_params, initial_state, output_final_state,
                                use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel,
                                allow_neg_eigval, lb, state_v_first, cu_seqlens, cu_seqlens_cpu,
                                return_intermediate_states=return_intermediate_states,
                                checkpoint_pool=checkpoint_pool, ssm_state_indices=ssm_state_indices)
    dest, slots, h = _chunk_state_dest(fn, p, q, k, cu_seqlens, cu_seqlens_cpu, state_v_first,
                                       return_intermediate_states, checkpoint_pool, checkpoint_slots)
    reason = _kernel_unsupported(p, q, g, beta, initial_state, A_log, dt_bias)
    if reason is None:
        chunk_reason = _chunk_kernel_unsupported(p, q)
        if chunk_reason is None:
            o, ht = _run_chunk_kernel(p, q, k, v, g, beta, A_log, dt_bias, cu_seqlens, initial_state,
                                      output_final_state, use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel,
                                      allow_neg_eigval, lb, state_v_first, dest, slots, ssm_state_indices,
                                      has_initial_state)
            return (o, ht) if h is None else (o, ht, h)
        if dest is None and has_initial_state is None:
            # The token-by-token kernel computes the contract exactly (fp32 state) for the rest.
            log.debug("flashkda: %s uses the recurrent kernel: %s", fn, chunk_reason)
            return _run_recurrent_kernel(p, q, k, v, g, beta, A_log, dt_bias, cu_seqlens, initial_state,
                                         output_final_state, use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel,
                                         allow_neg_eigval, lb, state_v_first, ssm_state_indices, None, None)
        reason = (f"{chunk_reason}; states at chunk starts need the chunked kernels" if dest is not None else
                  f"{chunk_reason}; has_initial_state needs the chunked kernels")
    o, ht = _reference(p, reason, q, k, v, g, beta, initial_state=initial_state, output_final_state=output_final_state,
                       use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
                       use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
                       lower_bound=lb, A_log=A_log, dt_bias=dt_bias, state_v_first=state_v_first,
                       cu_seqlens=cu_seqlens, core="chunk", chunk_states=dest, chunk_state_slots=slots,
                       ssm_state_indices=ssm_state_indices, has_initial_state=has_initial_state)
    return (o, ht) if h is None else (o, ht, h)


def _needs_grad(*tensors) -> bool:
    """Whether autograd is enabled and one of ``tensors`` (anything else, None included, is skipped)
    requires grad."""
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)


def _chunk_with_grad(fn, p: _Problem, q, k, v, g, beta, A_log, dt_bias, initial_state, output_final_state,
                     l2norm, use_gate_in_kernel, beta_sigmoid, allow_neg_eigval, lower_bound, state_v_first,
                     cu_seqlens, cu_seqlens_cpu, *, return_intermediate_states, checkpoint_pool, ssm_state_indices):
    """A chunked call under autograd with an input that requires grad: the kernels' forward recorded
    as :class:`flashkda.autograd.ChunkFunction`, or the reference, differentiated by autograd, where
    the kernels do not serve the inputs. Never an output without a graph."""
    for name, value in (("return_intermediate_states", return_intermediate_states or None),
                        ("checkpoint_pool", checkpoint_pool), ("ssm_state_indices", ssm_state_indices)):
        if value is not None:
            raise ValueError(f"flashkda: {fn}: {name} is for inference (states written without a graph), but an "
                             "input requires grad; call it under torch.no_grad() or torch.inference_mode()")
    reason = _kernel_unsupported(p, q, g, beta, initial_state, A_log, dt_bias)
    if reason is not None:
        return _reference(p, reason, q, k, v, g, beta, initial_state=initial_state,
                          output_final_state=output_final_state, use_qk_l2norm_in_kernel=l2norm,
                          use_gate_in_kernel=use_gate_in_kernel, use_beta_sigmoid_in_kernel=beta_sigmoid,
                          allow_neg_eigval=allow_neg_eigval, lower_bound=lower_bound, A_log=A_log, dt_bias=dt_bias,
                          state_v_first=state_v_first, cu_seqlens=cu_seqlens, core="chunk")
    chunked = _chunk_kernel_unsupported(p, q) is None

    def run(q, k, v, g, beta, A_log, dt_bias, initial_state):
        args = (p, q, k, v, g, beta, A_log, dt_bias, cu_seqlens, initial_state, output_final_state, l2norm,
                beta_sigmoid, allow_neg_eigval, lower_bound, state_v_first)
        if not chunked:  # the token-by-token kernel, as without grad
            return (*_run_recurrent_kernel(*args, None, None, None), None)
        records = forward_records(p.B, p.T, p.N, p.HV, cu_seqlens is not None, q.device)
        if records is None:
            return (*_run_chunk_kernel(*args), None)
        records = records._replace(gate_check=forward_gate_check(g, A_log, dt_bias, use_gate_in_kernel, lower_bound))
        # The records' states are key-first: a V-first initial and final state are transposed around.
        h0 = initial_state.mT if state_v_first and initial_state is not None else initial_state
        o, ht = _run_chunk_kernel(p, q, k, v, g, beta, A_log, dt_bias, cu_seqlens, h0, output_final_state, l2norm,
                                  beta_sigmoid, allow_neg_eigval, lower_bound, False, chunk_states=records.states,
                                  records=records.records)
        if state_v_first and ht is not None:
            ht = ht.mT.contiguous()
        return o, ht, records

    opts = ChunkOptions(p.scale, l2norm, use_gate_in_kernel, lower_bound, beta_sigmoid, allow_neg_eigval,
                        state_v_first, cu_seqlens, cu_seqlens_cpu)
    return ChunkFunction.apply(run, opts, q, k, v, g, beta, A_log, dt_bias, initial_state)


def _recurrent(fn, scalar_gate, q, k, v, g, beta, A_log, dt_bias, scale, initial_state, output_final_state,
               use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, lower_bound,
               state_v_first, cu_seqlens, ssm_state_indices, num_accepted_tokens, out, cu_seqlens_cpu=None):
    p = _validate(fn, q, k, v, g, beta, scalar_gate=scalar_gate, scale=scale, initial_state=initial_state,
                  cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu, use_gate_in_kernel=use_gate_in_kernel,
                  A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound,
                  use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
                  state_v_first=state_v_first, ssm_state_indices=ssm_state_indices,
                  num_accepted_tokens=num_accepted_tokens, out=out)
    lb = lower_bound if use_gate_in_kernel else None
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta), ("initial_state", initial_state),
                    ("A_log", A_log if use_gate_in_kernel else None),
                    ("dt_bias", dt_bias if use_gate_in_kernel else None)):
        if _needs_grad(t):
            raise NotImplementedError(f"flashkda: {fn} is forward-only, but {name} requires grad under autograd; "
                                      "train with the chunked function, or decode under torch.no_grad() or "
                                      "torch.inference_mode()")
    reason = _kernel_unsupported(p, q, g, beta, initial_state, A_log, dt_bias)
    if reason is None:
        return _run_recurrent_kernel(p, q, k, v, g, beta, A_log, dt_bias, cu_seqlens, initial_state,
                                     output_final_state, use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel,
                                     allow_neg_eigval, lb, state_v_first, ssm_state_indices, num_accepted_tokens, out)
    return _reference(p, reason, q, k, v, g, beta, initial_state=initial_state, output_final_state=output_final_state,
                      use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
                      use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
                      lower_bound=lb, A_log=A_log, dt_bias=dt_bias, state_v_first=state_v_first,
                      cu_seqlens=cu_seqlens, ssm_state_indices=ssm_state_indices,
                      num_accepted_tokens=num_accepted_tokens, out=out, core="recurrent")


_ARGS_DOC = """
    Args:
        q: ``[B, T, H, K]`` queries; float32, bfloat16 or float16 (float64 runs the reference).
        k: ``[B, T, H, K]`` keys, dtype of ``q``.
        v: ``[B, T, HV, V]`` values, dtype of ``q``; ``HV`` a multiple of ``H`` (value head ``hv`` reads
            q/k head ``hv // (HV // H)``).
        g: {g_doc}
        beta: ``[B, T, HV]`` step sizes (raw logits with ``use_beta_sigmoid_in_kernel``); any float dtype.
        scale: multiplies q after the optional l2 norm; default ``K ** -0.5``.
        initial_state: ``[N, HV, K, V]`` (``[N, HV, V, K]`` with ``state_v_first``), float32 or bfloat16;
            zeros when None. ``N = B``, or ``len(cu_seqlens) - 1``.
        output_final_state: also return the state after each sequence, float32, in the same layout.
        use_qk_l2norm_in_kernel: l2-normalise q and k per token (eps {eps}).
        use_gate_in_kernel: compute the log decay from raw ``g`` with ``A_log`` and ``dt_bias``:
            ``lower_bound * sigmoid(exp(A_log) * (g + dt_bias))`` when ``lower_bound`` is set, else
            ``-exp(A_log) * softplus(g + dt_bias)``. Otherwise ``g`` is the log decay itself (``<= 0``).
        use_beta_sigmoid_in_kernel: ``beta <- sigmoid(beta)``.
        allow_neg_eigval: ``beta <- 2 * sigmoid(beta)``; needs ``use_beta_sigmoid_in_kernel``.
        lower_bound: lower bound of the sigmoid gate, in ``[-5, 0)``.
        state_v_first: states are ``[..., V, K]`` instead of ``[..., K, V]``.
        cu_seqlens: int32/int64 ``[N+1]`` offsets of packed sequences (then ``B == 1``); zero-length
            sequences pass their state through.
        A_log: ``HV`` values in any shape (``[HV]``, ``[1, 1, HV, 1]``, ``[HV, 1]``) and any float dtype;
            ``exp(A_log)`` scales the gate (1 when None). The kernels read it in its own dtype.
        dt_bias: {dt_doc}, any float dtype; added to raw ``g`` (zero when None).
        transpose_state_layout: deprecated alias of ``state_v_first`` (keyword only).
"""


def chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
              use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False,
              allow_neg_eigval=False, safe_gate=False, lower_bound=None, state_v_first=False, cu_seqlens=None,
              cu_seqlens_cpu=None, A_log=None, dt_bias=None, *, chunk_size=64, disable_recompute=False,
              return_intermediate_states=False, cp_context=None, use_graph=False, max_num_seqs=None,
              transpose_state_layout=None, checkpoint_pool=None, checkpoint_slots=None, ssm_state_indices=None,
              has_initial_state=None):
    if _chunk_fast is not None and chunk_size in _KDA_CHUNK_SIZES and _plain_chunk_call(
            cp_context, use_graph, transpose_state_layout, return_intermediate_states, checkpoint_pool,
            checkpoint_slots):
        r = _chunk_fast(q, k, v, g, beta, A_log, dt_bias, scale, initial_state, output_final_state,
                        use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval,
                        lower_bound, state_v_first, cu_seqlens, cu_seqlens_cpu, ssm_state_indices, has_initial_state,
                        _ext.config.chunk_value_split, _ext.config.chunk_segment, False)
        if r.__class__ is tuple:
            return r
        log.debug("flashkda: chunk_kda takes the general path: %s", r)
    state_v_first = _state_v_first(state_v_first, transpose_state_layout)
    _fla_chunk_options("chunk_kda", _KDA_CHUNK_SIZES, chunk_size, use_graph, max_num_seqs, cu_seqlens)
    if cp_context is not None:
        return _chunk_with_context(
            "chunk_kda", chunk_kda, cp_context, q, k, v, g, beta, initial_state, output_final_state, state_v_first,
            return_intermediate_states, checkpoint_pool, ssm_state_indices, scale=scale,
            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
            use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
            safe_gate=safe_gate, lower_bound=lower_bound, A_log=A_log, dt_bias=dt_bias)
    return _chunk("chunk_kda", False, q, k, v, g, beta, scale, initial_state, output_final_state,
                  use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval,
                  safe_gate, lower_bound, state_v_first, cu_seqlens, cu_seqlens_cpu, A_log, dt_bias,
                  return_intermediate_states, checkpoint_pool, checkpoint_slots, ssm_state_indices, has_initial_state)


def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                           use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False,
                           allow_neg_eigval=False, safe_gate=False, lower_bound=None, state_v_first=False,
                           cu_seqlens=None, cu_seqlens_cpu=None, A_log=None, dt_bias=None, *, chunk_size=64,
                           disable_recompute=False, return_intermediate_states=False, cp_context=None,
                           use_graph=False, max_num_seqs=None, chunk_indices=None, transpose_state_layout=None,
                           checkpoint_pool=None, checkpoint_slots=None, ssm_state_indices=None, has_initial_state=None):
    if _chunk_fast is not None and chunk_size in _GDN_CHUNK_SIZES and _plain_chunk_call(
            cp_context, use_graph, transpose_state_layout, return_intermediate_states, checkpoint_pool,
            checkpoint_slots):
        r = _chunk_fast(q, k, v, g, beta, A_log, dt_bias, scale, initial_state, output_final_state,
                        use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval,
                        lower_bound, state_v_first, cu_seqlens, cu_seqlens_cpu, ssm_state_indices, has_initial_state,
                        _ext.config.chunk_value_split, _ext.config.chunk_segment, True)
        if r.__class__ is tuple:
            return r
        log.debug("flashkda: chunk_gated_delta_rule takes the general path: %s", r)
    state_v_first = _state_v_first(state_v_first, transpose_state_layout)
    _fla_chunk_options("chunk_gated_delta_rule", _GDN_CHUNK_SIZES, chunk_size, use_graph, max_num_seqs, cu_seqlens)
    if cp_context is not None:
        return _chunk_with_context(
            "chunk_gated_delta_rule", chunk_gated_delta_rule, cp_context, q, k, v, g, beta, initial_state,
            output_final_state, state_v_first, return_intermediate_states, checkpoint_pool, ssm_state_indices,
            scale=scale, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
            use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
            safe_gate=safe_gate, lower_bound=lower_bound, A_log=A_log, dt_bias=dt_bias)
    return _chunk("chunk_gated_delta_rule", True, q, k, v, g, beta, scale, initial_state, output_final_state,
                  use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval,
                  safe_gate, lower_bound, state_v_first, cu_seqlens, cu_seqlens_cpu, A_log, dt_bias,
                  return_intermediate_states, checkpoint_pool, checkpoint_slots, ssm_state_indices, has_initial_state)


def fused_recurrent_kda(q, k, v, g, beta, A_log=None, dt_bias=None, scale=None, initial_state=None,
                        output_final_state=False, use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False,
                        use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, lower_bound=None,
                        state_v_first=False, cu_seqlens=None, ssm_state_indices=None, num_accepted_tokens=None,
                        out=None, *, transpose_state_layout=None, cu_seqlens_cpu=None, safe_gate=False, chunk_size=None,
                        disable_recompute=False):
    if _fast is not None and transpose_state_layout is None and cu_seqlens_cpu is None and not (
            _ext.config.force_reference or _ext.config.debug) and not _is_compiling():
        r = _fast(q, k, v, g, beta, A_log, dt_bias, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                  use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, lower_bound, state_v_first,
                  cu_seqlens, ssm_state_indices, num_accepted_tokens, out, False)
        if r.__class__ is tuple:
            return r
        log.debug("flashkda: fused_recurrent_kda takes the general path: %s", r)
    return _recurrent("fused_recurrent_kda", False, q, k, v, g, beta, A_log, dt_bias, scale, initial_state,
                      output_final_state, use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel,
                      allow_neg_eigval, lower_bound, _state_v_first(state_v_first, transpose_state_layout),
                      cu_seqlens, ssm_state_indices, num_accepted_tokens, out, cu_seqlens_cpu)


def fused_recurrent_gated_delta_rule(q, k, v, g, beta, A_log=None, dt_bias=None, scale=None, initial_state=None,
                                     output_final_state=False, use_qk_l2norm_in_kernel=False,
                                     use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False,
                                     allow_neg_eigval=False, lower_bound=None, state_v_first=False, cu_seqlens=None,
                                     ssm_state_indices=None, num_accepted_tokens=None, out=None, *, gk=None, gv=None,
                                     transpose_state_layout=None, cu_seqlens_cpu=None, safe_gate=False, chunk_size=None,
                                     disable_recompute=False):
    for name, t in (("gk", gk), ("gv", gv)):
        if t is not None:
            raise NotImplementedError(f"flashkda: fused_recurrent_gated_delta_rule does not support {name} "
                                      "(per-key / per-value gates; fused_recurrent_kda takes a per-key gate)")
    if _fast is not None and transpose_state_layout is None and cu_seqlens_cpu is None and not (
            _ext.config.force_reference or _ext.config.debug) and not _is_compiling():
        r = _fast(q, k, v, g, beta, A_log, dt_bias, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                  use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, lower_bound, state_v_first,
                  cu_seqlens, ssm_state_indices, num_accepted_tokens, out, True)
        if r.__class__ is tuple:
            return r
        log.debug("flashkda: fused_recurrent_gated_delta_rule takes the general path: %s", r)
    return _recurrent("fused_recurrent_gated_delta_rule", True, q, k, v, g, beta, A_log, dt_bias, scale,
                      initial_state, output_final_state, use_qk_l2norm_in_kernel, use_gate_in_kernel,
                      use_beta_sigmoid_in_kernel, allow_neg_eigval, lower_bound,
                      _state_v_first(state_v_first, transpose_state_layout), cu_seqlens, ssm_state_indices,
                      num_accepted_tokens, out, cu_seqlens_cpu)


_CHUNK_EXTRA = """
        safe_gate: a promise that every log decay is ``>= lower_bound``; may select a faster kernel,
            never a different result.
        cu_seqlens_cpu: a host copy of ``cu_seqlens``, used for checks without a device sync.

    FLA's keywords, keyword only, none of which changes the result: ``chunk_size`` ({chunk_sizes}, as
    FLA accepts; others raise ValueError), ``disable_recompute`` and ``use_graph`` / ``max_num_seqs``
    (options of FLA's training and graph paths; ``max_num_seqs`` is checked against ``cu_seqlens`` as
    FLA does){gdn_extra}; any other keyword raises TypeError.

    Context parallelism, keyword only: ``cp_context``, FLA's ``FLACPContext`` or flashkda's own
    (:func:`flashkda.cp.build_context`): this rank's ``[1, T / world_size, ...]`` slice of a packed
    batch whose sequences may straddle ranks; the result on every rank is its slice of the
    single-device result. FLA's restrictions: no ``initial_state``, ``output_final_state`` or
    states at chunk starts; ``cu_seqlens`` comes from the context. Forward only for now.

    States at chunk starts (prefix caching), keyword only:
        return_intermediate_states: also return ``h`` (FLA's semantics): ``h[:, i]`` is the state at
            the start of 64-token chunk ``i`` (``h[:, 0]`` the initial state), ``[B, NT, HV, K, V]``
            (``[..., V, K]`` with ``state_v_first``) in the dtype of ``k``, ``NT = ceil(T / 64)``;
            with ``cu_seqlens``, ``B = 1`` and ``NT = Σ ceil(len_n / 64)``, sequence by sequence
            (from ``cu_seqlens_cpu`` or a CPU ``cu_seqlens``; a CUDA one alone is read back, which
            synchronises).
        checkpoint_pool: a state pool ``[num_slots, HV, K, V]`` (``[..., V, K]`` with
            ``state_v_first``), float32 or bfloat16, contiguous: the states named by
            ``checkpoint_slots`` are written into it in place; no synchronisation, CUDA-graph safe.
        checkpoint_slots: int32/int64 ``[N, C]``: ``checkpoint_slots[n, j]`` is the slot that
            receives the state at the start of chunk ``j`` of sequence ``n`` (after its first
            ``64 j`` tokens); a negative slot, one beyond the pool or ``j`` past the sequence's
            chunks writes nothing.

    Serving mode (a state pool, no gather or scatter copies), keyword only:
        ssm_state_indices: int32/int64 ``[N]``: sequence ``n`` starts from slot ``idx[n]`` of the pool
            ``initial_state`` ``[num_slots, HV, K, V]`` (``[..., V, K]`` with ``state_v_first``; float32
            or bfloat16, contiguous) and its final state is written back to that slot in place;
            ``output_final_state`` is then moot and the pool is returned as the final state. A negative
            slot is padding: the sequence is skipped, nothing is written, its output is zero (on CUDA a
            slot beyond the pool too; ``FLASHKDA_DEBUG=1`` raises instead). Slots not named are never
            touched.
        has_initial_state: bool ``[N]`` (with ``ssm_state_indices``): ``False`` starts sequence ``n``
            from zeros whatever its slot holds (a new sequence), and its final state still goes there.

    Returns:
        ``(o, final_state)``: ``o`` ``[B, T, HV, V]`` in the dtype of ``v``; ``final_state`` as described
        under ``output_final_state`` (the pool in serving mode), or None; ``(o, final_state, h)`` with
        ``return_intermediate_states``.
"""

_RECURRENT_EXTRA = """
        ssm_state_indices: serving mode. int32/int64 ``[N]`` (one slot per sequence: read ``idx[n]``, write
            the state after the last token back to ``idx[n]``) or ``[N, T_max]`` (read ``idx[n, 0]``, or
            ``idx[n, num_accepted_tokens[n] - 1]``; write the state after token ``t`` to ``idx[n, t]``).
            ``initial_state`` is then the slot pool ``[num_slots, HV, ...]`` (float32 or bfloat16), updated
            in place; slots not named are never touched. A negative slot is padding: the sequence (or
            token) is skipped, nothing is written, its output is zero. On CUDA a slot beyond the pool is
            skipped the same way (``FLASHKDA_DEBUG=1`` raises instead).
        num_accepted_tokens: int32/int64 ``[N]``, speculative decoding (with ``[N, T_max]`` indices).
        out: optional ``[B, T, HV, V]`` contiguous buffer (dtype of ``v``) that receives the output.{gdn_extra}

    Keyword only: ``transpose_state_layout`` (deprecated alias of ``state_v_first``);
    ``cu_seqlens_cpu``, a host copy of ``cu_seqlens`` whose offsets are then checked (no device read);
    and the chunked function's ``safe_gate``, ``chunk_size`` and ``disable_recompute``, which model code
    passes to both entries: accepted, as FLA accepts them here, and none changes a decode result.

    Returns:
        ``(o, final_state)``. In serving mode ``final_state`` is the pool itself; otherwise a new float32
        state when ``output_final_state``, else None.
"""

_KDA_G = "``[B, T, HV, K]`` per-key-channel gate: the log decay, or raw with ``use_gate_in_kernel``."
_GDN_G = "``[B, T, HV]`` scalar gate per head: the log decay, or raw with ``use_gate_in_kernel``."
_KDA_DT = "``[HV*K]`` or ``[HV, K]``"
_GDN_DT = "``[HV]``"

chunk_kda.__doc__ = ("Chunked prefill of Kimi Delta Attention (per-channel decay)." +
                     _ARGS_DOC.format(g_doc=_KDA_G, dt_doc=_KDA_DT, eps=C.L2NORM_EPS) +
                     _CHUNK_EXTRA.format(chunk_sizes=_KDA_CHUNK_SIZES, gdn_extra=""))
chunk_gated_delta_rule.__doc__ = ("Chunked prefill of Gated DeltaNet (one scalar decay per head)." +
                                  _ARGS_DOC.format(g_doc=_GDN_G, dt_doc=_GDN_DT, eps=C.L2NORM_EPS) +
                                  _CHUNK_EXTRA.format(chunk_sizes=_GDN_CHUNK_SIZES,
                                                      gdn_extra=", ``chunk_indices`` (derived from ``cu_seqlens``)"))
fused_recurrent_kda.__doc__ = ("Token-by-token KDA (decode, speculative verification), with a serving slot pool." +
                               _ARGS_DOC.format(g_doc=_KDA_G, dt_doc=_KDA_DT, eps=C.L2NORM_EPS) +
                               _RECURRENT_EXTRA.format(gdn_extra=""))
fused_recurrent_gated_delta_rule.__doc__ = (
    "Token-by-token Gated DeltaNet with a serving slot pool." +
    _ARGS_DOC.format(g_doc=_GDN_G, dt_doc=_GDN_DT, eps=C.L2NORM_EPS) +
    _RECURRENT_EXTRA.format(gdn_extra="\n        gk, gv: FLA's per-key / per-value gates (keyword only): None, else "
                                      "NotImplementedError."))
