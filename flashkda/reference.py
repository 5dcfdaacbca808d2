"""PyTorch reference of the flashkda contract.

Two implementations of the same recurrence share one front end (preprocessing, GVA, varlen, state
layouts, the serving slot pool):

* ``core="chunk"`` — a chunked, vectorised form used as the fallback on every device. Within a chunk
  it only ever forms ``exp(Γ_i − Γ_j)`` for ``j ≤ i`` (each factor ≤ 1), never ``exp(−Γ)`` alone, so
  unbounded softplus gates and masks such as ``g = −1e4`` stay finite.
* ``core="recurrent"`` — the plain token-by-token recurrence, kept as the test oracle.

Computation runs in fp32, or fp64 when the inputs are fp64. These functions do not validate their
arguments (the public API in :mod:`flashkda.api` does) and, for varlen inputs, read ``cu_seqlens`` on
the host, so they synchronise with the device: they are a fallback and an oracle, not a hot path.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from flashkda import _constants as C

__all__ = ["preprocess", "kda_reference"]


def _compute_dtype(*tensors: Optional[torch.Tensor]) -> torch.dtype:
    if any(t is not None and t.dtype == torch.float64 for t in tensors):
        return torch.float64
    return torch.float32


def log_decay(g: torch.Tensor, *, use_gate_in_kernel: bool, A_log: Optional[torch.Tensor] = None,
              dt_bias: Optional[torch.Tensor] = None, lower_bound: Optional[float] = None,
              dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The natural-log decay of the contract from the gate ``g`` (``[B, T, HV, K]`` for KDA,
    ``[B, T, HV]`` for GDN), in ``dtype``: ``g`` itself when precomputed, else the gate function of
    ``g + dt_bias`` with ``a = e^{A_log}`` (``lower_bound · sigmoid(a x)`` or ``−a · softplus(x)``)."""
    g = g.to(dtype)
    if not use_gate_in_kernel:
        return g
    hv = g.shape[2]
    per_channel = g.dim() == 4
    if dt_bias is not None:
        g = g + dt_bias.to(dtype).reshape((hv, -1) if per_channel else (hv,))
    a = torch.ones(hv, dtype=dtype, device=g.device) if A_log is None else A_log.to(dtype).reshape(hv).exp()
    if per_channel:
        a = a[:, None]
    if lower_bound is not None:
        return lower_bound * torch.sigmoid(a * g)
    return -a * F.softplus(g, beta=1.0, threshold=C.SOFTPLUS_THRESHOLD)


