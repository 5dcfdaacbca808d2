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

Under autograd the two prefills differentiate as any call does, and the exchange is one node
(:class:`_IncomingState`) whose backward is one all-reduce of every rank's gradient of every rank's
``(E, M)``: each rank's pair gets the gradients of the ranks that folded it. Every rank of a
training step must call with inputs that require grad (they all join that collective).

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


def _for_collective(t: torch.Tensor, group) -> torch.Tensor:
    """``t`` as a collective on ``group`` takes it: contiguous, and in host memory on a gloo group
    (which is for CPU tensors: ranks sharing one GPU, tests)."""
    return (t.cpu() if t.is_cuda and dist.get_backend(group) == "gloo" else t).contiguous()


def _gather(t: torch.Tensor, group) -> torch.Tensor:
    """Every rank's ``t``, stacked ``[world, ...]``, by one all-gather."""
    x = _for_collective(t, group)
    out = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, x, group=group)
    return torch.stack(out).to(t.device)


def _all_reduce(t: torch.Tensor, group) -> torch.Tensor:
    """``t`` summed over the ranks, by one all-reduce (in place where ``t`` is already what the
    collective takes)."""
    x = _for_collective(t, group)
    dist.all_reduce(x, group=group)
    return x.to(t.device)


def _fold(everyone: torch.Tensor, s0: int, rank: int, V: int) -> list:
    """The states ``[S_s0, ..., S_{rank-1}]`` that the first sequence's state takes after each of the
    ranks ``s0 .. rank-1`` from their ``(E | M)``: ``S_s0 = E_s0``, ``S_j = M_j S_{j-1} + E_j``."""
    states = [everyone[s0][..., :V]]
    for j in range(s0 + 1, rank):
        states.append(everyone[j][..., V:] @ states[-1] + everyone[j][..., :V])
    return states


def _add_incoming(o: torch.Tensor, through: torch.Tensor, S: torch.Tensor, first: int) -> torch.Tensor:
    """``o`` with ``Sᵀ Φ_tᵀ q_t`` added to its first ``first`` tokens, in place (fp32 sums)."""
    extra = torch.einsum("bthk,hkv->bthv", through[:, :first].float(), S)
    o[:, :first] = (o[:, :first].float() + extra).to(o.dtype)
    return o


class _IncomingState(torch.autograd.Function):
    """``o`` plus the incoming state's share of the rank's first sequence, under autograd: the
    all-gather of every rank's ``(E | M)``, the fold and the sum in the forward; in the backward, this
    rank's gradient of every rank's ``(E | M)`` (zero for those it did not fold), summed over the
    ranks by one all-reduce, so that each rank's ``(E | M)`` gets the gradients of the ranks after
    it. ``o`` requires grad on every rank of a training step, so every rank records this node and
    joins the backward's collective."""

    @staticmethod
    def forward(ctx, o, through, mine, group, first: int, pre: int, V: int):
        everyone = _gather(mine, group)
        rank = dist.get_rank(group)
        if pre > 0:  # o in place (no copy of a rank's outputs): its gradient passes through unchanged
            _add_incoming(o, through, _fold(everyone, rank - pre, rank, V)[-1], first)
        ctx.mark_dirty(o)
        ctx.save_for_backward(through if pre > 0 else None, everyone)
        ctx.group, ctx.first, ctx.pre, ctx.V, ctx.rank = group, first, pre, V, rank
        return o

    @staticmethod
    def backward(ctx, dout):
        through, everyone = ctx.saved_tensors
        first, V, rank = ctx.first, ctx.V, ctx.rank
        d_everyone = torch.zeros_like(everyone)
        dthrough = None
        if ctx.pre > 0:
            s0 = rank - ctx.pre
            states = _fold(everyone, s0, rank, V)
            d_first = dout[:, :first].float()
            through_first = through[:, :first].float()
            dS = torch.einsum("bthk,bthv->hkv", through_first, d_first)
            dthrough = torch.zeros_like(through)
            dthrough[:, :first] = torch.einsum("bthv,hkv->bthk", d_first, states[-1]).to(through.dtype)
            for j in range(rank - 1, s0, -1):  # back through S_j = M_j S_{j-1} + E_j
                d_everyone[j, ..., :V] += dS
                d_everyone[j, ..., V:] += dS @ states[j - 1 - s0].transpose(-1, -2)
                dS = everyone[j][..., V:].transpose(-1, -2) @ dS
            d_everyone[s0, ..., :V] += dS
        dmine = _all_reduce(d_everyone, ctx.group)[rank]
        return dout, dthrough, dmine, None, None, None, None


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
    if torch.is_grad_enabled() and o.requires_grad:  # training: every rank's o requires grad
        return _IncomingState.apply(o, through, mine, ctx.group, first, ctx.pre_num_ranks, V), None
    everyone = _gather(mine, ctx.group)
    # 4. The incoming state, folded over the ranks that hold the first sequence's start, and its share
    # of the first sequence's outputs.
    if needs_in:
        rank = dist.get_rank(ctx.group)
        _add_incoming(o, through, _fold(everyone, rank - ctx.pre_num_ranks, rank, V)[-1], first)
    return o, None
