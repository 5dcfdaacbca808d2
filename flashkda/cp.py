"""Context parallelism: one packed batch of long sequences split across ranks of a process group.

Every rank holds an equal contiguous slice of the packed tokens (``T / world_size`` each), and a
sequence may straddle ranks. The recurrence's state is the only thing that crosses a rank boundary,
and a slice acts on the state it receives affinely: for the sequence that leaves rank ``r``, the
state after rank ``r``'s tokens is ``M_r S + E_r``, where ``S`` is the state it entered with,
``M_r`` (``K x K`` per value head) the product of the slice's per-token maps
``(I − β k kᵀ) diag(e^g)``, and ``E_r`` the state the slice leaves from a zero state. So:

1. each rank computes ``(M_r, E_r)`` of its last sequence with the prefill itself over that
   sequence's piece: ``E_r`` from a zero state, ``M_r`` from the identity (``V = K`` columns) with
   zero values;
2. one all-gather shares every rank's maps (no chain of point-to-point messages);
3. a rank whose first sequence began on an earlier rank folds the maps of the ranks in between:
   ``S = E_s``, then ``S = M_j S + E_j``; and runs its prefill with that initial state.

:class:`CPContext` (built by :func:`build_context`) has the fields of FLA's ``FLACPContext``, and
FLA's own context works as well; FLA's restrictions hold: no ``initial_state``, no
``output_final_state``, ``cu_seqlens`` taken from the context, the token count divisible by the
number of ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

__all__ = ["CPContext", "build_context", "chunk_with_context"]


@dataclass
class CPContext:
    """This rank's share of a packed batch (the fields of FLA's ``FLACPContext`` that the prefill reads).

    ``cu_seqlens`` / ``cu_seqlens_cpu``: the pieces of sequences on this rank, as local offsets
    (int32, on the device of the global ``cu_seqlens`` / on the host); ``pre_num_ranks``: how many
    earlier ranks hold the start of this rank's first sequence; ``post_num_ranks``: how many later
    ranks its last sequence continues on; ``is_first_rank`` / ``is_last_rank``: whether those
    counts are zero.
    """

    group: Any
    cu_seqlens: torch.Tensor
    cu_seqlens_cpu: torch.Tensor
    pre_num_ranks: int
    post_num_ranks: int
    is_first_rank: bool
    is_last_rank: bool


def build_context(cu_seqlens: torch.Tensor, group: Optional[Any] = None,
                  cu_seqlens_cpu: Optional[torch.Tensor] = None) -> CPContext:
    """This rank's :class:`CPContext` for the global packed offsets ``cu_seqlens`` ``[N + 1]`` split
    over ``group`` (the default group when None). Reads the offsets on the host (``cu_seqlens_cpu``
    when given, else a copy of ``cu_seqlens``)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    host = (cu_seqlens_cpu if cu_seqlens_cpu is not None else cu_seqlens.cpu()).to(torch.long)
    total = int(host[-1])
    if total < world or total % world:
        raise ValueError(f"flashkda: context parallelism needs the token count ({total}) to be a positive "
                         f"multiple of the number of ranks ({world})")
    part = total // world
    start, end = part * rank, part * (rank + 1)
    first = int(torch.searchsorted(host[1:], start, side="right"))  # first sequence ending after start
    last = int(torch.searchsorted(host[:-1], end, side="left"))     # sequences starting before end
    local = (host[first:last + 1].clamp(start, end) - start).unique_consecutive().to(torch.int32)
    pre = rank - int(host[first]) // part
    post = (int(host[last]) - 1) // part - rank
    return CPContext(group=group, cu_seqlens=local.to(cu_seqlens.device), cu_seqlens_cpu=local,
                     pre_num_ranks=pre, post_num_ranks=post, is_first_rank=pre == 0, is_last_rank=post == 0)


def _gather(t: torch.Tensor, group) -> list:
    """Every rank's ``t``, by one all-gather."""
    out = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, t.contiguous(), group=group)
    return out


def chunk_with_context(fn, ctx, q, k, v, g, beta, *, state_v_first: bool = False, **kw):
    """``fn`` (``chunk_kda`` or ``chunk_gated_delta_rule``) on this rank's tokens under the context
    ``ctx`` (:class:`CPContext` or FLA's), returning ``(o, None)``; ``kw`` are ``fn``'s other
    arguments (without ``initial_state``, ``output_final_state``, ``cu_seqlens``)."""
    cu, cu_cpu = ctx.cu_seqlens, ctx.cu_seqlens_cpu
    if cu_cpu is None:
        cu_cpu = cu.cpu()
    if q.shape[0] != 1 or q.shape[1] != int(cu_cpu[-1]):
        raise ValueError(f"flashkda: under cp_context q must be [1, {int(cu_cpu[-1])}, H, K] (this rank's tokens "
                         f"per the context's cu_seqlens), got {list(q.shape)}")
    HV, V, K = v.shape[2], v.shape[3], q.shape[3]
    N = cu_cpu.numel() - 1
    # 1. (M, E) of the last sequence's piece: E from a zero state, M from the identity with zero values
    # (two passes with the state's own shape when K == V, which the chunked kernels take).
    a, b = int(cu_cpu[-2]), int(cu_cpu[-1])
    pq, pk, pg, pb = (x[:, a:b] for x in (q, k, g, beta))
    _, E = fn(pq, pk, v[:, a:b], pg, pb, output_final_state=True, state_v_first=False, **kw)
    eye = torch.eye(K, device=q.device).expand(1, HV, K, K).contiguous()
    _, M = fn(pq, pk, v.new_zeros(1, b - a, HV, K), pg, pb, initial_state=eye, output_final_state=True,
              state_v_first=False, **kw)
    # 2. Every rank's maps; 3. fold those of the ranks that hold the start of this rank's first sequence.
    everyone = _gather(torch.cat([E[0], M[0]], dim=-1), ctx.group)  # [HV, K, V + K] each: E | M
    rank = dist.get_rank(ctx.group)
    init = None
    if ctx.pre_num_ranks > 0:
        s0 = rank - ctx.pre_num_ranks
        S = everyone[s0][..., :V]
        for j in range(s0 + 1, rank):
            S = everyone[j][..., V:] @ S + everyone[j][..., :V]
        init = torch.zeros(N, HV, K, V, device=q.device)
        init[0] = S
        if state_v_first:
            init = init.transpose(-1, -2).contiguous()
    o, _ = fn(q, k, v, g, beta, initial_state=init, output_final_state=False, state_v_first=state_v_first,
              cu_seqlens=cu, cu_seqlens_cpu=cu_cpu, **kw)
    return o, None
