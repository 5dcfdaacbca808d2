"""Training FLA's own KDAForCausalLM with flashkda as its KDA backend, against FLA's Triton kernels.

    python3 bench/train_fla_model.py [--json PATH] [--steps 30] [--layers 4] [--gate lower_bound] [--warm]

--warm: two steps on FLA's kernels only, nothing recorded (FLA's Triton kernels compiled, e.g. to fill a
cache before a timed run).

Model: fla.models.KDAForCausalLM from KDAConfig (hidden 2048, 16 heads of 128, --layers layers,
vocabulary 8192), random weights from seed 0, bf16 parameters trained by AdamW (lr 3e-4), no code
change between runs: FLA's registry picks flashkda (FLASHKDA_FLA_BACKEND=1; calls under autograd
with a lower-bound gate by default, with the softplus gate FLASHKDA_FLA_TRAINING=1, set here) or its
own kernels (=0). Data: packed varlen
batches of 8 sequences x 2048 tokens (cu_seqlens), each sequence a random block of 8-64 tokens
repeated (learnable by the recurrence), next-token cross entropy.

Runs: FLA with data order seed 0 and seed 1 (FLA's own run-to-run spread), flashkda with seed 0.
* step_ms: CUDA-event time of forward + backward + optimizer step, median over the steps after
  the first five;
* final_loss: mean loss of the last five steps; the flashkda run must be within the spread
  |final_loss(FLA, seed 0) - final_loss(FLA, seed 1)| of FLA's seed-0 run;
* calls_total / calls_served: KDA calls of one profiled extra step (the layer count), and launches of
  flashkda's chunk_state_grad kernel in it (one in the backward of each call flashkda served, forward
  and backward), found by kernel name in the profiler; fla_kda_kernels:
  launches of FLA's KDA Triton kernels (names holding "kda" or "delta_rule") in that step, which
  must be 0 on the flashkda run.
Records (bench/common.py): train_fla_kda_model, impls fla / fla_seed1 / flashkda_backend.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

os.environ["FLA_FLASH_KDA"] = "0"  # FLA's adapter of the flash_kda package stays out
os.environ.pop("FLA_FLASHKDA", None)
os.environ["FLASHKDA_FLA_BACKEND"] = "1"  # registered on import; switched per run below
sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]

import torch  # noqa: E402

import common  # noqa: E402
import fla_autotune  # noqa: E402
from fla.models import KDAConfig, KDAForCausalLM  # noqa: E402
from flashkda.integrations import fla as integ  # noqa: E402

GATES = {"lower_bound": dict(safe_gate=True, lower_bound=-5.0), "softplus": {}}
SEQS, SEQ_LEN, VOCAB = 8, 2048, 8192
CASE = "train_fla_kda_model"


def batches(steps: int, seed: int, device="cuda"):
    """``steps`` packed batches ([1, SEQS * SEQ_LEN] ids, cu_seqlens); the same batches for every
    seed, in an order drawn from ``seed``."""
    gen = torch.Generator().manual_seed(1234)
    data = []
    for _ in range(steps):
        seqs = []
        for _ in range(SEQS):
            period = int(torch.randint(8, 65, (1,), generator=gen))
            block = torch.randint(3, VOCAB, (period,), generator=gen)
            seqs.append(block.repeat(SEQ_LEN // period + 1)[:SEQ_LEN])
        data.append(torch.cat(seqs)[None])
    order = torch.randperm(steps, generator=torch.Generator().manual_seed(seed)).tolist()
    cu = torch.arange(0, (SEQS + 1) * SEQ_LEN, SEQ_LEN, dtype=torch.int32, device=device)
    return [(data[i].to(device), cu) for i in order]


def build_model(gate: str, layers: int) -> KDAForCausalLM:
    config = KDAConfig(hidden_size=2048, num_heads=16, head_dim=128, num_hidden_layers=layers, vocab_size=VOCAB,
                       **GATES[gate])
    torch.manual_seed(0)
    torch.cuda.manual_seed_all(0)
    return KDAForCausalLM(config).to(torch.bfloat16).cuda().train()


def kernel_counts(step) -> dict:
    """Launches during ``step()`` of flashkda's chunk_state_grad (once in the backward of every KDA call
    whose forward and backward flashkda served) and of FLA's KDA Triton kernels (names holding "kda"
    or "delta_rule", flashkda's own excluded: its kernels live in the flashkda namespace)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type.name == "CUDA"]
    return dict(calls_served=sum("chunk_state_grad" in n for n in names),
                fla_kda_kernels=sum(("kda" in n.lower() or "delta_rule" in n.lower()) and "flashkda" not in n
                                    for n in names))


