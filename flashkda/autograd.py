"""Gradients of the chunked prefill (``chunk_kda`` / ``chunk_gated_delta_rule``) under autograd.

A call that the CUDA kernels serve records :class:`ChunkFunction`: its forward is the kernels'
forward and saves the inputs and, on the chunked kernels, the states at chunk starts (bf16) and
chunk_prepare's chunk records (:class:`ForwardRecords`); its backward (:func:`chunk_backward`)
recomputes the rest and returns the gradients of every input that requires grad, FLA's gradients with FLA's semantics
(raw gate, ``A_log`` and ``dt_bias`` in their own shapes, raw ``beta`` through the sigmoid, the l2
norm, GVA sums, the initial state in its own layout and dtype).

The backward splits the recurrence at 64-token chunks (the layout of the kernels'
``return_intermediate_states``); the state is the only coupling between chunks:

1. the per-token preprocessing of the raw inputs, fp32 (on CUDA the per-token kernel
   ``chunk_bwd_inputs``, one pass over them; else :func:`flashkda.reference.preprocess`); where
   step 4 runs on the kernels for a scalar gate with no group, that step normalises the raw q and
   k itself and this one computes only the log decays and β;
2. every chunk's local quantities: the decay factors, the decayed Gram matrices
   ``M = tril(q kᵀ ⊙ e^{Γi−Γj})`` and ``A = strict_tril(k kᵀ ⊙ e^{Γi−Γj})``,
   ``T = (I + diag(β) A)⁻¹ diag(β)``, ``w = T (k e^Γ)``, ``u = T v``, ``q e^Γ``, ``kd = k e^{Γ_C−Γ}``
   and the chunk decay ``e^{Γ_C}``, hence each chunk's state map ``S' = D S + B`` with
   ``D = diag(e^{Γ_C}) − kdᵀ w``, ``B = kdᵀ u``;
3. the states at chunk starts and the state gradients (``dS = Dᵀ dS' + (q e^Γ − M w)ᵀ dO``, from the
   final state's gradient; the first is the initial state's), two scans over chunks;
4. every chunk's gradients at once from ``dO`` and its next state's gradient, the states held
   constant;
5. back through GVA and the preprocessing (on CUDA the per-token kernel ``chunk_bwd_input_grads``,
   which writes each gradient in its input's dtype and the gate parameters' sums per tile of
   tokens; else :func:`_preprocess_grads`). Where no group shares q and k and step 4 runs whole on
   the kernels, step 4 itself takes q's and k's gradients through the scale and the l2 norm.

Steps 2-4 run on the CUDA kernels (:func:`_kernel_backward`, bf16 tensor-core products with fp32
accumulation) where they serve (sm_90, K = V = 128, log decays within their 16-token span): step 3
for bf16 / fp16 inputs from the states the forward kept and ``chunk_state_grad`` on its records
(:func:`_chunked_boundary_states`; without them the forward kernels run again), for fp32 inputs from ``chunk_local_grad``'s transitions pass and
``chunk_state_scan``; step 4 is ``chunk_local_grad``'s gradients pass. Where that path is known
before step 1 (a bounded gate, or the forward's :class:`GateCheck`), step 3's walk runs beside step 1
(:func:`_beside`). Where only the gradients pass lacks room (sm_80's shared memory), step 3 still
runs on the kernels and steps 2 and 4 in PyTorch. Else steps 2-4 run in PyTorch (:func:`_torch_backward`,
fp32, written out with no autograd graph inside). There, within a chunk only ``e^{Γi−Γj}`` for
``j <= i`` is formed, each factor at most 1 (see :func:`_decayed_grams`), and the gradient in ``g``
follows the same sums (:func:`_gram_grads`): unbounded softplus gates and masks such as
``g = -1e4`` stay finite and precise; varlen batches are laid out as ``[N, chunks]`` of their
longest sequence, padded tokens with zero ``q, k, v, beta`` and a zero log decay, so padded chunks
pass the state through. The backward is one registered op (``flashkda::chunk_bwd``), so
torch.compile traces a training call without looking inside it.
"""

from __future__ import annotations

from typing import List, NamedTuple, Optional, Tuple

import torch

from flashkda import _constants as C
from flashkda import _ext
from flashkda.reference import log_decay, preprocess

__all__ = ["ChunkFunction", "ChunkOptions", "chunk_backward"]

_CHUNK = C.CHUNK_STATE_TOKENS
#: Diagonal blocks of the decayed Gram matrices: with pairwise decays formed elementwise
#: ([..., 16, 16, K]), and with pivoted factors (8 tokens, ``x e^{γ−h}`` and ``k e^{h−γ}``, h the
#: block's half decay) when every block's decay spans at most _PIVOT_SPAN in log space.
_EXACT_BLOCK, _PIVOT_BLOCK = 16, 8
#: Tokens per sub-chunk of the CUDA kernel pass (its pivot blocks; ``chunk::kSubChunk``).
_SUB_CHUNK = 16
#: Largest |log decay| over a pivoted block: factors up to e^{32}, products up to e^{64} (fp32
#: reaches e^{88}). The lower-bound gate (at least -5 a token) always stays within it.
_PIVOT_SPAN = 64.0
#: The states at chunk starts and their gradients from the forward kernels, as the gradients pass
#: reads them (its products take bf16 operands): half the memory of fp32 pools.
_BOUNDARY_STATE_DTYPE = torch.bfloat16


class ChunkOptions(NamedTuple):
    """The non-tensor arguments of one chunked call, as :class:`ChunkFunction` takes them."""

    scale: float
    use_qk_l2norm_in_kernel: bool
    use_gate_in_kernel: bool
    lower_bound: Optional[float]
    use_beta_sigmoid_in_kernel: bool
    allow_neg_eigval: bool
    state_v_first: bool
    cu_seqlens: Optional[torch.Tensor]
    cu_seqlens_cpu: Optional[torch.Tensor]


class ChunkFunction(torch.autograd.Function):
    """``(o, final_state)`` of a chunked prefill, differentiable in every tensor input.

    ``forward(ctx, run, options, q, k, v, g, beta, A_log, dt_bias, initial_state)``:
    ``run(q, k, v, g, beta, A_log, dt_bias, initial_state)`` computes ``(o, final_state or None,
    records or None)`` from those tensors without autograd (the CUDA kernels), ``records`` a
    :class:`ForwardRecords` that the backward reads instead of running the forward kernels again;
    ``options`` is a :class:`ChunkOptions`.
    """

    @staticmethod
    def forward(ctx, run, options: ChunkOptions, q, k, v, g, beta, A_log, dt_bias, initial_state):
        o, ht, records = run(q, k, v, g, beta, A_log, dt_bias, initial_state)
        ctx.options = options
        ctx.save_for_backward(q, k, v, g, beta, A_log, dt_bias, initial_state,
                              *(records[:2] if records is not None else (None, None)))
        ctx.gate_check = None if records is None else records.gate_check
        ctx.set_materialize_grads(False)
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        opt = ctx.options
        needs = ctx.needs_input_grad[2:]
        *tensors, states, records = ctx.saved_tensors

        def gradients(gate_spans: int):
            return torch.ops.flashkda.chunk_bwd(
                do, dht, *tensors, states, records, gate_spans, opt.cu_seqlens, opt.cu_seqlens_cpu, opt.scale,
                opt.use_qk_l2norm_in_kernel,
                opt.use_gate_in_kernel, opt.lower_bound, opt.use_beta_sigmoid_in_kernel, opt.allow_neg_eigval,
                opt.state_v_first, _needs_mask(needs, tensors))

        check = ctx.gate_check
        if check is None:
            grads = gradients(-1)  # no check made (or none needed): the backward decides itself
        elif check.event.query():
            grads = gradients(int(bool(check.within)))
        else:
            # The device has not reached the check yet (the host far ahead of it, as with a lone
            # call timed back to back). Waiting for it here would drain the queue, and the device
            # would then idle while the backward's launches follow one by one: the kernels run as if
            # the gate passed, and the answer is read after their launches, while they keep the
            # device busy. A gate that fails it (rare) gets the backward again, on the PyTorch path.
            grads = gradients(1)
            check.event.synchronize()
            if not bool(check.within):
                _ext.log.debug("flashkda: gate outside the backward kernels' span; its backward again on PyTorch")
                del grads
                grads = gradients(0)
        return (None, None, *(gr if m else None for gr, m in zip(grads, _needs_flags(needs, tensors))))


