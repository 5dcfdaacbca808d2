"""End to end: FLA's own KDAForCausalLM with flashkda as its KDA backend, against FLA's Triton kernels.

    python3 bench/e2e_fla_model.py [--json PATH] [--repeats 5] [--new-tokens 32] [--layers 4]

Model: fla.models.KDAForCausalLM from KDAConfig, random weights (seed 0), hidden 2048, 16 heads of
head_dim 128, bf16 (A_log and dt_bias included), eval, under torch.inference_mode(); two gates:
"lower_bound" (safe_gate=True, lower_bound=-5) and "softplus" (KDAConfig's default). Input: a
left-padded batch of 4 prompts of 1500, 1200, 723 and 1 random tokens, which FLA's layer unpads to
cu_seqlens. Per gate and backend (FLASHKDA_FLA_BACKEND=0: FLA's Triton kernels; =1: flashkda):

* prefill_ms: CUDA-event time of one forward model(ids, attention_mask=mask, use_cache=True),
  median of --repeats after 2 warm-ups;
* generate_ms: wall time between torch.cuda.synchronize() calls of a greedy model.generate of
  --new-tokens tokens (min_new_tokens too), median of --generate-repeats (at least 3) after 1
  warm-up. A generate step is bound by the host (HF's and the layers' Python, about 10 ms a token
  here), so the timed runs alternate backend off / on and Python's garbage collector is paused
  during them;
* calls_total / calls_served: calls of fla.layers.kda.chunk_kda and fused_recurrent_kda (the
  layer's two entry points), and of chunk_kda / fused_recurrent_kda_fwd on flashkda's backend objects
  in FLA's registries (what FLA runs when it picks flashkda) less the calls those hand back to FLA's
  kernel (flashkda.integrations.fla._fla_fallback), counted over one extra forward + generate, not
  the timed runs;
* logits_rel_diff_vs_fla / top1_agree_vs_fla (flashkda rows): last-position logits of that forward
  against those of the backend-off forward (relative L2 error; fraction of equal argmaxes).

Timed runs alternate off, on, off, on ... in one process, so drift (clocks, heat) hits both.
Records (bench/common.py's record: median_ms = prefill_ms, floor_ms = 0) go to --json.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import statistics
import sys
import time
from pathlib import Path

os.environ["FLA_FLASH_KDA"] = "0"  # FLA's adapter of the flash_kda package stays out
os.environ.pop("FLA_FLASHKDA", None)  # it would force ours on whatever FLASHKDA_FLA_BACKEND says
os.environ["FLASHKDA_FLA_BACKEND"] = "1"  # registered on import; switched per run below
sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]

import torch  # noqa: E402

import common  # noqa: E402
import fla.layers.kda as fla_layer  # noqa: E402
from fla.models import KDAConfig, KDAForCausalLM  # noqa: E402
from flashkda import _ext  # noqa: E402
from flashkda.integrations import fla as integ  # noqa: E402

PROMPT_LENS = (1500, 1200, 723, 1)
GATES = {"lower_bound": dict(safe_gate=True, lower_bound=-5.0), "softplus": {}}
IMPLS = (("fla", "0"), ("flashkda_backend", "1"))  # (impl, FLASHKDA_FLA_BACKEND)
SOURCE = ("fla.models.KDAForCausalLM, random weights, {L} layers, hidden 2048, 16 heads x 128, bf16; "
          "left-padded prompts {P}; prefill: CUDA events, median of {R} after 2 warm-ups; "
          "generate {N} greedy tokens: synchronized wall time, median of {G} after 1 warm-up; off/on "
          "interleaved, gc paused; calls counted over one extra forward + generate, not the timed runs")


def build_model(gate: str, layers: int) -> KDAForCausalLM:
    # KDAConfig passes safe_gate / lower_bound on to every KimiDeltaAttention layer.
    config = KDAConfig(hidden_size=2048, num_heads=16, head_dim=128, num_hidden_layers=layers, **GATES[gate])
    torch.manual_seed(0)
    torch.cuda.manual_seed_all(0)
    model = KDAForCausalLM(config).to(torch.bfloat16).cuda().eval()
    want = (GATES[gate].get("safe_gate", False), GATES[gate].get("lower_bound"))
    assert all((m.safe_gate, m.lower_bound) == want for m in model.modules()
               if isinstance(m, fla_layer.KimiDeltaAttention))
    return model


def make_batch(vocab: int):
    gen = torch.Generator().manual_seed(1)
    L = max(PROMPT_LENS)
    ids = torch.zeros(len(PROMPT_LENS), L, dtype=torch.long)
    mask = torch.zeros(len(PROMPT_LENS), L, dtype=torch.long)
    for b, n in enumerate(PROMPT_LENS):  # left padding: the prompt ends at the last column
        ids[b, L - n:] = torch.randint(3, vocab, (n,), generator=gen)
        mask[b, L - n:] = 1
    return ids.cuda(), mask.cuda()


@contextlib.contextmanager
def count_calls():
    """calls_total: the layer's KDA calls; calls_served: those that ran flashkda; reasons: rejections."""
    c = dict(calls_total=0, calls_served=0, reasons=set())
    saved = []

    def patch(module, name, key):
        orig = getattr(module, name)
        saved.append((module, name, orig))

        def spy(*args, **kwargs):
            result = orig(*args, **kwargs)
            if key == "reasons":
                if not result[0]:
                    c["reasons"].add(f"{name}: {result[1]}")
            elif key == "handed_back":  # reached the backend, run by FLA's kernel after all
                c["calls_served"] -= 1
                c["reasons"].add(f"{name}: {args[0]}")
            else:
                c[key] += 1
            return result

        setattr(module, name, spy)

    for name in ("chunk_kda", "fused_recurrent_kda"):
        patch(fla_layer, name, "calls_total")
    chunk_backend, op_backend, _ = integ.registered_backends()
    for backend, name in ((chunk_backend, "chunk_kda"), (op_backend, "fused_recurrent_kda_fwd")):
        patch(backend, name, "calls_served")
    patch(chunk_backend, "chunk_kda_verifier", "reasons")  # the decode entry has none: the adapter decides
    patch(integ, "_fla_fallback", "handed_back")
    try:
        yield c
    finally:
        for module, name, orig in reversed(saved):
            setattr(module, name, orig)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", help="write the records here")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--generate-repeats", type=int, default=15)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--layers", type=int, default=4)
    args = ap.parse_args()
    common.RESULTS_PATH = args.json
    gen_runs = max(3, args.generate_repeats)
    source = SOURCE.format(L=args.layers, P="/".join(map(str, PROMPT_LENS)), R=args.repeats, N=args.new_tokens,
                           G=gen_runs)
    if not _ext.HAS_EXTENSION or not (integ.is_registered() or integ.register()):
        why = f"extension missing: {_ext.EXTENSION_ERROR}" if not _ext.HAS_EXTENSION else \
            "FLA dispatch disabled or FLA's signatures changed"
        print(f"WARNING: flashkda is NOT serving as an FLA backend ({why}): the flashkda_backend rows below "
              "run FLA's Triton kernels.")

    def prefill(model, ids, mask):
        return model(ids, attention_mask=mask, use_cache=True).logits

    def generate(model, ids, mask):
        return model.generate(ids, attention_mask=mask, max_new_tokens=args.new_tokens,
                              min_new_tokens=args.new_tokens, do_sample=False, pad_token_id=0)

    summary = []
    for gate in GATES:
        model = build_model(gate, args.layers)
        ids, mask = make_batch(model.config.vocab_size)
        with torch.inference_mode():
            counts, last = {}, {}
            for impl, env in IMPLS:  # counting pass (also the first warm-up; compiles FLA's Triton)
                os.environ[integ.ENV_VAR] = env
                with count_calls() as c:
                    last[impl] = prefill(model, ids, mask)[:, -1].float()
                    generate(model, ids, mask)
                counts[impl] = c
                for r in sorted(c["reasons"]):
                    print(f"[{gate}/{impl}] flashkda rejected {r}")
            ref, ours = last["fla"], last["flashkda_backend"]
            logits_rel = float((ours - ref).norm() / ref.norm())
            top1 = float((ours.argmax(-1) == ref.argmax(-1)).float().mean())
            print(f"[{gate}] last-position logits, flashkda vs FLA: rel L2 {logits_rel:.3e}, top-1 agree {top1:.2f}")
            for impl, env in IMPLS:
                os.environ[integ.ENV_VAR] = env
                for _ in range(2):
                    prefill(model, ids, mask)
                generate(model, ids, mask)
            torch.cuda.synchronize()
            times = {impl: dict(prefill=[], generate=[]) for impl, _ in IMPLS}
            gc.collect()
            gc.disable()
            try:
                for r in range(max(args.repeats, gen_runs)):
                    for impl, env in IMPLS:
                        os.environ[integ.ENV_VAR] = env
                        if r < args.repeats:
                            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                            start.record()
                            out = prefill(model, ids, mask)
                            end.record()
                            torch.cuda.synchronize()
                            times[impl]["prefill"].append(start.elapsed_time(end))
                            del out
                        if r < gen_runs:
                            torch.cuda.synchronize()
                            t0 = time.perf_counter()
                            generate(model, ids, mask)
                            torch.cuda.synchronize()
                            times[impl]["generate"].append((time.perf_counter() - t0) * 1e3)
            finally:
                gc.enable()
        os.environ[integ.ENV_VAR] = "1"
        for impl, _ in IMPLS:
            p, g = statistics.median(times[impl]["prefill"]), statistics.median(times[impl]["generate"])
            extra = dict(logits_rel_diff_vs_fla=round(logits_rel, 6), top1_agree_vs_fla=top1) \
                if impl == "flashkda_backend" else {}
            rec = common.record(f"e2e_fla_kda_model_{gate}", impl, p, 0.0, prefill_ms=round(p, 4),
                                generate_ms=round(g, 4), calls_served=counts[impl]["calls_served"],
                                calls_total=counts[impl]["calls_total"], source=source, **extra)
            summary.append(rec)
        del model
        torch.cuda.empty_cache()

    print(f"\n{'case':34s} {'impl':17s} {'prefill ms':>11s} {'generate ms':>12s} {'served/total':>13s}")
    for r in summary:
        print(f"{r['case']:34s} {r['impl']:17s} {r['prefill_ms']:11.3f} {r['generate_ms']:12.3f} "
              f"{r['calls_served']:>6d}/{r['calls_total']:<6d}")
    for gate in GATES:
        fla, ours = (next(r for r in summary if r["case"] == f"e2e_fla_kda_model_{gate}" and r["impl"] == i)
                     for i, _ in IMPLS)
        rp, rg = ours["prefill_ms"] / fla["prefill_ms"], ours["generate_ms"] / fla["generate_ms"]
        served = 0 < ours["calls_total"] == ours["calls_served"]
        print(f"{gate:12s} flashkda/fla: prefill {rp:.3f}x (required <= 0.80: {'yes' if rp <= 0.80 else 'NO'}), "
              f"generate {rg:.3f}x (required <= 1.00: {'yes' if rg <= 1.0 else 'NO'}), "
              f"served {ours['calls_served']}/{ours['calls_total']} (required all: {'yes' if served else 'NO'})")


if __name__ == "__main__":
    main()
