"""Context parallelism: one packed batch of long sequences split across ranks of a process group.

Every rank holds an equal contiguous slice of the packed tokens (``T / world_size`` each), and a
sequence may straddle ranks. The recurrence's state is the only thing that crosses a rank boundary,
and a slice acts on the state it receives affinely: the state after the slice is ``M S + E``
(``M``, ``K x K`` per value head, the product of the slice's per-token maps
``(I − β k kᵀ) diag(e^g)``; ``E`` the state it leaves from a zero state), and each output is
``o_t = o⁰_t + Sᵀ Φ_tᵀ q_t`` (``o⁰`` the output from a zero state, ``Φ_t`` the map up to token t). So
each rank runs the prefill twice, both before any communication:

1. on all its tokens from zero states: ``o⁰``, and ``E`` of its last sequence;
2. from the identity with zero values on its first sequence's piece (whose outputs are
   ``Φ_tᵀ q_t``) and its last one's (whose final state is ``M``), packed into one call;

then one all-gather shares every rank's ``(E, M)`` (no chain of point-to-point messages), and a rank
whose first sequence began on an earlier rank folds the maps of the ranks in between (``S = E_s``,
then ``S = M_j S + E_j``) and adds ``Sᵀ Φ_tᵀ q_t`` to that sequence's outputs.

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
    """Every rank's ``t``, by one all-gather (through host memory on a gloo group, which is for CPU
    tensors: ranks sharing one GPU, tests)."""
    device = t.device
    if t.is_cuda and dist.get_backend(group) == "gloo":
        t = t.cpu()
    out = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, t.contiguous(), group=group)
    return [x.to(device) for x in out]


def chunk_with_context(fn, ctx, q, k, v, g, beta, *, state_v_first: bool = False, **kw):
    """``fn`` (``chunk_kda`` or ``chunk_gated_delta_rule``) on this rank's tokens under the context
    ``ctx`` (:class:`CPContext` or FLA's), returning ``(o, None)``; ``kw`` are ``fn``'s other
    arguments (without ``initial_state``, ``output_final_state``, ``cu_seqlens``). ``state_v_first``
    changes nothing here: no state goes in or out."""
    cu, cu_cpu = ctx.cu_seqlens, ctx.cu_seqlens_cpu
    if cu_cpu is None:
        cu_cpu = cu.cpu()
    if q.shape[0] != 1 or q.shape[1] != int(cu_cpu[-1]):
        raise ValueError(f"flashkda: under cp_context q must be [1, {int(cu_cpu[-1])}, H, K] (this rank's tokens "
                         f"per the context's cu_seqlens), got {list(q.shape)}")
    HV, V, K = v.shape[2], v.shape[3], q.shape[3]
    first = int(cu_cpu[1])  # this rank's first sequence: tokens [0, first)
    a = int(cu_cpu[-2])  # its last sequence: tokens [a, T)
    needs_in, needs_out = ctx.pre_num_ranks > 0, ctx.post_num_ranks > 0
    # 1. Every sequence from a zero state: the outputs without the incoming state, and E, the state
    # the last sequence leaves with.
    o, states = fn(q, k, v, g, beta, output_final_state=needs_out, state_v_first=False, cu_seqlens=cu,
                   cu_seqlens_cpu=cu_cpu, **kw)
    # 2. From the identity with zero values, over the first sequence's piece (its outputs are
    # Φ_tᵀ q_t, the part of o_t that the incoming state S multiplies: o_t += Sᵀ Φ_tᵀ q_t) and the last
    # one's (its final state is M): one call, the two pieces packed (one piece when they coincide).
    pieces = [(0, first)] if needs_in else []
    if needs_out and (a, q.shape[1]) not in pieces:
        pieces.append((a, q.shape[1]))
    M = through = None
    if pieces:
        cat = lambda x: torch.cat([x[:, lo:hi] for lo, hi in pieces], dim=1)  # noqa: E731
        lens = [hi - lo for lo, hi in pieces]
        cu_pieces = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
        eye = torch.eye(K, device=q.device).expand(len(pieces), HV, K, K).contiguous()
        through, ends = fn(cat(q), cat(k), v.new_zeros(1, sum(lens), HV, K), cat(g), cat(beta), initial_state=eye,
                           output_final_state=True, state_v_first=False, cu_seqlens=cu_pieces.to(q.device),
                           cu_seqlens_cpu=cu_pieces, **kw)
        M = ends[-1]
    # 3. One all-gather of every rank's (E | M) [HV, K, V + K] (zeros where the last sequence ends here).
    mine = torch.cat([states[-1], M], dim=-1) if needs_out else torch.zeros(HV, K, V + K, device=q.device)
    everyone = _gather(mine, ctx.group)
    # 4. The incoming state, folded over the ranks that hold the first sequence's start, and its share
    # of the first sequence's outputs.
    if needs_in:
        rank = dist.get_rank(ctx.group)
        s0 = rank - ctx.pre_num_ranks
        S = everyone[s0][..., :V]
        for j in range(s0 + 1, rank):
            S = everyone[j][..., V:] @ S + everyone[j][..., :V]
        extra = torch.einsum("bthk,hkv->bthv", through[:, :first].float(), S)
        o[:, :first] = (o[:, :first].float() + extra).to(o.dtype)
    return o, None
