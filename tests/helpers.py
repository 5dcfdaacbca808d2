"""Shared input builders and error measures for the tests."""

from __future__ import annotations

import math
from typing import Dict, Optional, Sequence

import torch

import flashkda
from flashkda import _ext

HAS_CUDA_KERNELS = torch.cuda.is_available() and _ext.HAS_EXTENSION

# Relative-error bounds (output, final state) of the chunked kernels against the fp64 oracle.
CHUNK_TOL = {torch.bfloat16: (6e-3, 5e-3), torch.float16: (3.5e-3, 2e-3)}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖ in fp64; NaN anywhere gives inf, so NaN never passes."""
    out, ref = out.double().cpu(), ref.double().cpu()
    if not torch.isfinite(out).all():
        return math.inf
    return float((out - ref).norm() / ref.norm().clamp_min(1e-300))


# Gate modes of the contract, as keyword arguments (A_log / dt_bias added by make_inputs).
GATES: Dict[str, dict] = {
    "lower_bound": dict(use_gate_in_kernel=True, lower_bound=-5.0),
    "softplus": dict(use_gate_in_kernel=True),
    "precomputed": dict(use_gate_in_kernel=False),
}


def make_inputs(
    *,
    B: int = 1,
    T: int = 16,
    H: int = 2,
    HV: Optional[int] = None,
    D: int = 32,
    lens: Optional[Sequence[int]] = None,
    gate: str = "lower_bound",
    gdn: bool = False,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    state: bool = True,
    state_v_first: bool = False,
    state_dtype: torch.dtype = torch.float32,
    mask_prob: float = 0.0,
    seed: Optional[int] = None,
) -> dict:
    """Fresh random inputs for one call of the contract's functions.

    ``lens`` gives varlen sequences (then B = 1 and T = sum(lens)). The precomputed gate is a log decay
    in [-3, 0] with a fraction ``mask_prob`` of entries set to -1e4 (mask-like).
    """
    gen = torch.Generator().manual_seed(seed if seed is not None else torch.randint(0, 2**31, ()).item())
    HV = HV or H
    if lens is not None:
        B, T = 1, sum(lens)

    def rnd(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=gen)).to(device)

    kw = dict(GATES[gate])
    g_shape = (B, T, HV) if gdn else (B, T, HV, D)
    if gate == "precomputed":
        g = -3 * torch.rand(*g_shape, generator=gen)
        if mask_prob:
            g = torch.where(torch.rand(*g_shape, generator=gen) < mask_prob, torch.full_like(g, -1e4), g)
        g = g.to(device)
    else:
        g = rnd(*g_shape, scale=2.0)
        kw["A_log"] = torch.rand(HV, generator=gen).to(device)
        kw["dt_bias"] = rnd(HV) if gdn else rnd(HV * D)
    out = dict(
        q=rnd(B, T, H, D).to(dtype), k=rnd(B, T, H, D).to(dtype), v=rnd(B, T, HV, D).to(dtype),
        g=g.to(dtype if dtype != torch.float64 else torch.float64) if gate == "precomputed" else g.to(dtype),
        beta=rnd(B, T, HV).to(dtype),
        use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True, state_v_first=state_v_first, **kw,
    )
    if gate == "precomputed":
        out["g"] = g.to(torch.float32 if dtype != torch.float64 else dtype)
    if lens is not None:
        out["cu_seqlens"] = torch.tensor([0, *torch.tensor(list(lens)).cumsum(0).tolist()], dtype=torch.int32,
                                         device=device)
    if state:
        N = len(lens) if lens is not None else B
        out["initial_state"] = (0.1 * torch.randn(N, HV, D, D, generator=gen)).to(device, state_dtype)
    return out


def as_fp64_cpu(kw: dict) -> dict:
    """The same call with every floating tensor upcast to fp64 on the CPU (the oracle's inputs)."""
    res = {}
    for name, x in kw.items():
        if isinstance(x, torch.Tensor):
            x = x.cpu()
            if x.is_floating_point():
                x = x.double()
        res[name] = x
    return res


def reference64(kw: dict, gdn: bool = False, **extra):
    """The fp64 recurrent oracle for a call described by ``kw`` (as built by make_inputs)."""
    from flashkda.reference import kda_reference

    return kda_reference(**as_fp64_cpu(kw), core="recurrent", **extra)


def public_fn(kind: str, gdn: bool):
    if kind == "chunk":
        return flashkda.chunk_gated_delta_rule if gdn else flashkda.chunk_kda
    return flashkda.fused_recurrent_gated_delta_rule if gdn else flashkda.fused_recurrent_kda


kernel_family = _ext.kernel_family


def fast_spy(monkeypatch, entry: str = "_fast") -> list:
    """Records the answers of an eager fast entry (``api._fast``: flashkda._C.fused_recurrent, or
    ``api._chunk_fast``: flashkda._C.chunk) to the calls made after this: a tuple when it launched,
    else the str saying why the call took the general path."""
    from flashkda import api

    answers = []
    real = {"_fast": _ext.fused_recurrent_fast, "_chunk_fast": _ext.chunk_fast}[entry]

    def spy(*args):
        answers.append(real(*args))
        return answers[-1]

    monkeypatch.setattr(api, entry, spy)
    return answers


#: Tensor inputs of the chunked functions in the order ChunkFunction takes them.
GRAD_INPUTS = ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "initial_state")


def grads64(kw: dict, do: torch.Tensor, dht: Optional[torch.Tensor]) -> list:
    """Gradients of the GRAD_INPUTS of a call described by ``kw`` (None for absent ones) from fp64
    autograd through the token-by-token recurrence, given the gradients of the output and of the
    final state (None: the output alone)."""
    from flashkda.reference import kda_reference

    kw64 = as_fp64_cpu(kw)
    leaves = [None if kw64.get(n) is None else kw64[n].requires_grad_() for n in GRAD_INPUTS]
    o, ht = kda_reference(**kw64, output_final_state=True, core="recurrent")
    outs, upstream = [o], [do.double().cpu()]
    if dht is not None:
        outs.append(ht)
        upstream.append(dht.double().cpu())
    found = iter(torch.autograd.grad(outs, [t for t in leaves if t is not None], upstream))
    return [None if t is None else next(found) for t in leaves]


def with_kernel_names(fn):
    """``(fn(), names)``: its result and the names of the CUDA kernels it launched (torch.profiler)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        out = fn()
        torch.cuda.synchronize()
    return out, [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def grads_of(fn, kw: dict, do: torch.Tensor, dht: Optional[torch.Tensor], **extra) -> list:
    """Gradients of the GRAD_INPUTS of ``fn(**kw, **extra)`` (which returns ``(o, final_state)``),
    each input a fresh leaf that requires grad."""
    leaves = [None if kw.get(n) is None else kw[n].detach().clone().requires_grad_() for n in GRAD_INPUTS]
    call = dict(kw, **{n: t for n, t in zip(GRAD_INPUTS, leaves) if t is not None})
    o, ht = fn(**call, **extra)
    outs, upstream = ([o, ht], [do, dht]) if dht is not None else ([o], [do])
    found = iter(torch.autograd.grad(outs, [t for t in leaves if t is not None], upstream))
    return [None if t is None else next(found) for t in leaves]