def preprocess(
    q: torch.Tensor,
    k: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    A_log: Optional[torch.Tensor] = None,
    dt_bias: Optional[torch.Tensor] = None,
    lower_bound: Optional[float] = None,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    dtype: torch.dtype = torch.float32,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token preprocessing of the contract, in ``dtype``.

    Returns ``(q, k, g, beta)`` with q l2-normalised (optionally) and scaled, k l2-normalised
    (optionally), ``g`` the natural-log decay (``[B, T, HV, K]`` for KDA, ``[B, T, HV]`` for GDN) and
    beta after the optional sigmoid.
    """
    q, k, g, beta = q.to(dtype), k.to(dtype), g.to(dtype), beta.to(dtype)
    if use_qk_l2norm_in_kernel:
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + C.L2NORM_EPS)
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + C.L2NORM_EPS)
    q = q * scale
    g = log_decay(g, use_gate_in_kernel=use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound,
                  dtype=dtype)
    if use_beta_sigmoid_in_kernel:
        beta = torch.sigmoid(beta)
        if allow_neg_eigval:
            beta = beta * 2
    return q, k, g, beta


# ----------------------------------------------------------------------------------------------
# Cores. Shapes: q, k [B, T, HV, K]; v [B, T, HV, V]; g [B, T, HV, K]; beta [B, T, HV];
# S [B, HV, K, V] (key-first, compute dtype). Return (o [B, T, HV, V], S).
# ----------------------------------------------------------------------------------------------


def _recurrent_core(q, k, v, g, beta, S):
    o = torch.empty_like(v)
    for t in range(q.shape[1]):
        S = S * g[:, t].exp()[..., None]
        u = beta[:, t, :, None] * (v[:, t] - torch.einsum("bhkv,bhk->bhv", S, k[:, t]))
        S = S + k[:, t, :, :, None] * u[:, :, None, :]
        o[:, t] = torch.einsum("bhkv,bhk->bhv", S, q[:, t])
    return o, S


def _chunk_core(q, k, v, g, beta, S, chunk_size: int = C.REFERENCE_CHUNK):
    T = q.shape[1]
    o = torch.empty_like(v)
    for s in range(0, T, chunk_size):
        e = min(s + chunk_size, T)
        n = e - s
        qc, kc, vc, bc = q[:, s:e], k[:, s:e], v[:, s:e], beta[:, s:e]
        gam = g[:, s:e].cumsum(1)  # [B, n, HV, K]
        # exp(Γ_i − Γ_j) for j ≤ i only (≤ 1); the upper triangle is masked before exp.
        diff = gam[:, :, None] - gam[:, None, :]  # [B, i, j, HV, K]
        lower = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        decay = torch.where(lower[None, :, :, None, None], diff, float("-inf")).exp()
        a_kk = torch.einsum("bihk,bjhk,bijhk->bhij", kc, kc, decay).tril(-1)
        a_qk = torch.einsum("bihk,bjhk,bijhk->bhij", qc, kc, decay)
        eye = torch.eye(n, dtype=q.dtype, device=q.device)
        bh = bc.permute(0, 2, 1)  # [B, HV, n]
        lhs = eye + bh[..., None] * a_kk
        k_dec = kc * gam.exp()  # k_i ⊙ e^{Γ_i}, ≤ |k|
        rhs = bh[..., None] * (vc.permute(0, 2, 1, 3) - torch.einsum("bihk,bhkv->bhiv", k_dec, S))
        u = torch.linalg.solve_triangular(lhs, rhs, upper=False, unitriangular=True)  # [B, HV, n, V]
        q_dec = qc * gam.exp()
        o[:, s:e] = (torch.einsum("bihk,bhkv->bhiv", q_dec, S) + a_qk @ u).permute(0, 2, 1, 3)
        g_last = gam[:, -1]  # [B, HV, K]
        k_tail = kc * (g_last[:, None] - gam).exp()  # k_i ⊙ e^{Γ_C − Γ_i}
        S = S * g_last.exp()[..., None] + torch.einsum("bihk,bhiv->bhkv", k_tail, u)
    return o, S


_CORES = {"chunk": _chunk_core, "recurrent": _recurrent_core}


def _to_key_first(state: torch.Tensor, state_v_first: bool) -> torch.Tensor:
    return state.transpose(-1, -2) if state_v_first else state


def kda_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    lower_bound: Optional[float] = None,
    A_log: Optional[torch.Tensor] = None,
    dt_bias: Optional[torch.Tensor] = None,
    state_v_first: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None,
    ssm_state_indices: Optional[torch.Tensor] = None,
    num_accepted_tokens: Optional[torch.Tensor] = None,
    out: Optional[torch.Tensor] = None,
    core: str = "chunk",
    chunk_states: Optional[torch.Tensor] = None,
    chunk_state_slots: Optional[torch.Tensor] = None,
    has_initial_state: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Reference KDA (``g`` of shape ``[B, T, HV, K]``) or GDN (``g`` of shape ``[B, T, HV]``).

    Arguments follow :func:`flashkda.chunk_kda` / :func:`flashkda.fused_recurrent_kda`. With
    ``ssm_state_indices``, ``initial_state`` is the slot pool and is updated in place (in its own
    dtype); the pool is returned as the final state. Otherwise the final state is a new fp32 tensor
    (fp64 for fp64 inputs) in the requested layout.

    ``chunk_states`` (prefill only) receives the state before every chunk of CHUNK_STATE_TOKENS
    tokens of each sequence, in its own dtype and the requested layout: entry Σ_{m<n} ceil(len_m /
    64) + j of ``chunk_states`` viewed as ``[entries, HV, ...]`` (FLA's h), or with
    ``chunk_state_slots [N, cols]`` slot ``chunk_state_slots[n, j]`` of that pool (j < cols; a slot
    outside the pool skips). ``has_initial_state`` (bool ``[N]``, with ``[N]`` indices): ``False``
    starts that sequence from zeros instead of its slot.
    """
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    dtype = _compute_dtype(q, k, v, g, beta, initial_state)
    if scale is None:
        scale = K ** -0.5
    qp, kp, gp, bp = preprocess(
        q, k, g, beta, scale=scale, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        use_gate_in_kernel=use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias,
        lower_bound=lower_bound, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
        allow_neg_eigval=allow_neg_eigval, dtype=dtype,
    )
    if gp.dim() == 3:  # GDN: one decay per head, the same for every key channel
        gp = gp[..., None].expand(B, T, HV, K)
    group = HV // H
    if group > 1:
        qp = qp.repeat_interleave(group, dim=2)
        kp = kp.repeat_interleave(group, dim=2)
    vp = v.to(dtype)
    run = _CORES[core]

    if cu_seqlens is not None:
        bounds = cu_seqlens.tolist()
        seqs = [(0, bounds[i], bounds[i + 1]) for i in range(len(bounds) - 1)]
    else:
        seqs = [(b, 0, T) for b in range(B)]
    N = len(seqs)

    if out is not None:
        o = out.zero_()
    else:
        # A fresh zero tensor, not empty_like(v).zero_(): an output zeroed in place loses its
        # gradient under torch.compile (torch 2.11) when this runs inside an autograd.Function.
        o = torch.zeros_like(v)
    serving = ssm_state_indices is not None
    final = None
    if output_final_state and not serving:
        shape = (N, HV, V, K) if state_v_first else (N, HV, K, V)
        final = torch.empty(shape, dtype=torch.float64 if dtype == torch.float64 else torch.float32,
                            device=q.device)

    def load(slot: int, n: int) -> torch.Tensor:
        if initial_state is None or (has_initial_state is not None and not bool(has_initial_state[n])):
            return torch.zeros(1, HV, K, V, dtype=dtype, device=q.device)
        return _to_key_first(initial_state[slot], state_v_first).to(dtype)[None]

    def store(dst: torch.Tensor, slot: int, S: torch.Tensor) -> None:
        dst[slot] = _to_key_first(S[0], state_v_first).to(dst.dtype)

    pool = initial_state if serving else None
    num_slots = pool.shape[0] if serving else N
    idx = ssm_state_indices.tolist() if serving else list(range(N))
    accepted = num_accepted_tokens.tolist() if num_accepted_tokens is not None else None

    def valid(slot: int) -> bool:
        return 0 <= slot < num_slots

    if not serving or ssm_state_indices.dim() == 1:
        # One slot per sequence. Pieces that run in one go: the whole sequence, or its chunks when
        # their states are kept.
        step = C.CHUNK_STATE_TOKENS if chunk_states is not None else max(T, 1)
        if chunk_states is not None:
            entries = chunk_states.reshape(-1, *chunk_states.shape[-3:])
            slots = chunk_state_slots.tolist() if chunk_state_slots is not None else None
        first = 0  # first entry of sequence n: Σ_{m<n} ceil(len_m / 64)
        for n, (b, bos, eos) in enumerate(seqs):
            slot = idx[n]
            skipped = not valid(slot)  # a padding slot: zero output, nothing written (zeros in a dense h)
            S = torch.zeros(1, HV, K, V, dtype=dtype, device=q.device) if skipped else load(slot, n)
            for j, s0 in enumerate(range(bos, eos, step)):
                if chunk_states is not None:
                    dst = first + j if slots is None else (-1 if skipped or j >= len(slots[n]) else slots[n][j])
                    if 0 <= dst < entries.shape[0]:
                        store(entries, dst, S)
                if skipped:
                    continue
                sl = slice(s0, min(s0 + step, eos))
                on, S = run(qp[b:b + 1, sl], kp[b:b + 1, sl], vp[b:b + 1, sl], gp[b:b + 1, sl],
                            bp[b:b + 1, sl], S)
                o[b, sl] = on[0].to(o.dtype)
            first += -(-(eos - bos) // C.CHUNK_STATE_TOKENS)
            if not skipped and (serving or final is not None):
                store(pool if serving else final, slot, S)
        return o, pool if serving else final

    # One slot per token (speculative decoding).
    for n, (b, bos, eos) in enumerate(seqs):
        row = idx[n]
        read_col = accepted[n] - 1 if accepted is not None else 0
        if not (0 <= read_col < len(row)) or not valid(row[read_col]):
            continue
        S = load(row[read_col], n)
        for i in range(eos - bos):
            # A token whose slot is padding (or beyond the index row) is skipped: no update,
            # no write, zero output.
            if i >= len(row) or not valid(row[i]):
                continue
            t = bos + i
            on, S = run(qp[b:b + 1, t:t + 1], kp[b:b + 1, t:t + 1], vp[b:b + 1, t:t + 1],
                        gp[b:b + 1, t:t + 1], bp[b:b + 1, t:t + 1], S)
            o[b, t] = on[0, 0].to(o.dtype)
            store(pool, row[i], S)
    return o, pool
