"""``python -m flashkda``: say whether the CUDA extension is built and which kernels serve on each
visible GPU, then run a small KDA workload (prefill, then decode from a slot pool) on CUDA when
present, else on the CPU reference, check it against the fp64 recurrence and print a table."""

from __future__ import annotations

import argparse
import sys
import time

import torch

import flashkda
from flashkda import _ext
from flashkda.reference import kda_reference


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _timed(fn, device: torch.device, repeats: int):
    fn()  # warm-up
    if device.type == "cuda":
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(repeats):
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
    else:
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    return times[len(times) // 2]


def describe() -> list:
    """Lines saying whether the CUDA extension is built and what would serve prefill and decode on
    each visible GPU (or that the reference serves everything)."""
    lines = [f"flashkda {flashkda.__version__}, torch {torch.__version__}"]
    if _ext.HAS_EXTENSION:
        lines.append(f"CUDA extension: built ({_ext._C.__file__})")
    else:
        lines.append(f"CUDA extension: not built ({_ext.EXTENSION_ERROR}); every call runs the PyTorch reference")
    if _ext.config.force_reference:
        lines.append("FLASHKDA_FORCE_REFERENCE=1: every call runs the PyTorch reference")
    if not torch.cuda.is_available():
        lines.append("GPU: none visible; every call runs the PyTorch reference")
        return lines
    for index in range(torch.cuda.device_count()):
        name, cc = torch.cuda.get_device_name(index), torch.cuda.get_device_capability(index)
        head = f"GPU {index}: {name} (compute capability {cc[0]}.{cc[1]})"
        if not _ext.HAS_EXTENSION:
            lines.append(f"{head}: the PyTorch reference (no extension)")
            continue
        reason = _ext.device_shortfall(index)
        if reason is not None:
            lines.append(f"{head}: the PyTorch reference ({reason})")
            continue
        family = _ext.config.kernel_family
        smem = _ext.chunk_smem_shortfall(index)
        if smem is not None:
            prefill = f"the token-by-token kernel ({smem})"
        else:
            prefill = ("the chunked kernels (chunk_prepare + chunk_recurrence) for K = V = 128 with bf16 / fp16 "
                       "inputs, the token-by-token kernel for K = V = 64 or fp32 inputs")
            if family != "sm80" and cc >= (9, 0):
                prefill += "; the recurrence on wgmma with bulk copies where the build has sm_90a code"
        if family == "sm80":
            decode = "the token-by-token kernel (FLASHKDA_KERNEL_FAMILY=sm80)"
        else:
            decode = ("V-first K = V = 128 pools: the streaming kernels (fp32 pools; bf16 pools with one token per "
                      "sequence)" + (", the bulk-copy kernel (other bf16 pools)" if cc >= (9, 0) else "") +
                      "; the token-by-token kernel otherwise")
        bwd_short = _ext.chunk_bwd_shortfall(index)
        whole_short = _ext.chunk_bwd_shortfall(index, transitions=True)  # the whole per-chunk pass's block
        per_chunk = ("chunk_local_grad in value halves per chunk" if _ext.chunk_bwd_in_value_halves(index)
                     else "chunk_local_grad per chunk")
        fp32 = ("chunk_state_scan for fp32 inputs" if whole_short is None
                else f"fp32 inputs on a PyTorch backward ({whole_short})")
        backward = (f"the backward's kernels (the forward's and chunk_state_grad for the states at chunk boundaries, "
                    f"{fp32}, {per_chunk}) for K = V = 128 and gates whose "
                    "log decay over 16 tokens stays within their span, a PyTorch backward otherwise"
                    if bwd_short is None else f"a PyTorch backward ({bwd_short})")
        backward += "; the per-token preprocessing and its gradients on chunk_bwd_tokens (K = V = 128)"
        lines.append(f"{head}, kernel family {family}:")
        lines += [f"  prefill: {prefill}", f"  decode: {decode}", f"  training: the kernels' forward; {backward}",
                  "  other head sizes, float64: the PyTorch reference"]
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m flashkda", description=__doc__)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    help="where the workload runs: 'cuda' (default when a GPU is visible), 'cuda:N' or 'cpu'")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default 0)")
    ap.add_argument("--info", action="store_true",
                    help="only say whether the extension is built and which kernels serve on each GPU")
    args = ap.parse_args(argv)
    print("\n".join(describe()))
    if args.info:
        return 0
    dev = torch.device(args.device)
    on_cuda = dev.type == "cuda"
    torch.manual_seed(args.seed)

    # Kimi-Linear-like head: K = V = 128 with the lower-bound gate; a smaller one on the CPU.
    H, D = (16, 128) if on_cuda else (4, 64)
    lens = [700, 1, 97, 1250] if on_cuda else [150, 1, 17, 97]
    T = sum(lens)
    dt = torch.bfloat16 if on_cuda else torch.float32
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=dev)
    q, k, v, g = (torch.randn(1, T, H, D, device=dev, dtype=dt) for _ in range(4))
    beta = torch.randn(1, T, H, device=dev, dtype=dt)
    A_log = torch.rand(H, device=dev)
    dt_bias = torch.randn(H * D, device=dev)
    h0 = 0.1 * torch.randn(len(lens), H, D, D, device=dev)
    gate = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                lower_bound=-5.0, A_log=A_log, dt_bias=dt_bias, state_v_first=True)
    rows = []
    repeats = 10 if on_cuda else 2

    # Prefill.
    def prefill():
        return flashkda.chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu,
                                  **gate)

    ms = _timed(prefill, dev, repeats)
    o, ht = prefill()
    ref_o, ref_ht = kda_reference(*(x.double() for x in (q, k, v, g, beta)), initial_state=h0.double(),
                                  output_final_state=True, cu_seqlens=cu.cpu(), core="recurrent", **gate)
    rows.append(("chunk_kda", f"varlen {lens}, H={H}, D={D}", ms, _rel(o, ref_o), _rel(ht, ref_ht)))

    # Decode: one token per sequence from a shuffled fp32 slot pool, in place.
    N, slots = 64 if on_cuda else 8, (64 if on_cuda else 8) + 8
    pool = 0.1 * torch.randn(slots, H, D, D, device=dev)
    idx = torch.randperm(slots, device=dev)[:N].to(torch.int32)
    qd, kd, vd, gd = (torch.randn(N, 1, H, D, device=dev, dtype=dt) for _ in range(4))
    bd = torch.randn(N, 1, H, device=dev, dtype=dt)
    ref_pool = pool.double().clone()
    ref_od, _ = kda_reference(*(x.double() for x in (qd, kd, vd, gd, bd)), initial_state=ref_pool,
                              ssm_state_indices=idx.cpu(), core="recurrent", **gate)
    work = pool.clone()
    od, _ = flashkda.fused_recurrent_kda(qd, kd, vd, gd, bd, initial_state=work, ssm_state_indices=idx, **gate)
    scratch = pool.clone()
    ms_d = _timed(lambda: flashkda.fused_recurrent_kda(qd, kd, vd, gd, bd, initial_state=scratch,
                                                       ssm_state_indices=idx, **gate), dev, repeats)
    rows.append(("fused_recurrent_kda", f"N={N} x 1 token, H={H}, D={D}, pool {slots}", ms_d, _rel(od, ref_od),
                 _rel(work, ref_pool)))

    backend = "CUDA kernels" if (on_cuda and _ext.HAS_EXTENSION and not _ext.config.force_reference) else "reference"
    if on_cuda and not _ext.HAS_EXTENSION:
        backend += f" (extension unavailable: {_ext.EXTENSION_ERROR})"
    print(f"flashkda {flashkda.__version__} on {dev}" +
          (f" ({torch.cuda.get_device_name(dev)})" if on_cuda else "") + f", backend: {backend}, inputs {dt}")
    print(f"{'function':<22}{'shape':<46}{'median ms':>10}{'out err':>10}{'state err':>11}")
    worst = 0.0
    for name, shape, t, eo, es in rows:
        print(f"{name:<22}{shape:<46}{t:>10.3f}{eo:>10.1e}{es:>11.1e}")
        worst = max(worst, eo, es)
    tol = 5e-3 if dt == torch.bfloat16 else 1e-4
    ok = worst <= tol and worst == worst
    print(f"relative L2 error vs the fp64 recurrence: worst {worst:.1e} (tolerance {tol:.0e}): "
          f"{'OK' if ok else 'FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
