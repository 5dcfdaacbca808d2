"""Context parallelism on one host: a long prompt split across GPUs (NCCL), flashkda and FLA.

    python3 bench/cp_bench.py [--ranks 1,2,4] [--json PATH] [--calls 5]

Cases (bench/cases.py CP_ROWS): one sequence of 1,048,576 tokens, and 16 x 65,536 packed; H = 32,
K = V = 128, bf16 inputs, lower-bound gate -5 with A_log and dt_bias, l2norm and beta sigmoid in the
kernel, no initial state (FLA's restriction under cp_context). For each number of ranks that the
host has GPUs for, one process per GPU (torch.multiprocessing, NCCL with NVLink multicast off):
each rank times its call with CUDA events (after a barrier, median of --calls), the record is the
slowest rank's median. FLA's chunk_kda runs on the same split with its own cp_context. Records
(bench/common.py): case, impl flashkda / fla, ranks, median_ms.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ["FLA_FLASH_KDA"] = "0"
os.environ["FLASHKDA_FLA_BACKEND"] = "0"  # FLA's rows run FLA's own kernels
sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

import common  # noqa: E402
from cases import CP_ROWS  # noqa: E402

D, H = 128, 32
FLAGS = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
             safe_gate=True, lower_bound=-5.0, state_v_first=True)


def _slice_inputs(lens, rank, world, device):
    """This rank's share of the packed batch (every rank draws the same global tensors by seed)."""
    T = sum(lens)
    part = T // world
    gen = torch.Generator(device=device).manual_seed(0)

    def rnd(*shape):
        x = torch.randn(*shape, device=device, generator=gen).to(torch.bfloat16)
        return x[:, rank * part:(rank + 1) * part].contiguous()

    return dict(q=rnd(1, T, H, D), k=rnd(1, T, H, D), v=rnd(1, T, H, D), g=rnd(1, T, H, D), beta=rnd(1, T, H),
                A_log=torch.zeros(H, device=device).uniform_(0, 1), dt_bias=torch.zeros(H, D, device=device))


def _time(fn, calls):
    for _ in range(2):
        fn()
    times = []
    for _ in range(calls):
        dist.barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _worker(rank, world, init_file, out_dir, calls):
    import flashkda
    from flashkda.cp import build_context

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        fla_kda = fla_context = None
        try:
            from fla.ops.cp import build_cp_context as fla_context
            from fla.ops.kda import chunk_kda as fla_kda
        except Exception:  # noqa: BLE001 - FLA not installed: flashkda's rows only
            pass
        results = {}
        for case, lens in CP_ROWS.items():
            cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
            kw = _slice_inputs(lens, rank, world, "cuda")
            ours = build_context(cu, cu_seqlens_cpu=cu.cpu())
            results[(case, "flashkda")] = _time(lambda: flashkda.chunk_kda(**kw, **FLAGS, cp_context=ours), calls)
            if fla_kda is not None:
                theirs = fla_context(cu, group=dist.group.WORLD, cu_seqlens_cpu=cu.cpu())
                results[(case, "fla")] = _time(lambda: fla_kda(**kw, **FLAGS, cp_context=theirs), calls)
            del kw
            torch.cuda.empty_cache()
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", default="1,2,4")
    ap.add_argument("--json")
    ap.add_argument("--calls", type=int, default=5)
    args = ap.parse_args()
    common.RESULTS_PATH = args.json
    for world in (int(r) for r in args.ranks.split(",")):
        if world > torch.cuda.device_count():
            print(f"{world} ranks: only {torch.cuda.device_count()} GPUs, skipped")
            continue
        with tempfile.TemporaryDirectory() as tmp:
            mp.spawn(_worker, args=(world, os.path.join(tmp, "init"), tmp, args.calls), nprocs=world, join=True)
            per_rank = [torch.load(os.path.join(tmp, f"rank{r}.pt")) for r in range(world)]
        for (case, impl) in per_rank[0]:
            slowest = max(r[(case, impl)] for r in per_rank)
            common.record(case, impl, slowest, 0.0, ranks=world, source="bench/cp_bench.py: slowest rank's median")
            print(f"{case:16s} {impl:9s} ranks {world}: {slowest:9.3f} ms")


if __name__ == "__main__":
    main()