def train(backend: str, data_seed: int, steps: int, layers: int, gate: str) -> dict:
    """One training run: losses, step times and the kernel counts of one extra profiled step."""
    os.environ[integ.ENV_VAR] = backend
    model = build_model(gate, layers)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.0)

    def step(ids, cu):
        out = model(input_ids=ids, labels=ids, cu_seqlens=cu)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return out.loss.detach()

    losses, times = [], []
    for ids, cu in batches(steps, data_seed):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        loss = step(ids, cu)
        end.record()
        torch.cuda.synchronize()
        losses.append(float(loss))
        times.append(start.elapsed_time(end))
    ids, cu = batches(1, data_seed + 100)[0]
    counts = kernel_counts(lambda: step(ids, cu))
    del model, opt
    torch.cuda.empty_cache()
    tail = min(5, len(losses))
    return dict(losses=losses, step_ms=statistics.median(times[5:] or times), final_loss=sum(losses[-tail:]) / tail,
                calls_total=layers, **counts)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", help="write the records here")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--gate", choices=list(GATES), default="lower_bound")
    ap.add_argument("--warm", action="store_true", help="two steps on FLA's kernels, nothing recorded")
    args = ap.parse_args()
    print(f"fla_autotune: {fla_autotune.pin()} tuning keys of FLA's kernels pinned")
    if args.warm:
        r = train("0", 0, 2, args.layers, args.gate)
        print(f"warm-up on FLA's kernels: {len(r['losses'])} steps, loss {r['losses'][-1]:.4f}")
        return
    common.RESULTS_PATH = args.json
    if args.gate != "lower_bound":  # by default the backend serves training calls of bounded gates only
        os.environ[integ.TRAINING_ENV_VAR] = "1"
    if not integ.is_registered() and not integ.register():
        print("WARNING: flashkda is NOT registered as an FLA backend: both rows run FLA's kernels.")
    source = (f"bench/train_fla_model.py: KDAForCausalLM {args.layers} layers, hidden 2048, 16x128, {args.gate} gate, "
              f"bf16 + AdamW, {SEQS}x{SEQ_LEN} packed tokens, {args.steps} steps; step_ms median after 5 steps")
    runs = {}
    # the comparison first, FLA's second data order last: each run is recorded as it ends
    for impl, backend, seed in (("fla", "0", 0), ("flashkda_backend", "1", 0), ("fla_seed1", "0", 1)):
        r = runs[impl] = train(backend, seed, args.steps, args.layers, args.gate)
        common.record(CASE, impl, r["step_ms"], 0.0, step_ms=round(r["step_ms"], 3),
                      calls_served=r["calls_served"], calls_total=r["calls_total"],
                      fla_kda_kernels=r["fla_kda_kernels"], final_loss=round(r["final_loss"], 5),
                      first_loss=round(r["losses"][0], 5), source=source)
        print(f"{impl:17s} step {r['step_ms']:8.2f} ms  loss {r['losses'][0]:.4f} -> {r['final_loss']:.4f}  "
              f"chunk_state_grad launches {r['calls_served']}/{r['calls_total']}  FLA KDA kernels {r['fla_kda_kernels']}",
              flush=True)
    spread = abs(runs["fla"]["final_loss"] - runs["fla_seed1"]["final_loss"])
    diff = abs(runs["flashkda_backend"]["final_loss"] - runs["fla"]["final_loss"])
    print(f"final-loss difference flashkda vs FLA {diff:.4f}; FLA seed spread {spread:.4f}; step-time ratio "
          f"{runs['flashkda_backend']['step_ms'] / runs['fla']['step_ms']:.3f}")


if __name__ == "__main__":
    main()
