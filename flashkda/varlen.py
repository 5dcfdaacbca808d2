"""Going between padded batches and packed varlen (``cu_seqlens``) inputs."""

from __future__ import annotations

from typing import Optional, Sequence, Tuple, Union

import torch

__all__ = ["pack", "unpack"]


def pack(
    x: Union[torch.Tensor, Sequence[torch.Tensor]], lengths: Optional[Union[torch.Tensor, Sequence[int]]] = None
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Pack sequences into one ``[1, sum(L), ...]`` tensor.

    Args:
        x: a list of ``[L_n, ...]`` tensors, or a padded ``[N, T_max, ...]`` tensor with ``lengths``.
        lengths: ``[N]`` valid lengths of the padded rows (ints or an int tensor); required with a padded
            tensor, not allowed with a list.

    Returns:
        ``(packed [1, sum(L), ...], cu_seqlens)``: int32 ``cu_seqlens`` ``[N+1]`` on the device of ``x``.
    """
    if isinstance(x, torch.Tensor):
        if lengths is None:
            raise ValueError("flashkda.varlen.pack: a padded tensor needs lengths")
        if x.dim() < 2:
            raise ValueError(f"flashkda.varlen.pack: a padded tensor must be [N, T_max, ...], got {list(x.shape)}")
        lens = [int(n) for n in (lengths.tolist() if isinstance(lengths, torch.Tensor) else lengths)]
        if len(lens) != x.shape[0]:
            raise ValueError(f"flashkda.varlen.pack: {len(lens)} lengths for {x.shape[0]} rows")
        if any(n < 0 or n > x.shape[1] for n in lens):
            raise ValueError(f"flashkda.varlen.pack: lengths must lie in [0, {x.shape[1]}], got {lens}")
        pieces = [x[i, :n] for i, n in enumerate(lens)]
        ref = x
    else:
        if lengths is not None:
            raise ValueError("flashkda.varlen.pack: lengths is only for a padded tensor")
        pieces = list(x)
        if not pieces:
            raise ValueError("flashkda.varlen.pack: no sequences")
        for i, p in enumerate(pieces):
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"flashkda.varlen.pack: x[{i}] must be a torch.Tensor, got {type(p).__name__}")
            if p.shape[1:] != pieces[0].shape[1:]:
                raise ValueError(f"flashkda.varlen.pack: x[{i}] has trailing shape {list(p.shape[1:])}, "
                                 f"expected {list(pieces[0].shape[1:])}")
        lens = [p.shape[0] for p in pieces]
        ref = pieces[0]
    cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lens, dtype=torch.int32).cumsum(0)
    packed = torch.cat(pieces, dim=0) if pieces else ref.new_empty((0, *ref.shape[2:]))
    return packed.unsqueeze(0), cu.to(ref.device)


def unpack(
    packed: torch.Tensor, cu_seqlens: torch.Tensor, padded: bool = False, max_len: Optional[int] = None
) -> Union[list, torch.Tensor]:
    """Split a packed ``[1, sum(L), ...]`` tensor back into sequences.

    Args:
        packed: ``[1, sum(L), ...]`` or ``[sum(L), ...]``.
        cu_seqlens: int ``[N+1]`` offsets.
        padded: return one zero-padded ``[N, max_len, ...]`` tensor instead of a list.
        max_len: padded length (default: the longest sequence).

    Returns:
        a list of ``[L_n, ...]`` views, or the padded tensor.
    """
    if packed.dim() >= 1 and packed.shape[0] == 1 and packed.dim() >= 2:
        packed = packed[0]
    bounds = cu_seqlens.tolist()
    if bounds[-1] != packed.shape[0]:
        raise ValueError(f"flashkda.varlen.unpack: cu_seqlens[-1] = {bounds[-1]} but packed has "
                         f"{packed.shape[0]} tokens")
    seqs = [packed[a:b] for a, b in zip(bounds, bounds[1:])]
    if not padded:
        return seqs
    width = max_len if max_len is not None else max((s.shape[0] for s in seqs), default=0)
    out = packed.new_zeros((len(seqs), width, *packed.shape[1:]))
    for i, s in enumerate(seqs):
        n = min(s.shape[0], width)
        out[i, :n] = s[:n]
    return out
