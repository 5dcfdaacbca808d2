"""Gradients of the chunked prefill (``chunk_kda`` / ``chunk_gated_delta_rule``) under autograd.

A call that the CUDA kernels serve records :class:`ChunkFunction`: its forward is the kernels'
forward and saves only the inputs; its backward (:func:`chunk_backward`) recomputes what it needs
in fp32 and returns the gradients of every input that requires grad, FLA's gradients with FLA's
semantics (raw gate, ``A_log`` and ``dt_bias`` in their own shapes, raw ``beta`` through the
sigmoid, the l2 norm, GVA sums, the initial state in its own layout and dtype).

The backward splits the recurrence at 64-token chunks (the layout of the kernels'
``return_intermediate_states``):

1. per-token preprocessing of the raw inputs under autograd (:func:`flashkda.reference.preprocess`);
2. every chunk's local quantities at once, under autograd (:func:`_chunk_local`): cumulative log
   decay ``Γ``, the decayed Gram matrices ``M = tril(q kᵀ ⊙ e^{Γi−Γj})`` and
   ``A = diag(β) strict_tril(k kᵀ ⊙ e^{Γi−Γj})``, ``T = (I + A)⁻¹ diag(β)``, ``w = T (k e^Γ)``,
   ``u = T v``, ``q e^Γ``, ``k e^{Γ_C−Γ}`` and the chunk decay ``e^{Γ_C}``;
3. the states at chunk starts by a scan over chunks without autograd,
   ``S' = e^{Γ_C} ⊙ S + (k e^{Γ_C−Γ})ᵀ (u − w S)``;
4. the state gradients by the reverse scan, from the final state's gradient:
   ``dU = Mᵀ dO + (k e^{Γ_C−Γ}) dS'``, ``dS = e^{Γ_C} ⊙ dS' + (q e^Γ)ᵀ dO − wᵀ dU``; the first is the
   initial state's gradient;
5. each chunk's output ``O = (q e^Γ) S + M (u − w S)`` and next state, with the states as constants,
   under autograd, differentiated with ``dO`` and the next state's gradient from step 4: the only
   coupling between chunks is the state, so this gives every input's gradient.

Within a chunk only ``e^{Γi−Γj}`` for ``j <= i`` is formed, each factor at most 1 (see
:func:`_decayed_grams`): unbounded softplus gates and masks such as ``g = -1e4`` stay finite in the
gradients too. Varlen batches are laid out as ``[N, chunks]`` of their longest sequence; padded
tokens have zero ``q, k, v, beta`` and a zero log decay, so padded chunks pass the state through.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

import torch

from flashkda import _constants as C
from flashkda.reference import preprocess

__all__ = ["ChunkFunction", "ChunkOptions", "chunk_backward"]

_CHUNK = C.CHUNK_STATE_TOKENS
#: Diagonal blocks of the decayed Gram matrices: with pairwise decays formed elementwise
#: ([..., 16, 16, K]), and with pivoted factors (8 tokens, ``x e^{γ−h}`` and ``k e^{h−γ}``, h the
#: block's half decay) when every block's decay spans at most _PIVOT_SPAN in log space.
_EXACT_BLOCK, _PIVOT_BLOCK = 16, 8
#: Largest |log decay| over a pivoted block: factors up to e^{32}, products up to e^{64} (fp32
#: reaches e^{88}). The lower-bound gate (at least -5 a token) always stays within it.
_PIVOT_SPAN = 64.0


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

    ``forward(ctx, run, options, q, k, v, g, beta, A_log, dt_bias, initial_state)``: ``run()`` computes
    ``(o, final_state or None)`` from those tensors without autograd (the CUDA kernels);
    ``options`` is a :class:`ChunkOptions`.
    """

    @staticmethod
    def forward(ctx, run, options: ChunkOptions, q, k, v, g, beta, A_log, dt_bias, initial_state):
        o, ht = run()
        ctx.options = options
        ctx.save_for_backward(q, k, v, g, beta, A_log, dt_bias, initial_state)
        ctx.set_materialize_grads(False)
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        needs = ctx.needs_input_grad[2:]
        grads = chunk_backward(ctx.options, *ctx.saved_tensors, do=do, dht=dht, needs_grad=needs)
        return (None, None, *grads)