class GateCheck(NamedTuple):
    """Whether every 16 consecutive tokens' log decay stays within the backward kernels' span, found
    on the device when the forward starts and copied to the host without waiting
    (:func:`forward_gate_check`): the backward reads it once ``event`` has passed (long before, as a
    rule) instead of reading the device, which would wait for all the work queued before it; where
    the event has not passed yet, only after launching the kernel path (``ChunkFunction.backward``)."""

    within: torch.Tensor  # [] bool, pinned host memory
    event: torch.cuda.Event


class ForwardRecords(NamedTuple):
    """What a chunked forward on the kernels keeps for its backward (:func:`forward_records`)."""

    states: torch.Tensor  # [entries, HV, K, V] bf16: the state at every chunk start, key-first
    records: torch.Tensor  # [entries * HV * chunk_record_bytes] uint8: chunk_prepare's chunk records
    gate_check: Optional[GateCheck] = None  # an unbounded gate's span check (forward_gate_check)


def chunk_entries(B: int, T: int, N: int, varlen: bool) -> int:
    """Entries of the per-chunk tensors of a batch (the states at chunk starts, their gradients, the
    forward's records): ``B · ceil(T / 64)``, or with ``cu_seqlens`` (N sequences) ``T // 64 + N``, a
    bound on ``Σ ceil(len / 64)`` known without reading the lengths. Chunk j of sequence n is entry
    ``Σ_{m<n} ceil(len_m / 64) + j``."""
    if not varlen:
        return B * -(-T // _CHUNK)
    return T // _CHUNK + N if N else 0


def forward_records(B: int, T: int, N: int, HV: int, varlen: bool, device) -> Optional[ForwardRecords]:
    """Fresh :class:`ForwardRecords` for a chunked forward under autograd (on a device whose chunked
    kernels run) to fill (``chunk_fwd``'s ``chunk_states`` and ``records``), or None without the
    extension. K = V = 128."""
    if not _ext.HAS_EXTENSION:
        return None
    entries, K = chunk_entries(B, T, N, varlen), C.CHUNK_HEAD_DIM
    return ForwardRecords(torch.empty(entries, HV, K, K, dtype=_BOUNDARY_STATE_DTYPE, device=device),
                          torch.empty(entries * HV * _ext.CHUNK_RECORD_BYTES, dtype=torch.uint8, device=device))


def _gate_bounded(use_gate_in_kernel: bool, lower_bound: Optional[float]) -> bool:
    """Whether the gate itself keeps every 16 tokens' log decay within the backward kernels' span
    (a lower bound, at least -5 a token): no look at the data. Without the extension, no kernels:
    False."""
    return (_ext.HAS_EXTENSION and use_gate_in_kernel and lower_bound is not None
            and -lower_bound * _SUB_CHUNK <= _ext.CHUNK_BWD_MAX_SUBCHUNK_SPAN)


def forward_gate_check(g, A_log, dt_bias, use_gate_in_kernel: bool, lower_bound) -> Optional[GateCheck]:
    """The backward kernels' span check of an unbounded gate (raw ``g``, ``[B, T, HV, K]`` or
    ``[B, T, HV]``), launched by a forward under autograd before its kernels (so it is done long
    before the backward asks), or None: a bounded gate (no check), traced or captured code (the
    backward then checks itself), CPU tensors or no extension."""
    if (not g.is_cuda or not _ext.HAS_EXTENSION or _gate_bounded(use_gate_in_kernel, lower_bound)
            or torch.compiler.is_compiling() or torch.cuda.is_current_stream_capturing()):
        return None
    gate = log_decay(g, use_gate_in_kernel=use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound)
    within = torch.empty((), dtype=torch.bool, pin_memory=True)
    within.copy_(_spans_within_device(gate, _ext.CHUNK_BWD_MAX_SUBCHUNK_SPAN), non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    return GateCheck(within, event)


def _needs_flags(needs, tensors) -> list:
    """Which of the eight tensor inputs get a gradient: required and present."""
    return [bool(n) and t is not None for n, t in zip(needs, tensors)]


def _needs_mask(needs, tensors) -> int:
    return sum(1 << i for i, f in enumerate(_needs_flags(needs, tensors)) if f)


# The backward as one opaque op: torch.compile traces ChunkFunction (the forward's op has a fake
# implementation too) without looking inside, where host reads decide the layout.
@torch.library.custom_op("flashkda::chunk_bwd", mutates_args=())
def _chunk_bwd_op(do: Optional[torch.Tensor], dht: Optional[torch.Tensor], q: torch.Tensor, k: torch.Tensor,
                  v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, A_log: Optional[torch.Tensor],
                  dt_bias: Optional[torch.Tensor], initial_state: Optional[torch.Tensor],
                  states: Optional[torch.Tensor], records: Optional[torch.Tensor], gate_spans: int,
                  cu_seqlens: Optional[torch.Tensor], cu_seqlens_cpu: Optional[torch.Tensor], scale: float,
                  use_qk_l2norm_in_kernel: bool, use_gate_in_kernel: bool, lower_bound: Optional[float],
                  use_beta_sigmoid_in_kernel: bool, allow_neg_eigval: bool, state_v_first: bool,
                  needs: int) -> List[torch.Tensor]:
    """:func:`chunk_backward` as an op: the gradients of the eight tensor inputs (bit i of ``needs``:
    input i wants one), an empty tensor for each that gets none; ``states`` and ``records``: the
    forward's :class:`ForwardRecords`, or None; ``gate_spans``: its :class:`GateCheck`'s answer (1
    within, 0 not, -1 not known)."""
    opts = ChunkOptions(scale, use_qk_l2norm_in_kernel, use_gate_in_kernel, lower_bound, use_beta_sigmoid_in_kernel,
                        allow_neg_eigval, state_v_first, cu_seqlens, cu_seqlens_cpu)
    tensors = (q, k, v, g, beta, A_log, dt_bias, initial_state)
    flags = [bool(needs >> i & 1) for i in range(len(tensors))]
    saved = None if records is None else ForwardRecords(states, records)
    grads = chunk_backward(opts, *tensors, do=do, dht=dht, needs_grad=flags, records=saved,
                           gate_within=None if gate_spans < 0 else bool(gate_spans))
    # A gradient no input reaches (A_log without the gate in the kernel, say) is zero.
    return [(gr if gr is not None else torch.zeros_like(t)) if f else q.new_empty(0)
            for gr, t, f in zip(grads, tensors, flags)]


@_chunk_bwd_op.register_fake
def _chunk_bwd_fake(do, dht, q, k, v, g, beta, A_log, dt_bias, initial_state, states, records, gate_spans,
                    cu_seqlens, cu_seqlens_cpu, scale,
                    use_qk_l2norm_in_kernel, use_gate_in_kernel, lower_bound, use_beta_sigmoid_in_kernel,
                    allow_neg_eigval, state_v_first, needs):
    tensors = (q, k, v, g, beta, A_log, dt_bias, initial_state)
    return [torch.empty_like(t) if needs >> i & 1 else q.new_empty(0) for i, t in enumerate(tensors)]


def _sequence_spans(B: int, T: int, cu_seqlens, cu_seqlens_cpu, device) -> Tuple[torch.Tensor, torch.Tensor, int, int]:
    """``(starts [N], lens [N], N, J)``: each sequence's first token row (of the ``B * T`` flattened
    tokens) and length on the device, and ``J`` the longest one's chunk count. With ``cu_seqlens``,
    ``J`` comes from ``cu_seqlens_cpu``, else from one read of ``cu_seqlens`` (a synchronisation)."""
    if cu_seqlens is None:
        starts = torch.arange(B, dtype=torch.long, device=device) * T
        return starts, torch.full((B,), T, dtype=torch.long, device=device), B, -(-T // _CHUNK)
    host = (cu_seqlens_cpu if cu_seqlens_cpu is not None else cu_seqlens).tolist()
    J = max((-(-(b - a) // _CHUNK) for a, b in zip(host, host[1:])), default=0)
    cu = cu_seqlens.to(device, torch.long)
    return cu[:-1], cu[1:] - cu[:-1], len(host) - 1, J


def _chunk_rows(B: int, T: int, cu_seqlens, cu_seqlens_cpu, device) -> Tuple[torch.Tensor, int, int]:
    """``(rows [N, J * 64], N, J)``: the token row (of the ``B * T`` flattened tokens) at each position
    of each sequence's chunks, ``B * T`` (a zero row) past the sequence's end (see
    :func:`_sequence_spans`)."""
    starts, lens, N, J = _sequence_spans(B, T, cu_seqlens, cu_seqlens_cpu, device)
    pos = torch.arange(J * _CHUNK, device=device)
    return torch.where(pos[None] < lens[:, None], starts[:, None] + pos[None], B * T), N, J


def _suffix_sums(x: torch.Tensor) -> torch.Tensor:
    """``Σ_{i >= t} x_i`` along dim -2."""
    return x.flip(-2).cumsum(-2).flip(-2)


def _exclusive_suffix_sums(g: torch.Tensor) -> torch.Tensor:
    """``Σ_{t > i} g_t`` along dim -2, summing only those terms (no difference of long sums, which
    would lose the small terms beside a ``-1e4`` mask)."""
    s = _suffix_sums(g)
    return torch.cat([s[..., 1:, :], torch.zeros_like(s[..., :1, :])], dim=-2)


class _Decays(NamedTuple):
    """The decay factors of every chunk ``[.., C, K]`` that the Gram matrices and their gradients use,
    formed once (see :func:`_decayed_grams`)."""

    pivot: bool
    block: int  # tokens per diagonal block
    diag: torch.Tensor  # pivot: [.., nb, 2, bs, K] e^{γ−h}, e^{h−γ}; else [.., nb, i, j, K] e^{Σ_{j<t<=i}}
    col: torch.Tensor  # [.., C, K] e^{Σ_{j<t<=r}}, r the last token of j's block
    rows: List[torch.Tensor]  # for block b: [.., C − (b+1) bs, K] e^{Σ_{r<t<=i}} of the rows after it
    eG: torch.Tensor  # [.., C, K] e^Γ
    tail: torch.Tensor  # [.., C, K] e^{Γ_C − Γ}


def _decays(g: torch.Tensor, pivot: bool) -> _Decays:
    """Every factor from sums of only the log decays concerned, never differences of long sums
    (those lose the small terms beside a ``-1e4`` mask)."""
    *lead, Cn, K = g.shape
    bs = _PIVOT_BLOCK if pivot else _EXACT_BLOCK
    nb = Cn // bs
    gb = g.reshape(*lead, nb, bs, K)
    if pivot:
        gamma = gb.cumsum(-2)
        half = gamma[..., -1:, :] * 0.5
        diag = torch.stack([(gamma - half).exp(), (half - gamma).exp()], dim=-3)
    else:
        lower = torch.ones(bs, bs, dtype=torch.bool, device=g.device).tril()
        strict = torch.ones(bs, bs, dtype=torch.bool, device=g.device).tril(-1)
        spans = torch.where(strict[:, :, None], gb[..., :, None, :], 0.0).cumsum(-3)
        diag = torch.where(lower[:, :, None], spans, float("-inf")).exp()  # upper triangle masked first
    return _Decays(pivot=pivot, block=bs, diag=diag, col=_exclusive_suffix_sums(gb).exp().reshape(*lead, Cn, K),
                   rows=[g[..., (b + 1) * bs:, :].cumsum(-2).exp() for b in range(nb - 1)],
                   eG=g.cumsum(-2).exp(), tail=_exclusive_suffix_sums(g).exp())


def _decayed_grams(q: torch.Tensor, k: torch.Tensor, dec: _Decays) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(M, A)`` of chunks ``[..., C, K]``: ``M_ij = Σ_c q_ic k_jc e^{Γ_ic − Γ_jc}`` for ``j <= i``,
    ``A_ij`` the same with ``k`` for rows and ``j < i``, zero elsewhere; ``Γ_i − Γ_j = Σ_{j<t<=i} g_t``.

    A block below the diagonal (rows after block b, columns in b) is the product of
    ``x e^{Σ_{r<t<=i} g_t}`` and ``k e^{Σ_{j<t<=r} g_t}``, ``r`` block b's last token: both factors at
    most 1 for log decays ``<= 0``. Diagonal blocks: with ``pivot`` (every block's decay within
    _PIVOT_SPAN) the product of ``x e^{γ−h}`` and ``k e^{h−γ}`` (γ the decay from the block start, h
    half the block's), masked after; otherwise the pairwise decay factors, the upper triangle masked
    before the exponential (any gate, ``-1e4`` masks included).
    """
    *lead, Cn, K = q.shape
    bs = dec.block
    nb = Cn // bs
    qb, kb = (x.reshape(*lead, nb, bs, K) for x in (q, k))
    lower = torch.ones(bs, bs, dtype=torch.bool, device=q.device).tril()
    strict = torch.ones(bs, bs, dtype=torch.bool, device=q.device).tril(-1)
    if dec.pivot:
        col = (kb * dec.diag[..., 1, :, :]).transpose(-1, -2)
        m_diag = ((qb * dec.diag[..., 0, :, :]) @ col).masked_fill(~lower, 0.0)
        a_diag = ((kb * dec.diag[..., 0, :, :]) @ col).masked_fill(~strict, 0.0)
    else:
        kd = kb[..., None, :, :] * dec.diag  # [..., nb, i, j, K]: k_j e^{Σ_{j<t<=i}}
        m_diag = (qb[..., :, None, :] * kd).sum(-1)
        a_diag = (kb[..., :, None, :] * kd).sum(-1).masked_fill(~strict, 0.0)
    M = q.new_zeros(*lead, Cn, Cn)
    A = q.new_zeros(*lead, Cn, Cn)
    for b in range(nb):
        cols = slice(b * bs, (b + 1) * bs)
        M[..., cols, cols] = m_diag[..., b, :, :]
        A[..., cols, cols] = a_diag[..., b, :, :]
        if b + 1 == nb:
            break
        rows = slice((b + 1) * bs, Cn)
        col = (k[..., cols, :] * dec.col[..., cols, :]).transpose(-1, -2)
        M[..., rows, cols] = (q[..., rows, :] * dec.rows[b]) @ col
        A[..., rows, cols] = (k[..., rows, :] * dec.rows[b]) @ col
    return M, A


def _pivot_safe(g: torch.Tensor, bounded: bool) -> bool:
    """Whether every pivot block's decay spans at most _PIVOT_SPAN (``bounded``: known from the gate,
    no look at the data; otherwise one read of the device, which synchronises)."""
    if bounded:
        return True
    spans = g.reshape(*g.shape[:-2], -1, _PIVOT_BLOCK, g.shape[-1]).sum(-2)
    return bool((spans >= -_PIVOT_SPAN).all())


class _Local(NamedTuple):
    """Per-chunk quantities ``[N, HV, J, ...]`` that do not depend on the state."""

    qg: torch.Tensor  # [.., C, K] q e^Γ
    kd: torch.Tensor  # [.., C, K] k e^{Γ_C − Γ}
    w: torch.Tensor  # [.., C, K] T (k e^Γ)
    u: torch.Tensor  # [.., C, V] T v
    M: torch.Tensor  # [.., C, C] tril(q kᵀ ⊙ e^{Γi−Γj})
    decay: torch.Tensor  # [.., K] e^{Γ_C}
    kg: torch.Tensor  # [.., C, K] k e^Γ
    A: torch.Tensor  # [.., C, C] strict_tril(k kᵀ ⊙ e^{Γi−Γj}), before diag(β)
    L: torch.Tensor  # [.., C, C] (I + diag(β) A)⁻¹
    T: torch.Tensor  # [.., C, C] L diag(β)


def _chunk_local(q, k, v, beta, dec: _Decays) -> _Local:
    """Every chunk's local quantities from preprocessed ``q, k [.., C, K]``, ``v [.., C, V]``,
    ``beta [.., C]`` (fp32) and the chunk's decay factors."""
    M, A = _decayed_grams(q, k, dec)
    eye = torch.eye(q.shape[-2], dtype=q.dtype, device=q.device)
    # (I + diag(β) A)⁻¹ by a unit lower-triangular solve (A is strictly lower).
    L = torch.linalg.solve_triangular(beta[..., :, None] * A, eye.expand_as(A), upper=False, unitriangular=True)
    T = L * beta[..., None, :]
    kg = k * dec.eG
    return _Local(qg=q * dec.eG, kd=k * dec.tail, w=T @ kg, u=T @ v, M=M, decay=dec.eG[..., -1, :],
                  kg=kg, A=A, L=L, T=T)


def _exclusive_prefix_sums(x: torch.Tensor) -> torch.Tensor:
    """``Σ_{i < t} x_i`` along dim -2."""
    return torch.cat([torch.zeros_like(x[..., :1, :]), x[..., :-1, :].cumsum(-2)], dim=-2)


def _gram_grads(dZ: torch.Tensor, x: torch.Tensor, y: torch.Tensor, dec: _Decays):
    """For ``Z_ij = Σ_c x_ic y_jc e^{Σ_{j<t<=i} g_tc}`` (``j <= i``) and its gradient ``dZ`` (zero where
    Z is not defined): ``(dx, dy, dg)``, in the blocks of :func:`_decayed_grams`. Each block's
    gradient in ``g`` follows the sums that block's factors are made of (a token's log decay gets the
    terms of the pairs it lies between), never differences of whole-chunk sums: those cancel, and
    lose the small gradients of strongly decayed chunks."""
    *lead, Cn, K = x.shape
    bs = dec.block
    nb = Cn // bs
    xb, yb = (t.reshape(*lead, nb, bs, K) for t in (x, y))
    dZd = torch.stack([dZ[..., b * bs:(b + 1) * bs, b * bs:(b + 1) * bs] for b in range(nb)], dim=-3)
    if dec.pivot:  # X = x e^{γ−h}, Y = y e^{h−γ}: γ the decay from the block start, h half the block's
        row, col = dec.diag[..., 0, :, :], dec.diag[..., 1, :, :]
        X, Y = xb * row, yb * col
        dX, dY = dZd @ Y, dZd.transpose(-1, -2) @ X
        dx, dy = dX * row, dY * col
        dgamma = dX * X - dY * Y
        dg = _suffix_sums(dgamma) - 0.5 * dgamma.sum(-2, keepdim=True)
    else:  # W_ij = dZ_ij x_i y_j e^{Σ_{j<t<=i} g}; g_t gets Σ_{i >= t > j} W_ij
        strict = torch.ones(bs, bs, dtype=torch.bool, device=x.device).tril(-1)
        weight = dZd[..., None] * dec.diag  # [.., nb, i, j, K]
        dx = (weight * yb[..., None, :, :]).sum(-2)
        dy = (weight * xb[..., :, None, :]).sum(-3)
        pair = weight * xb[..., :, None, :] * yb[..., None, :, :]
        dg = (pair.flip(-3).cumsum(-3).flip(-3) * strict[:, :, None]).sum(-2)  # row t: Σ_{i>=t} Σ_{j<t}
    dx, dy, dg = (t.reshape(*lead, Cn, K) for t in (dx, dy, dg))
    for b in range(nb - 1):
        rows, cols = slice((b + 1) * bs, Cn), slice(b * bs, (b + 1) * bs)
        X, Y = x[..., rows, :] * dec.rows[b], y[..., cols, :] * dec.col[..., cols, :]
        block = dZ[..., rows, cols]
        dX, dY = block @ Y, block.transpose(-1, -2) @ X
        dx[..., rows, :] += dX * dec.rows[b]
        dy[..., cols, :] += dY * dec.col[..., cols, :]
        dg[..., rows, :] += _suffix_sums(dX * X)
        dg[..., cols, :] += _exclusive_prefix_sums(dY * Y)
    return dx, dy, dg


def _chunk_local_backward(loc: _Local, dec: _Decays, q, k, v, beta, S, dO, dS_next):
    """``(dq, dk, dv, dg, dbeta)`` of every chunk's inputs (preprocessed, ``[N, HV, J, C, ·]``) from
    the gradients of its output ``dO`` and of its next state ``dS_next``, the states at chunk starts
    ``S`` held constant (the scans carry the state's gradient across chunks)."""
    U = loc.u - loc.w @ S
    dU = loc.M.transpose(-1, -2) @ dO + loc.kd @ dS_next
    dM = (dO @ U.transpose(-1, -2)).tril()
    dqg = dO @ S.transpose(-1, -2)
    dkd = U @ dS_next.transpose(-1, -2)
    dw = -dU @ S.transpose(-1, -2)
    dv = loc.T.transpose(-1, -2) @ dU
    dT = dU @ v.transpose(-1, -2) + dw @ loc.kg.transpose(-1, -2)
    dkg = loc.T.transpose(-1, -2) @ dw
    dbeta = (dT * loc.L).sum(-2)  # T = L diag(β)
    Lt = loc.L.transpose(-1, -2)
    dA = -(Lt @ (dT * beta[..., None, :]) @ Lt).tril(-1)  # L = (I + diag(β) A)⁻¹
    dbeta = dbeta + (dA * loc.A).sum(-1)
    dqM, dkM, dgM = _gram_grads(dM, q, k, dec)
    dkAr, dkAc, dgA = _gram_grads(dA * beta[..., :, None], k, k, dec)
    dq = dqM + dqg * dec.eG
    dk = dkM + dkAr + dkAc + dkg * dec.eG + dkd * dec.tail
    # q e^Γ, k e^Γ: Γ_i sums g up to i; k e^{Γ_C−Γ}: the g after i; e^{Γ_C}: every g of the chunk.
    dg = (dgM + dgA + _suffix_sums(dqg * loc.qg + dkg * loc.kg) + _exclusive_prefix_sums(dkd * loc.kd)
          + ((S * dS_next).sum(-1) * loc.decay)[..., None, :])
    return dq, dk, dv, dg, dbeta


def _transitions(loc: _Local) -> torch.Tensor:
    """``[J, N*HV, K, K]``: each chunk's map of the state, ``S' = (diag(e^{Γ_C}) − kdᵀ w) S + kdᵀ u``;
    its transpose carries the state's gradient back."""
    N, HV, J, _, K = loc.w.shape
    D = torch.diag_embed(loc.decay) - loc.kd.transpose(-1, -2) @ loc.w
    return D.permute(2, 0, 1, 3, 4).reshape(J, N * HV, K, K)


def _state_scan(loc: _Local, D: torch.Tensor, S: torch.Tensor) -> torch.Tensor:
    """States at the start of every chunk, ``[N, HV, J, K, V]``, from the initial ``S [N, HV, K, V]``:
    one batched multiply-add per chunk."""
    N, HV, J, _, K = loc.w.shape
    V = S.shape[-1]
    B = (loc.kd.transpose(-1, -2) @ loc.u).permute(2, 0, 1, 3, 4).reshape(J, N * HV, K, V)
    states = S.new_empty(J, N * HV, K, V)
    if J:
        states[0] = S.reshape(N * HV, K, V)
    for j in range(J - 1):
        torch.baddbmm(B[j], D[j], states[j], out=states[j + 1])
    return states.view(J, N, HV, K, V).permute(1, 2, 0, 3, 4)


def _state_grad_scan(loc: _Local, D: torch.Tensor, dO: torch.Tensor, dS: torch.Tensor):
    """``(dS_next [N, HV, J, K, V], dS0)``: the gradient of the state after every chunk and of the
    initial state, from ``dO [N, HV, J, C, V]`` and the final state's gradient ``dS [N, HV, K, V]``:
    ``dS = Dᵀ dS' + (q e^Γ − M w)ᵀ dO``, one batched multiply-add per chunk."""
    N, HV, J, _, K = loc.w.shape
    V = dS.shape[-1]
    if J == 0:  # no chunk: the initial state's gradient is the final state's (a copy, not an alias)
        return dS.new_empty(N, HV, 0, K, V), dS.clone()
    Y = ((loc.qg - loc.M @ loc.w).transpose(-1, -2) @ dO).permute(2, 0, 1, 3, 4).reshape(J, N * HV, K, V)
    Dt = D.transpose(-1, -2)
    nexts = dS.new_empty(J, N * HV, K, V)
    nexts[J - 1] = dS.reshape(N * HV, K, V)
    for j in range(J - 1, 0, -1):
        torch.baddbmm(Y[j], Dt[j], nexts[j], out=nexts[j - 1])
    dS0 = torch.baddbmm(Y[0], Dt[0], nexts[0]).view(N, HV, K, V)
    return nexts.view(J, N, HV, K, V).permute(1, 2, 0, 3, 4), dS0


def head_dim_shortfall(K: int, V: int) -> Optional[str]:
    """Why the backward's kernels do not take these head dims, or None."""
    if K != C.CHUNK_HEAD_DIM or V != C.CHUNK_HEAD_DIM:
        return f"head dims K = {K}, V = {V} (the backward's kernels take {C.CHUNK_HEAD_DIM})"
    return None


def _device_shortfall(qp: torch.Tensor, V: int) -> Optional[str]:
    """Why no CUDA kernel of the backward takes these inputs (device, extension, head dims), or None."""
    if not qp.is_cuda:
        return "inputs not on a CUDA device"
    if not _ext.HAS_EXTENSION:
        return "the CUDA extension is not built"
    return head_dim_shortfall(qp.shape[-1], V)


def _gate_shortfall(opts: ChunkOptions, gp: Optional[torch.Tensor], gate_within: Optional[bool]) -> Optional[str]:
    """Why the gate keeps the backward off its bf16 kernel path, or None: the log decays ``gp``
    (preprocessed, ``[B, T, HV, K]``, or ``[B, T, HV]`` for a scalar gate) of every 16 consecutive
    tokens must stay within the kernels' span: known from a lower bound, or from the forward's check
    (``gate_within``, :class:`GateCheck`), else one look at the device (a synchronisation, which
    CUDA graph capture forbids: a ``RuntimeError`` naming it there)."""
    span = _ext.CHUNK_BWD_MAX_SUBCHUNK_SPAN
    if _gate_bounded(opts.use_gate_in_kernel, opts.lower_bound):
        return None
    if gate_within is None and torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "flashkda: under CUDA graph capture the backward cannot check a gate without a lower bound against "
            f"its kernels' span (a read of the device); capture with use_gate_in_kernel=True and lower_bound >= "
            f"{-span / _SUB_CHUNK:g}, or run this backward outside the capture")
    if not (gate_within if gate_within is not None else _spans_within(gp, span)):
        return f"log decays summing below -{span:g} over {_SUB_CHUNK} tokens"
    return None


def _spans_within_device(gate: torch.Tensor, span: float) -> torch.Tensor:
    """Whether the log decays ``gate`` (tokens along dim 1) of any 16 consecutive tokens (all of
    them, with fewer) sum to at least ``-span``: a bool on ``gate``'s device."""
    T = gate.shape[1]
    window = gate.unfold(1, _SUB_CHUNK, 1).sum(-1) if T >= _SUB_CHUNK else gate.sum(1, keepdim=True)
    return (window >= -span).all()


def _spans_within(gate: torch.Tensor, span: float) -> bool:
    """:func:`_spans_within_device`, read back (a synchronisation)."""
    return bool(_spans_within_device(gate, span))


#: The chunk layout of batches without cu_seqlens, by (B, T, CUDA device): built once on the host
#: and copied, instead of some twenty tiny kernels in every backward. Read only.
_dense_layouts: dict = {}
_DENSE_LAYOUTS_KEPT = 64


def _kernel_chunks(B: int, T: int, cu_seqlens, device) -> Tuple[torch.Tensor, ...]:
    """The kernels' chunks, every sequence's consecutive: ``(bos [C] int64, len [C] int32,
    seq_first [N] int64, seq_chunks [N] int32, N, C)``, sequence n's ``seq_chunks[n]`` chunks from
    ``seq_first[n]``. ``C`` (:func:`chunk_entries`) is known without reading ``cu_seqlens``: all of
    it is built on the device, and the chunks past the last sequence's are empty. Without
    ``cu_seqlens`` on a CUDA device, the layout of (B, T) is built once (outside graph capture) and
    kept; the tensors returned are then shared, and must not be written."""
    dev = torch.device(device)
    if cu_seqlens is None and dev.type == "cuda":
        key = (B, T, dev.index if dev.index is not None else torch.cuda.current_device())
        if key not in _dense_layouts and not torch.cuda.is_current_stream_capturing():
            if len(_dense_layouts) >= _DENSE_LAYOUTS_KEPT:
                _dense_layouts.pop(next(iter(_dense_layouts)))
            _dense_layouts[key] = tuple(x.to(dev) if isinstance(x, torch.Tensor) else x
                                        for x in _build_chunks(B, T, None, "cpu"))
        if key in _dense_layouts:
            return _dense_layouts[key]
    return _build_chunks(B, T, cu_seqlens, dev)


def _build_chunks(B: int, T: int, cu_seqlens, device) -> Tuple[torch.Tensor, ...]:
    """:func:`_kernel_chunks`, built with ops on ``device``."""
    if cu_seqlens is None:
        N = B
        starts = torch.arange(B, dtype=torch.long, device=device) * T
        lens = torch.full((B,), T, dtype=torch.long, device=device)
    else:
        cu = cu_seqlens.to(device, torch.long)
        N = cu.shape[0] - 1
        starts, lens = cu[:-1], cu[1:] - cu[:-1]
    C = chunk_entries(B, T, N, cu_seqlens is not None)
    counts = (lens + _CHUNK - 1) // _CHUNK
    first = torch.cumsum(counts, 0) - counts
    c = torch.arange(C, dtype=torch.long, device=device)
    # The sequence whose chunks hold chunk c: the last one starting at or before it (an empty one
    # starts where the next does, and loses the tie); past the last chunk, the last sequence, whose
    # length leaves those chunks empty.
    seq = (torch.searchsorted(first, c, right=True) - 1).clamp_min(0)
    j = c - first[seq]
    length = (lens[seq] - j * _CHUNK).clamp(0, _CHUNK).to(torch.int32)
    return starts[seq] + j * _CHUNK, length, first, counts.to(torch.int32), N, C


class Boundary(NamedTuple):
    """The states at chunk starts and the gradients of the states after chunks, ``[C, HV, K, V]``
    bf16 in the backward's chunk layout (chunk j of sequence n is entry ``seq_first[n] + j``, the
    forward kernels' dense chunk states), and the initial state's gradient ``[N, HV, K, V]`` fp32."""

    states: torch.Tensor
    nexts: torch.Tensor
    dS0: torch.Tensor


def _kernel_backward(opts: ChunkOptions, qp, kp, v, gp, bp, S0, dS, do, boundary: Optional[Boundary] = None,
                     owned: bool = False, raw_qk: Optional[tuple] = None):
    """The backward on the CUDA kernels: ``(dq̂, dk̂, dv, dg, dβ [B, T, HV, ·], dS0)``, fp32 but dv in v's
    dtype where that is bf16 or fp16 (the kernel rounds it once, as the final cast would), from the
    preprocessed fp32 inputs ``[B, T, HV, ·]`` (q̂, k̂ repeated over each group; a scalar gate's log
    decay ``[B, T, HV]``, and then its gradient, summed over the key channels, too), the initial state
    ``S0`` and the final state's gradient ``dS`` ``[N, HV, K, V]`` (fp32), and ``do`` (None: zero).

    The states at chunk starts and the gradients of the states after chunks are ``boundary``
    (chunk_state_grad on the chunked forward's records, see :func:`_chunked_boundary_states`) when
    given, else they come from the per-chunk kernel's state maps (D, B) and Y = Pᵀ dO and two scans
    over chunks. The per-chunk
    kernel's gradients pass then writes every token's gradients; with ``owned`` (``qp, kp, gp, bp``
    are the backward's own buffers, read no more after it) over those inputs where it can (the
    whole pass, every token in a chunk). ``raw_qk`` ``(dtype, rnorm)`` (the whole pass, one value
    head per key head): dq and dk come back as the raw q's and k's gradients in ``dtype``, through the
    scale and the l2 norm (``rnorm`` ``[B, T, HV, 2]``: chunk_bwd_inputs' 1 / norms of the rows); with
    it, a scalar gate's ``qp, kp`` may be the raw bf16 / fp16 q and k themselves (``rnorm`` None),
    which the pass normalises as chunk_bwd_inputs would.
    Nothing is read back to the host (the chunk layout is built on the device)."""
    B, T, HV, K = qp.shape
    V = v.shape[-1]
    rows = B * T
    f32 = torch.float32

    def flat(x):  # [B, T, HV, ·] -> [rows, HV, ·] fp32
        return x.reshape(rows, HV, *x.shape[3:]).to(f32).contiguous()

    # A scalar gate stays [rows, HV]: the kernel reads it for every key channel and sums its gradient.
    # The raw q and k (16-bit) go in as they are.
    raw_in = qp.dtype != f32
    q32, k32 = (x.reshape(rows, HV, K).contiguous() if raw_in else flat(x) for x in (qp, kp))
    g32, b32 = flat(gp), flat(bp)
    # v and dO in their own dtype: the kernel takes them as bf16 operands (others rounded by the op).
    v16 = v.reshape(rows, HV, V).contiguous()
    dO = v16.new_zeros(rows, HV, V) if do is None else do.reshape(rows, HV, V).contiguous()
    bos, length, seq_first, seq_chunks, N, C = _kernel_chunks(B, T, opts.cu_seqlens, qp.device)
    if C == 0 or rows == 0:  # no token: the initial state's gradient is the final state's
        qk_type = f32 if raw_qk is None else raw_qk[0]
        return (*(q32.new_zeros(B, T, HV, K, dtype=qk_type) for _ in range(2)), q32.new_zeros(B, T, HV, V),
                torch.zeros_like(gp, dtype=f32), b32.new_zeros(B, T, HV), dS.clone())
    if boundary is not None:
        states, nexts, dS0 = boundary
    else:
        D, Bm, Y = _ext.chunk_local_grad_op(q32, k32, v16, g32, b32, dO, bos, length, 0)
        (states,) = _ext.chunk_state_scan_op(D, Bm, S0.contiguous(), seq_first, seq_chunks, False)
        del Bm  # each map is freed once its scan is done: the gradients pass's outputs take its place
        nexts, dS0 = _ext.chunk_state_scan_op(D, Y, dS.contiguous(), seq_first, seq_chunks, True)
        del D, Y
    every_token = _chunks_cover_every_token(opts, rows)
    overwrite = owned and every_token and not _ext.chunk_bwd_in_value_halves(qp.get_device())
    raw_args = () if raw_qk is None else (
        None if raw_qk[1] is None else raw_qk[1].reshape(rows, HV, 2), opts.scale, opts.use_qk_l2norm_in_kernel,
        raw_qk[0])
    dq, dk, dv, dg, db = _ext.chunk_local_grad_op(q32, k32, v16, g32, b32, dO, bos, length, 1, states, nexts,
                                                  every_token, overwrite, *raw_args)
    return (dq.view(B, T, HV, K), dk.view(B, T, HV, K), dv.view(B, T, HV, V), dg.view(gp.shape),
            db.view(B, T, HV), dS0)


def _chunks_cover_every_token(opts: ChunkOptions, rows: int) -> bool:
    """Whether the sequences cover all ``rows`` tokens (then the gradients pass writes every token's
    gradients and nothing is zero-filled first): always without ``cu_seqlens``; with them, known from
    ``cu_seqlens_cpu`` when given (no synchronisation), else assumed not."""
    if opts.cu_seqlens is None:
        return True
    cu = opts.cu_seqlens_cpu
    return cu is not None and cu.numel() > 1 and int(cu[0]) == 0 and int(cu[-1]) == rows


def _l2norm_grad(x: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    """Gradient of ``x / sqrt(Σ x² + eps)`` over the last dim: ``r dy − r y (dy · y)``."""
    r = torch.rsqrt((x * x).sum(-1, keepdim=True) + C.L2NORM_EPS)
    return _l2norm_grad_of(x * r, r, dy)


def _l2norm_grad_of(y: torch.Tensor, r: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    """:func:`_l2norm_grad` from the normalised rows ``y`` and their ``1 / norm`` ``r`` (last dim 1)."""
    return r * (dy - y * (dy * y).sum(-1, keepdim=True))


def _preprocess_grads(opts: ChunkOptions, q, k, g, beta, A_log, dt_bias, dq, dk, dg, dbeta):
    """Gradients of the raw ``q, k, g, beta, A_log, dt_bias`` (fp32, in their shapes; None for the
    gate parameters when not used) from those of :func:`flashkda.reference.preprocess`'s outputs."""
    f32 = torch.float32
    dq = dq * opts.scale
    if opts.use_qk_l2norm_in_kernel:
        dq, dk = _l2norm_grad(q.to(f32), dq), _l2norm_grad(k.to(f32), dk)
    dA_log = ddt_bias = None
    if opts.use_gate_in_kernel:
        hv = g.shape[2]
        per_channel = g.dim() == 4
        x = g.to(f32)
        if dt_bias is not None:
            x = x + dt_bias.to(f32).reshape((hv, -1) if per_channel else (hv,))
        a = torch.ones(hv, dtype=f32, device=g.device) if A_log is None else A_log.to(f32).reshape(hv).exp()
        if per_channel:
            a = a[:, None]
        if opts.lower_bound is not None:  # lower_bound · sigmoid(a x)
            s = torch.sigmoid(a * x)
            dz = dg * (opts.lower_bound * s * (1 - s))
            dx, da_terms = dz * a, dz * x * a
        else:  # −a · softplus(x), softplus' = sigmoid below the threshold, 1 above
            slope = torch.where(x > C.SOFTPLUS_THRESHOLD, torch.ones_like(x), torch.sigmoid(x))
            dx = dg * (-a) * slope
            da_terms = dg * (-a) * torch.where(x > C.SOFTPLUS_THRESHOLD, x, torch.nn.functional.softplus(x))
        dg = dx
        dims = (0, 1, 3) if per_channel else (0, 1)
        if A_log is not None:
            dA_log = da_terms.sum(dims).reshape(A_log.shape)
        if dt_bias is not None:
            ddt_bias = dx.sum((0, 1)).reshape(dt_bias.shape)
    if opts.use_beta_sigmoid_in_kernel:
        s = torch.sigmoid(beta.to(f32))
        dbeta = dbeta * s * (1 - s) * (2.0 if opts.allow_neg_eigval else 1.0)
    return dq, dk, dg, dbeta, dA_log, ddt_bias


def _torch_backward(opts: ChunkOptions, qp, kp, v, gp, bp, S0, dS, do, boundary: Optional[Boundary] = None):
    """The backward in PyTorch (fp32, the 64-token chunk layout), with the outputs of
    :func:`_kernel_backward`: every input, gate and length. With ``boundary`` (the kernels' states at
    chunk boundaries, bf16) its scans over chunks are not run."""
    B, T, HV, K = qp.shape
    V = v.shape[-1]
    f32 = torch.float32
    dev = qp.device
    rows, N, J = _chunk_rows(B, T, opts.cu_seqlens, opts.cu_seqlens_cpu, dev)

    def chunks(x: torch.Tensor) -> torch.Tensor:
        """[B, T, HV, D] -> [N, HV, J, C, D], zero past each sequence's end; contiguous, so that the
        elementwise work on it runs vectorized."""
        flat = x.reshape(B * T, HV, x.shape[-1])
        flat = torch.cat([flat, flat.new_zeros(1, HV, flat.shape[-1])])
        return flat[rows].view(N, J, _CHUNK, HV, flat.shape[-1]).permute(0, 3, 1, 2, 4).contiguous()

    def tokens(x: torch.Tensor) -> torch.Tensor:
        """The inverse: [N, HV, J, C, D] -> [B, T, HV, D], padding dropped."""
        D = x.shape[-1]
        flat = x.new_zeros(B * T + 1, HV, D)
        flat.index_add_(0, rows.reshape(-1), x.permute(0, 2, 3, 1, 4).reshape(-1, HV, D))
        return flat[:-1].view(B, T, HV, D)

    scalar_gate = gp.dim() == 3
    qc, kc, vc = chunks(qp), chunks(kp), chunks(v.to(f32))
    gc = chunks(gp[..., None].expand(B, T, HV, K) if scalar_gate else gp)
    bc = chunks(bp[..., None])[..., 0]
    pivot = _pivot_safe(gc, opts.use_gate_in_kernel and opts.lower_bound is not None)
    dec = _decays(gc, pivot)
    loc = _chunk_local(qc, kc, vc, bc, dec)
    dO = torch.zeros(B * T + 1, HV, V, dtype=f32, device=dev)
    if do is not None:
        dO[:-1] = do.reshape(B * T, HV, V)
    dO = dO[rows].view(N, J, _CHUNK, HV, V).permute(0, 3, 1, 2, 4).contiguous()
    if boundary is not None:
        _, _, seq_first, seq_chunks, _, _ = _kernel_chunks(B, T, opts.cu_seqlens, dev)
        states, dS_next = (_per_sequence(x, seq_first, seq_chunks, J) for x in boundary[:2])
        dS0 = boundary.dS0
    else:
        D = _transitions(loc)
        states = _state_scan(loc, D, S0)
        dS_next, dS0 = _state_grad_scan(loc, D, dO, dS)
    dqc, dkc, dvc, dgc, dbc = _chunk_local_backward(loc, dec, qc, kc, vc, bc, states, dO, dS_next)
    dg = tokens(dgc.sum(-1, keepdim=True))[..., 0] if scalar_gate else tokens(dgc)
    return tokens(dqc), tokens(dkc), tokens(dvc), dg, tokens(dbc[..., None])[..., 0], dS0


def _per_sequence(x: torch.Tensor, seq_first: torch.Tensor, seq_chunks: torch.Tensor, J: int) -> torch.Tensor:
    """Entries ``[C, HV, K, V]`` of the kernels' chunk layout (sequence n's chunks from
    ``seq_first[n]``) as ``[N, HV, J, K, V]`` fp32, zero for the chunks past a sequence's end (the
    padded chunks of the PyTorch path, whose gradients do not depend on them)."""
    j = torch.arange(J, device=x.device)
    valid = j[None] < seq_chunks[:, None].long()
    index = torch.where(valid, seq_first[:, None] + j[None], 0)
    out = x[index.reshape(-1)].view(*index.shape, *x.shape[1:]).float() * valid[..., None, None, None]
    return out.permute(0, 2, 1, 3, 4)


def _token_kernels_serve(q, k, v, g, beta, A_log, dt_bias) -> bool:
    """Whether the per-token CUDA kernels (``chunk_bwd_inputs`` / ``chunk_bwd_input_grads``) take the
    preprocessing and its gradients: CUDA inputs, the kernels' head dim, dtypes they read."""
    return (q.is_cuda and _ext.HAS_EXTENSION and q.shape[-1] == C.CHUNK_HEAD_DIM and v.shape[-1] == C.CHUNK_HEAD_DIM
            and q.dtype == k.dtype == v.dtype
            and all(t is None or t.dtype in _ext.KERNEL_DTYPES for t in (q, g, beta, A_log, dt_bias)))


def _rows_aligned(x: torch.Tensor) -> torch.Tensor:
    """``x`` as the per-token kernels read rows of 128 channels (16-byte aligned, strides of whole
    groups of four), else a contiguous copy."""
    ok = x.stride(-1) == 1 and all(s % 4 == 0 for s in x.stride()[:-1]) and x.data_ptr() % 16 == 0
    return x if ok else x.contiguous()


_side_streams: dict = {}


def _beside(device: torch.device, first, second):
    """``(first(), second())`` on CUDA ``device``: ``first`` on a second stream of high priority (its
    blocks are placed first) and ``second`` on the current one, both after the work queued so far;
    the current stream then waits for both. Tensors that ``first`` returns are marked used on the
    current stream (the caching allocator then keeps them until the work queued there is done).
    CUDA-graph capturable (the second stream forks from the current one and joins it)."""
    main = torch.cuda.current_stream(device)
    if device.index not in _side_streams:
        _side_streams[device.index] = torch.cuda.Stream(device=device, priority=-1)
    side = _side_streams[device.index]
    side.wait_stream(main)
    with torch.cuda.stream(side):
        a = first()
    b = second()
    main.wait_stream(side)
    for t in a:
        if isinstance(t, torch.Tensor):
            t.record_stream(main)
    return a, b


def _chunked_boundary_states(opts: ChunkOptions, flags, q, k, v, g, beta, gate_A, gate_dt, S0, dS, do,
                             records: Optional[ForwardRecords]):
    """``boundary_states(entries) -> Boundary`` (:func:`chunk_entries` entries) for
    :func:`_kernel_backward` on the chunked forward kernels (bf16 / fp16 inputs): the states at chunk
    starts that the forward kept with its ``records``, or, without them, those of the forward run
    again; then chunk_state_grad on the records (one op, ``flashkda::chunk_state_grad``; ``flags``:
    its scale, gate mode, lower bound, l2norm, beta sigmoid, allow_neg_eigval). None when those
    kernels do not take the inputs."""
    if q.dtype not in (torch.bfloat16, torch.float16) or not hasattr(_ext, "chunk_state_grad_op"):
        return None
    if _ext.chunk_smem_shortfall(q.get_device()) is not None:
        return None
    g, beta = _ext.chunk_gate_beta(g, beta)  # the arguments as the forward's op took them
    gate = [_ext.kernel_param(t) for t in (gate_A, gate_dt)]
    dO = torch.zeros_like(v) if do is None else do.to(v.dtype)
    cu = None if opts.cu_seqlens is None else opts.cu_seqlens.contiguous()

    def boundary_states(entries: int) -> Boundary:
        HV, K, V = v.shape[2], q.shape[3], v.shape[3]
        nexts = q.new_empty(entries, HV, K, V, dtype=_BOUNDARY_STATE_DTYPE)
        states = torch.empty_like(nexts) if records is None else records.states
        # On kept records the forward does not run again: no initial state to read.
        S0_in = S0.contiguous() if records is None else None
        dS0 = _ext.chunk_state_grad_op(q, k, v, g, beta, *gate, cu, S0_in, *flags, dO, dS.contiguous(),
                                       states, nexts, None if records is None else records.records)
        return Boundary(states, nexts, dS0)

    return boundary_states


def chunk_backward(opts: ChunkOptions, q, k, v, g, beta, A_log, dt_bias, initial_state, *, do, dht, needs_grad,
                   records: Optional[ForwardRecords] = None, gate_within: Optional[bool] = None):
    """Gradients ``(dq, dk, dv, dg, dbeta, dA_log, ddt_bias, dinitial_state)`` of a chunked prefill
    (None for an input that needs none), each in its input's shape and dtype, from the gradients
    ``do`` of ``o`` and ``dht`` of the final state (None: zero). The arguments are the call's raw
    inputs; ``needs_grad`` holds one flag each; ``records``: what the forward kept, if it ran on the
    chunked kernels; ``gate_within``: its gate check's answer, if it made one (:class:`GateCheck`).
    No autograd inside: every step is written out."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    f32 = torch.float32
    gate_A, gate_dt = (A_log, dt_bias) if opts.use_gate_in_kernel else (None, None)
    group = HV // H
    tokens = _token_kernels_serve(q, k, v, g, beta, gate_A, gate_dt)
    # Where one value head serves each key head and the gradients pass runs whole (not in value
    # halves), that pass takes q's and k's gradients through the scale and the l2 norm itself.
    qk_in_pass = tokens and group == 1 and not _ext.chunk_bwd_in_value_halves(q.device.index)
    # The kernels' options: scale, gate mode, lower bound, l2norm, beta sigmoid, allow_neg_eigval.
    flags = (opts.scale, C.gate_mode(opts.use_gate_in_kernel, opts.lower_bound),
             opts.lower_bound if opts.lower_bound is not None else 0.0, opts.use_qk_l2norm_in_kernel,
             opts.use_beta_sigmoid_in_kernel, opts.allow_neg_eigval)
    N = B if opts.cu_seqlens is None else opts.cu_seqlens.shape[0] - 1
    S0 = q.new_zeros(N, HV, K, V, dtype=f32)
    if initial_state is not None:
        S0 = (initial_state.transpose(-1, -2) if opts.state_v_first else initial_state).to(f32)
    dS = q.new_zeros(N, HV, K, V, dtype=f32)
    if dht is not None:
        dS = (dht.transpose(-1, -2) if opts.state_v_first else dht).to(f32)
    entries = chunk_entries(B, T, N, opts.cu_seqlens is not None)
    # The kernel path: the device and inputs, the gradients pass's shared memory, then the gate.
    device_why = _device_shortfall(q, V)
    pass_why = None if device_why else _ext.chunk_bwd_shortfall(q.device.index)
    gate_known = _gate_bounded(opts.use_gate_in_kernel, opts.lower_bound) or gate_within is not None
    boundary_states = boundary = None
    if tokens:  # one pass over the raw inputs on the GPU, q̂ and k̂ per value head
        g_rows = _rows_aligned(g) if g.dim() == 4 else _ext.last_dim_contiguous(g)
        raw = (_rows_aligned(q), _rows_aligned(k), v, g_rows, _ext.last_dim_contiguous(beta),
               None if gate_A is None else gate_A.contiguous(), None if gate_dt is None else gate_dt.contiguous())
        # Where the kernel path is known to serve before the per-token pass (the gate bounded, or
        # checked by the forward), the boundary states' walk starts first, on a second stream, and
        # the per-token pass runs beside it: the walk holds one block per (sequence, value head,
        # value block), which leaves SMs to spare.
        if (records is not None and entries and B * T and not device_why and not pass_why and gate_known
                and _gate_shortfall(opts, None, gate_within) is None):
            boundary_states = _chunked_boundary_states(opts, flags, q, k, v, g, beta, gate_A, gate_dt, S0, dS, do,
                                                       records)
        if boundary_states is not None:
            # The kernel path serves: a scalar gate's gradients pass with no group to sum takes the
            # raw q and k and normalises them itself, so this pass computes only ĝ and β̂.
            raw_in = qk_in_pass and g.dim() == 3 and q.dtype in (torch.bfloat16, torch.float16)
            boundary, (qp, kp, gp, bp, rnorm) = _beside(q.device, lambda: boundary_states(entries),
                                                        lambda: _ext.chunk_bwd_inputs_op(*raw, *flags, not raw_in))
            if raw_in:
                qp, kp, rnorm = raw[0], raw[1], None
        else:
            qp, kp, gp, bp, rnorm = _ext.chunk_bwd_inputs_op(*raw, *flags)
    else:
        qp, kp, gp, bp = preprocess(
            q, k, g, beta, scale=opts.scale, use_qk_l2norm_in_kernel=opts.use_qk_l2norm_in_kernel,
            use_gate_in_kernel=opts.use_gate_in_kernel, A_log=gate_A, dt_bias=gate_dt, lower_bound=opts.lower_bound,
            use_beta_sigmoid_in_kernel=opts.use_beta_sigmoid_in_kernel, allow_neg_eigval=opts.allow_neg_eigval,
            dtype=f32)
        if group > 1:
            qp, kp = qp.repeat_interleave(group, dim=2), kp.repeat_interleave(group, dim=2)
    # gp: [B, T, HV, K], or [B, T, HV] for a scalar gate (GDN), whose spans are then its head's and
    # whose gradient comes back summed over the key channels.
    gate_why = None if device_why else _gate_shortfall(opts, gp, gate_within)
    why = device_why or pass_why or gate_why
    # The states at chunk boundaries from the kernels (the forward's records, chunk_state_grad)
    # wherever the gate allows the bf16 path, also when only the gradients pass does not fit the
    # device (sm_80's shared memory): the PyTorch path then takes them instead of its scans.
    if boundary is None and entries and B * T and not device_why and not gate_why:
        boundary_states = _chunked_boundary_states(opts, flags, q, k, v, g, beta, gate_A, gate_dt, S0, dS, do,
                                                   records)
        boundary = None if boundary_states is None else boundary_states(entries)
    if why is None and boundary is None:  # the state maps then come from the transitions pass
        why = _ext.chunk_bwd_shortfall(q.device.index, transitions=True)
    # qk_in_pass: the gradients pass writes the raw q's and k's gradients, no per-token pass after it.
    raw_qk = None
    if why is None and qk_in_pass:
        raw_qk = (q.dtype, rnorm if opts.use_qk_l2norm_in_kernel else None)
    elif qp.dtype != f32:  # the raw q and k kept for a gradients pass that then did not serve
        qp, kp, _, _, rnorm = _ext.chunk_bwd_inputs_op(*raw, *flags)
    if why is None:
        # The per-token kernel's outputs are this backward's own: the gradients pass writes over them.
        dq, dk, dv, dgp, dbp, dS0 = _kernel_backward(opts, qp, kp, v, gp, bp, S0, dS, do, boundary, owned=tokens,
                                                     raw_qk=raw_qk)
        del qp, kp, gp, bp, boundary  # the gradients of the states after chunks go before the per-token pass
    else:
        _ext.log.debug("flashkda: chunked backward on PyTorch (%s%s)", why,
                       "; the states at chunk boundaries from the kernels" if boundary is not None else "")
        dq, dk, dv, dgp, dbp, dS0 = _torch_backward(opts, qp, kp, v, gp, bp, S0, dS, do, boundary)
    if tokens:
        dq_hat, dk_hat = (None, None) if raw_qk is not None else (dq.contiguous(), dk.contiguous())
        dq_in, dk_in, dg, dbeta, dA_part, ddt_part = _ext.chunk_bwd_input_grads_op(
            *raw, dq_hat, dk_hat, dgp.contiguous(), dbp.contiguous(), *flags)
        if raw_qk is None:
            dq, dk = dq_in, dk_in
        dA_log = None if gate_A is None else dA_part.sum(0).reshape(gate_A.shape)
        ddt_bias = None if gate_dt is None else ddt_part.sum(0).reshape(gate_dt.shape)
    else:
        if group > 1:  # GVA: the heads that share q and k add up
            dq, dk = (x.view(B, T, H, group, K).sum(3) for x in (dq, dk))
        dq, dk, dg, dbeta, dA_log, ddt_bias = _preprocess_grads(opts, q, k, g, beta, gate_A, gate_dt, dq, dk, dgp,
                                                                dbp)
    dh0 = None if initial_state is None else (dS0.transpose(-1, -2) if opts.state_v_first else dS0)
    found = (dq, dk, dv, dg, dbeta, dA_log, ddt_bias, dh0)
    return tuple(None if t is None or not n or gr is None else gr.to(t.dtype)
                 for t, n, gr in zip((q, k, v, g, beta, A_log, dt_bias, initial_state), needs_grad, found))