def _chunk_rows(B: int, T: int, cu_seqlens, cu_seqlens_cpu, device) -> Tuple[torch.Tensor, int, int]:
    """``(rows [N, J * 64], N, J)``: the token row (of the ``B * T`` flattened tokens) at each position
    of each sequence's chunks, ``B * T`` (a zero row) past the sequence's end; ``J`` is the longest
    sequence's chunk count. Reads ``cu_seqlens`` on the host (from ``cu_seqlens_cpu`` when given)."""
    if cu_seqlens is None:
        J = -(-T // _CHUNK)
        pos = torch.arange(J * _CHUNK, device=device)
        rows = torch.arange(B, device=device)[:, None] * T + pos[None]
        return torch.where(pos[None] < T, rows, B * T), B, J
    host = (cu_seqlens_cpu if cu_seqlens_cpu is not None else cu_seqlens).tolist()
    N = len(host) - 1
    J = max((-(-(b - a) // _CHUNK) for a, b in zip(host, host[1:])), default=0)
    starts = torch.tensor(host[:-1], dtype=torch.long, device=device)
    lens = torch.tensor([b - a for a, b in zip(host, host[1:])], dtype=torch.long, device=device)
    pos = torch.arange(J * _CHUNK, device=device)
    return torch.where(pos[None] < lens[:, None], starts[:, None] + pos[None], T), N, J


def _exclusive_suffix_sums(g: torch.Tensor) -> torch.Tensor:
    """``Σ_{t > i} g_t`` along dim -2, summing only those terms (no difference of long sums, which
    would lose the small terms beside a ``-1e4`` mask)."""
    s = g.flip(-2).cumsum(-2).flip(-2)
    return torch.cat([s[..., 1:, :], torch.zeros_like(s[..., :1, :])], dim=-2)


def _decayed_grams(q: torch.Tensor, k: torch.Tensor, g: torch.Tensor, pivot: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(M, A)`` of chunks ``[..., C, K]`` with per-token log decays ``g``:
    ``M_ij = Σ_c q_ic k_jc e^{Γ_ic − Γ_jc}`` for ``j <= i``, ``A_ij`` the same with ``k`` for rows and
    ``j < i``, zero elsewhere; ``Γ_i − Γ_j = Σ_{j < t <= i} g_t``.

    A block below the diagonal (rows after block b, columns in b) is the product of
    ``x e^{Σ_{r<t<=i} g_t}`` and ``k e^{Σ_{j<t<=r} g_t}``, ``r`` block b's last token: both factors at
    most 1 for log decays ``<= 0``. Diagonal blocks: with ``pivot`` (every block's decay within
    _PIVOT_SPAN) the product of ``x e^{γ−h}`` and ``k e^{h−γ}`` (γ the decay from the block start, h
    half the block's), masked after; otherwise the pairwise decay sums formed directly, the upper
    triangle masked before the exponential (any gate, ``-1e4`` masks included).
    """
    *lead, Cn, K = q.shape
    bs = _PIVOT_BLOCK if pivot else _EXACT_BLOCK
    nb = Cn // bs
    qb, kb, gb = (x.reshape(*lead, nb, bs, K) for x in (q, k, g))
    lower = torch.ones(bs, bs, dtype=torch.bool, device=q.device).tril()
    strict = torch.ones(bs, bs, dtype=torch.bool, device=q.device).tril(-1)
    if pivot:
        gamma = gb.cumsum(-2)
        half = gamma[..., -1:, :] * 0.5
        col = kb * (half - gamma).exp()
        m_diag = ((qb * (gamma - half).exp()) @ col.transpose(-1, -2)).masked_fill(~lower, 0.0)
        a_diag = ((kb * (gamma - half).exp()) @ col.transpose(-1, -2)).masked_fill(~strict, 0.0)
    else:
        # [..., nb, i, j, K]: Σ_{j < t <= i} g_t, then e^{...} below the diagonal, 0 above it
        spans = torch.where(strict[:, :, None], gb[..., :, None, :], 0.0).cumsum(-3)
        kd = kb[..., None, :, :] * torch.where(lower[:, :, None], spans, float("-inf")).exp()
        m_diag = (qb[..., :, None, :] * kd).sum(-1)
        a_diag = (kb[..., :, None, :] * kd).sum(-1).masked_fill(~strict, 0.0)
    M = q.new_zeros(*lead, Cn, Cn)
    A = q.new_zeros(*lead, Cn, Cn)
    col_factor = _exclusive_suffix_sums(gb).exp().reshape(*lead, Cn, K)  # e^{Σ_{j<t<=r}} within j's block
    for b in range(nb):
        cols = slice(b * bs, (b + 1) * bs)
        M[..., cols, cols] = m_diag[..., b, :, :]
        A[..., cols, cols] = a_diag[..., b, :, :]
        if b + 1 == nb:
            break
        rows = slice((b + 1) * bs, Cn)
        row_factor = g[..., rows, :].cumsum(-2).exp()
        col = k[..., cols, :] * col_factor[..., cols, :]
        M[..., rows, cols] = (q[..., rows, :] * row_factor) @ col.transpose(-1, -2)
        A[..., rows, cols] = (k[..., rows, :] * row_factor) @ col.transpose(-1, -2)
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


def _chunk_local(q, k, v, g, beta, pivot: bool) -> _Local:
    """Every chunk's local quantities from preprocessed ``q, k, g [.., C, K]``, ``v [.., C, V]``,
    ``beta [.., C]`` (fp32); ``pivot``: see :func:`_decayed_grams`."""
    M, A = _decayed_grams(q, k, g, pivot)
    eye = torch.eye(q.shape[-2], dtype=q.dtype, device=q.device)
    # (I + diag(β) A)⁻¹ by a unit lower-triangular solve (A is strictly lower).
    L = torch.linalg.solve_triangular(beta[..., :, None] * A, eye.expand_as(A), upper=False, unitriangular=True)
    T = L * beta[..., None, :]
    eG = g.cumsum(-2).exp()
    kg = k * eG
    return _Local(qg=q * eG, kd=k * _exclusive_suffix_sums(g).exp(), w=T @ kg, u=T @ v, M=M, decay=eG[..., -1, :],
                  kg=kg, A=A, L=L, T=T)


def _exclusive_prefix_sums(x: torch.Tensor) -> torch.Tensor:
    """``Σ_{i < t} x_i`` along dim -2."""
    return torch.cat([torch.zeros_like(x[..., :1, :]), x[..., :-1, :].cumsum(-2)], dim=-2)


def _suffix_sums(x: torch.Tensor) -> torch.Tensor:
    """``Σ_{i >= t} x_i`` along dim -2."""
    return x.flip(-2).cumsum(-2).flip(-2)


def _gram_grads(dZ: torch.Tensor, x: torch.Tensor, y: torch.Tensor, g: torch.Tensor, pivot: bool):
    """For ``Z_ij = Σ_c x_ic y_jc e^{Σ_{j<t<=i} g_tc}`` (``j <= i``) and its gradient ``dZ`` (zero where
    Z is not defined): ``(dx, dy, dg)``, in the blocks of :func:`_decayed_grams`. Each block's
    gradient in ``g`` follows the sums that block's factors are made of (a token's log decay gets the
    terms of the pairs it lies between), never differences of whole-chunk sums: those cancel, and
    lose the small gradients of strongly decayed chunks."""
    *lead, Cn, K = x.shape
    bs = _PIVOT_BLOCK if pivot else _EXACT_BLOCK
    nb = Cn // bs
    xb, yb, gb = (t.reshape(*lead, nb, bs, K) for t in (x, y, g))
    dZd = torch.stack([dZ[..., b * bs:(b + 1) * bs, b * bs:(b + 1) * bs] for b in range(nb)], dim=-3)
    if pivot:  # X = x e^{γ−h}, Y = y e^{h−γ}: γ the decay from the block start, h half the block's
        gamma = gb.cumsum(-2)
        half = gamma[..., -1:, :] * 0.5
        X, Y = xb * (gamma - half).exp(), yb * (half - gamma).exp()
        dX, dY = dZd @ Y, dZd.transpose(-1, -2) @ X
        dx, dy = dX * (gamma - half).exp(), dY * (half - gamma).exp()
        dgamma = dX * X - dY * Y
        dg = _suffix_sums(dgamma) - 0.5 * dgamma.sum(-2, keepdim=True)
    else:  # W_ij = dZ_ij x_i y_j e^{Σ_{j<t<=i} g}; g_t gets Σ_{i >= t > j} W_ij
        lower = torch.ones(bs, bs, dtype=torch.bool, device=x.device).tril()
        strict = torch.ones(bs, bs, dtype=torch.bool, device=x.device).tril(-1)
        spans = torch.where(strict[:, :, None], gb[..., :, None, :], 0.0).cumsum(-3)
        weight = dZd[..., None] * torch.where(lower[:, :, None], spans, float("-inf")).exp()  # [.., nb, i, j, K]
        dx = (weight * yb[..., None, :, :]).sum(-2)
        dy = (weight * xb[..., :, None, :]).sum(-3)
        pair = weight * xb[..., :, None, :] * yb[..., None, :, :]
        dg = (pair.flip(-3).cumsum(-3).flip(-3) * strict[:, :, None]).sum(-2)  # row t: Σ_{i>=t} Σ_{j<t}
    dx, dy, dg = (t.reshape(*lead, Cn, K) for t in (dx, dy, dg))
    col_factor = _exclusive_suffix_sums(gb).exp().reshape(*lead, Cn, K)  # e^{Σ_{j<t<=r}} within j's block
    for b in range(nb - 1):
        rows, cols = slice((b + 1) * bs, Cn), slice(b * bs, (b + 1) * bs)
        row_factor = g[..., rows, :].cumsum(-2).exp()  # e^{Σ_{r<t<=i}}, r block b's last token
        X, Y = x[..., rows, :] * row_factor, y[..., cols, :] * col_factor[..., cols, :]
        block = dZ[..., rows, cols]
        dX, dY = block @ Y, block.transpose(-1, -2) @ X
        dx[..., rows, :] += dX * row_factor
        dy[..., cols, :] += dY * col_factor[..., cols, :]
        dg[..., rows, :] += _suffix_sums(dX * X)
        dg[..., cols, :] += _exclusive_prefix_sums(dY * Y)
    return dx, dy, dg


def _chunk_local_backward(loc: _Local, q, k, v, g, beta, S, dO, dS_next, pivot: bool):
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
    dqM, dkM, dgM = _gram_grads(dM, q, k, g, pivot)
    dkAr, dkAc, dgA = _gram_grads(dA * beta[..., :, None], k, k, g, pivot)
    eG = g.cumsum(-2).exp()
    dq = dqM + dqg * eG
    dk = dkM + dkAr + dkAc + dkg * eG + dkd * _exclusive_suffix_sums(g).exp()
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
    if J == 0:
        return dS.new_empty(N, HV, 0, K, V), dS
    Y = ((loc.qg - loc.M @ loc.w).transpose(-1, -2) @ dO).permute(2, 0, 1, 3, 4).reshape(J, N * HV, K, V)
    Dt = D.transpose(-1, -2)
    nexts = dS.new_empty(J, N * HV, K, V)
    nexts[J - 1] = dS.reshape(N * HV, K, V)
    for j in range(J - 1, 0, -1):
        torch.baddbmm(Y[j], Dt[j], nexts[j], out=nexts[j - 1])
    dS0 = torch.baddbmm(Y[0], Dt[0], nexts[0]).view(N, HV, K, V)
    return nexts.view(J, N, HV, K, V).permute(1, 2, 0, 3, 4), dS0


def chunk_backward(opts: ChunkOptions, q, k, v, g, beta, A_log, dt_bias, initial_state, *, do, dht, needs_grad):
    """Gradients ``(dq, dk, dv, dg, dbeta, dA_log, ddt_bias, dinitial_state)`` of a chunked prefill
    (None for an input that needs none), from the gradients ``do`` of ``o`` and ``dht`` of the final
    state (None: zero). The arguments are the call's raw inputs; ``needs_grad`` holds one flag each."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    f32 = torch.float32
    dev = q.device
    rows, N, J = _chunk_rows(B, T, opts.cu_seqlens, opts.cu_seqlens_cpu, dev)
    raw = (q, k, v, g, beta, A_log, dt_bias)
    with torch.enable_grad():
        leaves = [None if t is None else t.detach().requires_grad_(bool(n)) for t, n in zip(raw, needs_grad)]
        ql, kl, vl, gl, bl, al, dl = leaves
        qp, kp, gp, bp = preprocess(
            ql, kl, gl, bl, scale=opts.scale, use_qk_l2norm_in_kernel=opts.use_qk_l2norm_in_kernel,
            use_gate_in_kernel=opts.use_gate_in_kernel, A_log=al, dt_bias=dl, lower_bound=opts.lower_bound,
            use_beta_sigmoid_in_kernel=opts.use_beta_sigmoid_in_kernel, allow_neg_eigval=opts.allow_neg_eigval,
            dtype=f32)
        if gp.dim() == 3:  # GDN: one decay per head for every key channel
            gp = gp[..., None].expand(B, T, HV, K)
        if HV != H:
            qp, kp = qp.repeat_interleave(HV // H, dim=2), kp.repeat_interleave(HV // H, dim=2)

        def chunks(x: torch.Tensor) -> torch.Tensor:
            """[B, T, HV, D] -> [N, HV, J, C, D], zero past each sequence's end; contiguous, so that
            the elementwise work on it runs vectorized."""
            flat = x.reshape(B * T, HV, x.shape[-1])
            flat = torch.cat([flat, flat.new_zeros(1, HV, flat.shape[-1])])
            return flat[rows].view(N, J, _CHUNK, HV, flat.shape[-1]).permute(0, 3, 1, 2, 4).contiguous()

        chunked = (chunks(qp), chunks(kp), chunks(vl.to(f32)), chunks(gp), chunks(bp[..., None])[..., 0])
    with torch.no_grad():
        qc, kc, vc, gc, bc = (t.detach() for t in chunked)
        pivot = _pivot_safe(gc, opts.use_gate_in_kernel and opts.lower_bound is not None)
        loc = _chunk_local(qc, kc, vc, gc, bc, pivot)
        S0 = q.new_zeros(N, HV, K, V, dtype=f32)
        if initial_state is not None:
            S0 = (initial_state.transpose(-1, -2) if opts.state_v_first else initial_state).to(f32)
        D = _transitions(loc)
        states = _state_scan(loc, D, S0)
        dS = q.new_zeros(N, HV, K, V, dtype=f32)
        if dht is not None:
            dS = (dht.transpose(-1, -2) if opts.state_v_first else dht).to(f32)
        dO = torch.zeros(B * T + 1, HV, V, dtype=f32, device=dev)
        if do is not None:
            dO[:-1] = do.reshape(B * T, HV, V)
        dO = dO[rows].view(N, J, _CHUNK, HV, V).permute(0, 3, 1, 2, 4).contiguous()
        dS_next, dS0 = _state_grad_scan(loc, D, dO, dS)
        local_grads = _chunk_local_backward(loc, qc, kc, vc, gc, bc, states, dO, dS_next, pivot)

    # The preprocessing (l2 norm, gate, beta sigmoid, GVA, the chunk layout) by autograd.
    wanted = [t for t in leaves if t is not None and t.requires_grad]
    grads = {}
    pairs = [(t, gr) for t, gr in zip(chunked, local_grads) if t.requires_grad]
    if wanted and pairs:
        found = torch.autograd.grad([t for t, _ in pairs], wanted, [gr for _, gr in pairs], allow_unused=True)
        grads = {id(t): gr for t, gr in zip(wanted, found)}
    out = [None if t is None or not t.requires_grad else
           (grads.get(id(t)) if grads.get(id(t)) is not None else torch.zeros_like(t)) for t in leaves]
    dh0 = None
    if initial_state is not None and needs_grad[7]:
        dh0 = (dS0.transpose(-1, -2) if opts.state_v_first else dS0).to(initial_state.dtype)
    return (*out, dh0)
