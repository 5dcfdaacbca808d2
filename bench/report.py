"""Turn benchmark records (bench/results/*.json) into markdown: a generic table (one row per case,
one column per implementation, median ms, the HBM floor, flashkda as a fraction of the floor), the
tables of the required prefill and decode cases with their bounds, and a PNG of time against T.

    python bench/report.py RESULTS.json [--markdown table.md] [--plot prefill_vs_T.png]
        [--update BENCHMARK_H200.md --command "the command that produced RESULTS.json" [--sections train]]
        [--merge bench/results/h200.json]

--update rewrites the generated sections of the file (between ``<!-- report:NAME -->`` and
``<!-- /report:NAME -->``; appended when absent) with the command, dates, GPU and tables. --merge
adds the records to a results file, replacing those of the same case and implementation.
--sections names the generated sections to rewrite (default: every one with records), so that
records of one kind leave the others, and the commands they name, as they were.
"""

import argparse
import json
import os
import sys
from collections import OrderedDict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cases import (CP_MIN_SPEEDUP_2, CP_ROWS, DECODE_BF16_POOL_REQUIRED_MS, DECODE_NS,  # noqa: E402
                   DECODE_REQUIRED_MS, E2E_GATES, E2E_PREFILL_MAX_RATIO, FLA_DISPATCH_EXTRA_US, HOST_OVERHEAD_REQUIRED_US,
                   PREFILL_REQUIRED_MS, PREFILL_ROWS, PREFILL_SM80_ROW, PREFILL_SOFTPLUS_MAX_RATIO,
                   PREFIX_CHECKPOINTS_MAX_RATIO, PREFIX_ROW, PREFIX_STATES_MAX_RATIO, TRAIN_GDN_ROW,
                   TRAIN_MAX_RATIO, TRAIN_ROWS, decode_case, e2e_case)

PREFILL_COLUMNS = [("flashkda", "flashkda"), ("flashkda_softplus", "softplus"), ("flashkda_gdn", "GDN"),
                   ("flashkda_sm80", "sm80 family"), ("fla_chunk_kda", "FLA chunk_kda"),
                   ("fla_chunk_gdn", "FLA GDN")]
DECODE_COLUMNS = [("flashkda", "flashkda"), ("flashkda_bf16pool", "bf16 pool"), ("flashkda_gdn", "GDN"),
                  ("fla_fused_recurrent_kda", "FLA")]


def table(records):
    impls = list(OrderedDict.fromkeys(r["impl"] for r in records))
    cases = list(OrderedDict.fromkeys(r["case"] for r in records))
    by = {(r["case"], r["impl"]): r for r in records}
    head = ["case"] + [f"{i} ms" for i in impls] + ["floor ms", "flashkda / floor", "host µs"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for c in cases:
        row = [c]
        for i in impls:
            r = by.get((c, i))
            row.append(f"{r['median_ms']:.4f}" if r else "—")
        base = by.get((c, "flashkda")) or next(by[(c, i)] for i in impls if (c, i) in by)
        row.append(f"{base['floor_ms']:.4f}")
        row.append(f"{base['floor_ms'] / base['median_ms']:.0%}" if "flashkda" == base["impl"] else "—")
        row.append(str(base.get("host_overhead_us", "—")))
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def plot(records, path):
    """Time against T (sweep_T{T}_H{H} cases), one panel per H, one line per implementation."""
    import re

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sweep = [(int(m.group(1)), int(m.group(2)), r) for r in records
             if (m := re.fullmatch(r"sweep_T(\d+)_H(\d+)", r["case"]))]
    heads = sorted({h for _, h, _ in sweep})
    if not heads:
        return
    # One colour per implementation in every panel (merged records come in any order): flashkda first.
    impls = sorted(OrderedDict.fromkeys(r["impl"] for _, _, r in sweep), key=lambda i: i != "flashkda")
    colours = {impl: f"C{i}" for i, impl in enumerate(impls)}
    fig, axes = plt.subplots(1, len(heads), figsize=(5 * len(heads), 4), squeeze=False)
    for ax, h in zip(axes[0], heads):
        rows = [(t, r) for t, hh, r in sweep if hh == h]
        for impl in impls:
            pts = sorted((t, r["median_ms"]) for t, r in rows if r["impl"] == impl)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=impl, color=colours[impl])
        floor = sorted({(t, r["floor_ms"]) for t, r in rows if r["impl"] == "flashkda"})
        ax.plot([p[0] for p in floor], [p[1] for p in floor], "k--", label="HBM floor")
        ax.set(xscale="log", yscale="log", xlabel="T (tokens)", ylabel="ms", title=f"H = {h}, D = 128, B = 1")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _ms(r):
    return f"{r['median_ms']:.3f}" if r else "—"


def _met(value, bound):
    return "—" if value is None else ("yes" if value <= bound else "no")


def _also_required(by, case) -> str:
    """The row's other bounds: softplus against the lower-bound time, our GDN against FLA's, and on
    PREFILL_SM80_ROW the sm_80 family against FLA chunk_kda; a dash where a figure is missing."""
    def ms(impl):
        r = by.get((case, impl))
        return r and r["median_ms"]

    ours, softplus = ms("flashkda"), ms("flashkda_softplus")
    ratio = softplus / ours if ours and softplus else None
    parts = [f"softplus {ratio:.2f}× {_met(ratio, PREFILL_SOFTPLUS_MAX_RATIO)}" if ratio else "softplus —",
             "GDN ≤ FLA GDN " + (_met(ms("flashkda_gdn"), ms("fla_chunk_gdn")) if ms("fla_chunk_gdn") else "—")]
    if case == PREFILL_SM80_ROW:
        fla = ms("fla_chunk_kda")
        parts.append("sm80 ≤ FLA chunk_kda " + (_met(ms("flashkda_sm80"), fla) if fla else "—"))
    return "; ".join(parts)


def prefill_table(records) -> str:
    """The required prefill rows: every implementation's median, the floor, the bounds."""
    by = {(r["case"], r["impl"]): r for r in records}
    head = ["case"] + [f"{name} ms" for _, name in PREFILL_COLUMNS] + [
        "floor ms", "flashkda / floor", f"also required (softplus ≤ {PREFILL_SOFTPLUS_MAX_RATIO}×)", "required", "met"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for case in PREFILL_ROWS:
        ours = by.get((case, "flashkda"))
        row = [case] + [_ms(by.get((case, impl))) for impl, _ in PREFILL_COLUMNS]
        row += [f"{ours['floor_ms']:.3f}" if ours else "—",
                f"{ours['floor_ms'] / ours['median_ms']:.0%}" if ours else "—", _also_required(by, case),
                f"≤ {PREFILL_REQUIRED_MS[case]:.2f}", _met(ours and ours["median_ms"], PREFILL_REQUIRED_MS[case])]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def decode_table(records) -> str:
    """The required decode rows (eager CUDA-event medians) with host overhead and the bounds."""
    by = {(r["case"], r["impl"]): r for r in records}
    head = ["case"] + [f"{name} ms" for _, name in DECODE_COLUMNS] + ["floor ms", "flashkda / floor", "host µs",
                                                                    "required", "met"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for N in DECODE_NS:
        case = decode_case(N)
        ours = by.get((case, "flashkda"))
        host = ours.get("host_overhead_us") if ours else None
        bf16 = by.get((case, "flashkda_bf16pool"))
        required = f"≤ {DECODE_REQUIRED_MS[N]:.3f}"
        met = _met(ours and ours["median_ms"], DECODE_REQUIRED_MS[N])
        if N in DECODE_BF16_POOL_REQUIRED_MS:
            required += f"; bf16 pool ≤ {DECODE_BF16_POOL_REQUIRED_MS[N]:.2f}"
            met += " / " + _met(bf16 and bf16["median_ms"], DECODE_BF16_POOL_REQUIRED_MS[N])
        row = [case] + [f"{by[(case, i)]['median_ms']:.4f}" if (case, i) in by else "—" for i, _ in DECODE_COLUMNS]
        row += [f"{ours['floor_ms']:.4f}" if ours else "—",
                f"{ours['floor_ms'] / ours['median_ms']:.0%}" if ours else "—",
                f"{host:.1f} (≤ {HOST_OVERHEAD_REQUIRED_US:.0f})" if host is not None else "—", required, met]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def fla_table(records) -> str:
    """FLA's KDA model end to end with and without the backend, and the decode call's host time
    through FLA's registry; each with its bounds."""
    by = {(r["case"], r["impl"]): r for r in records}
    lines = ["| model, gate | FLA prefill ms | flashkda prefill ms | ratio (≤ "
             f"{E2E_PREFILL_MAX_RATIO:.2f}) | FLA generate ms | flashkda generate ms | ratio (≤ 1) | "
             "calls served | logits vs FLA (rel. L2) | met |", "|---|---|---|---|---|---|---|---|---|---|"]
    for gate in E2E_GATES:
        fla, ours = by.get((e2e_case(gate), "fla")), by.get((e2e_case(gate), "flashkda_backend"))
        if not (fla and ours):
            continue
        rp, rg = ours["prefill_ms"] / fla["prefill_ms"], ours["generate_ms"] / fla["generate_ms"]
        served = 0 < ours["calls_served"] == ours["calls_total"]
        met = "yes" if served and rp <= E2E_PREFILL_MAX_RATIO and rg <= 1.0 else "no"
        lines.append(f"| {gate} | {fla['prefill_ms']:.2f} | {ours['prefill_ms']:.2f} | {rp:.3f} | "
                     f"{fla['generate_ms']:.1f} | {ours['generate_ms']:.1f} | {rg:.3f} | "
                     f"{ours['calls_served']}/{ours['calls_total']} | {ours.get('logits_rel_diff_vs_fla', '—')} | "
                     f"{met} |")
    lines += ["", "| decode call, host µs | flashkda direct | through FLA's registry | extra (≤ "
              f"{FLA_DISPATCH_EXTRA_US:g}) | FLA's dispatcher | adapter + call | FLA's public wrapper | "
              "FLA's own kernel |", "|---|---|---|---|---|---|---|---|"]
    for r in records:
        if r["case"].startswith("fla_dispatch_"):
            wrapper = r.get("fla_public_wrapper_us")
            lines.append(f"| {r['case'][len('fla_dispatch_'):]} | {r['direct_us']:.2f} | {r['through_fla_us']:.2f} | "
                         f"{r['extra_us']:.2f} | {r['fla_dispatcher_us']:.2f} | {r['adapter_us']:.2f} | "
                         f"{'—' if wrapper is None else f'{wrapper:.2f}'} | {r['fla_alone_us']:.2f} |")
    return "\n".join(lines)


PREFIX_KINDS = {"intermediate_states": PREFIX_STATES_MAX_RATIO, "checkpoints": PREFIX_CHECKPOINTS_MAX_RATIO}


def prefix_table(records) -> str:
    """PREFIX_ROW keeping its states at chunk starts, against the plain call of the same run."""
    by = {(r["case"], r["impl"]): r for r in records}
    lines = [f"| case | flashkda ms | {PREFIX_ROW} ms (same run) | ratio | required | met | FLA chunk_kda ms |",
             "|---|---|---|---|---|---|---|"]
    for kind, bound in PREFIX_KINDS.items():
        case = f"{PREFIX_ROW}_{kind}"
        ours, fla = by.get((case, "flashkda")), by.get((case, "fla_chunk_kda"))
        if not ours:
            continue
        ratio = ours["median_ms"] / ours["plain_ms"]
        lines.append(f"| {case} | {ours['median_ms']:.3f} | {ours['plain_ms']:.3f} | {ratio:.2f} | ≤ {bound:.2f} | "
                     f"{_met(ratio, bound)} | {_ms(fla)} |")
    return "\n".join(lines)


def train_table(records) -> str:
    """Forward and forward + backward against FLA on the same inputs, peak memory, the bounds; then
    FLA's model trained with and without the backend, and the gradient errors."""
    by = {(r["case"], r["impl"]): r for r in records}
    lines = ["| case | flashkda fwd ms | FLA fwd ms | flashkda fwd+bwd ms | FLA fwd+bwd ms | ratio (≤ "
             f"{TRAIN_MAX_RATIO}) | flashkda peak MB | FLA peak MB | met |", "|---|---|---|---|---|---|---|---|---|"]
    for case in [*TRAIN_ROWS, TRAIN_GDN_ROW]:
        ours, fla = by.get((case, "flashkda")), by.get((case, "fla"))
        if not ours:
            continue
        ratio = ours["fwd_bwd_ms"] / fla["fwd_bwd_ms"] if fla else None
        met = "—" if fla is None else (
            "yes" if ratio <= TRAIN_MAX_RATIO and ours["peak_mem_mb"] <= fla["peak_mem_mb"] else "no")
        shown = "—" if ratio is None else f"{ratio:.2f}"
        lines.append(f"| {case} | {ours['fwd_ms']:.3f} | {fla['fwd_ms'] if fla else '—'} | "
                     f"{ours['fwd_bwd_ms']:.3f} | {fla['fwd_bwd_ms'] if fla else '—'} | {shown} | "
                     f"{ours['peak_mem_mb']:.0f} | {fla['peak_mem_mb'] if fla else '—'} | {met} |")
    model = {r["impl"]: r for r in records if r["case"] == "train_fla_kda_model"}
    if model:
        lines += ["", "| FLA KDAForCausalLM training | step ms | first loss | final loss | KDA calls on flashkda | "
                  "FLA KDA kernels |", "|---|---|---|---|---|---|"]
        for impl, r in model.items():
            lines.append(f"| {impl} | {r['step_ms']:.1f} | {r['first_loss']:.4f} | {r['final_loss']:.4f} | "
                         f"{r['calls_served']}/{r['calls_total']} | {r['fla_kda_kernels']} |")
    grads = [r for r in records if r["case"].startswith("grad_accuracy_")]
    if grads:
        names = [k for k in grads[0] if k.startswith("d") and k not in ("date",)]
        lines += ["", "| gradient error vs fp64 | impl | " + " | ".join(names) + " |",
                  "|---|---|" + "---|" * len(names)]
        for r in grads:
            lines.append(f"| {r['case'][len('grad_accuracy_'):]} | {r['impl']} | " +
                         " | ".join(f"{r[n]:.2e}" for n in names) + " |")
    return "\n".join(lines)


def cp_table(records) -> str:
    """Context parallelism: the slowest rank's median per number of ranks, flashkda and FLA, and the
    speedup over one rank (required: at least CP_MIN_SPEEDUP_2 on 2 ranks for the first row)."""
    by = {(r["case"], r["impl"], r["ranks"]): r["median_ms"] for r in records if r["case"] in CP_ROWS}
    ranks = sorted({k[2] for k in by})
    lines = ["| case | impl | " + " | ".join(f"{n} GPU{'s' if n > 1 else ''} ms" for n in ranks) +
             " | 2 GPUs / 1 GPU | met |", "|---|---|" + "---|" * (len(ranks) + 2)]
    for case in CP_ROWS:
        for impl in ("flashkda", "fla"):
            times = [by.get((case, impl, n)) for n in ranks]
            if not any(times):
                continue
            one, two = by.get((case, impl, 1)), by.get((case, impl, 2))
            speedup = one / two if one and two else None
            required = impl == "flashkda" and case == next(iter(CP_ROWS))
            met = "—" if not required or speedup is None else ("yes" if speedup >= CP_MIN_SPEEDUP_2 else "no")
            lines.append(f"| {case} | {impl} | " + " | ".join("—" if t is None else f"{t:.2f}" for t in times) +
                         f" | {'—' if speedup is None else f'{speedup:.2f}×'} | {met} |")
    return "\n".join(lines)


def section(kind: str, records, command: str) -> str:
    """A generated section: provenance lines, then the table. Empty when no record is of this kind."""
    if kind == "prefill":
        mine = [r for r in records if r["case"] in PREFILL_ROWS]
    elif kind == "decode":
        mine = [r for r in records if r["case"] in {decode_case(N) for N in DECODE_NS}]
    elif kind == "prefix":
        mine = [r for r in records if r["case"].startswith(f"{PREFIX_ROW}_")]
    elif kind == "train":
        mine = [r for r in records if r["case"].startswith(("train_", "grad_accuracy_"))]
    elif kind == "cp":
        mine = [r for r in records if r["case"] in CP_ROWS]
    else:
        mine = [r for r in records if r["case"].startswith(("e2e_fla_", "fla_dispatch_"))]
    if not mine:
        return ""
    dates = ", ".join(sorted({r["date"] for r in mine}))
    gpus = ", ".join(sorted({r.get("gpu", "not recorded") for r in mine}))
    tables = {"prefill": prefill_table, "decode": decode_table, "fla": fla_table, "prefix": prefix_table,
              "train": train_table, "cp": cp_table}
    table_text = tables[kind](mine)
    return (f"Generated by `bench/report.py --update` from {len(mine)} records. Command: `{command}`. "
            f"Date: {dates}. GPU: {gpus}. A dash: not measured in these records.\n\n{table_text}\n")


SECTIONS = ("prefill", "decode", "fla", "prefix", "train", "cp")


def update_sections(path: str, records, command: str, kinds=SECTIONS) -> None:
    """Rewrites the generated sections ``kinds`` of the markdown file from ``records`` (a kind with
    no record is left as it is)."""
    for kind in kinds:
        body = section(kind, records, command)
        if body:
            update_markdown(path, kind, body)


def update_markdown(path: str, name: str, text: str) -> None:
    """Replaces the generated section `name` of the markdown file, or appends it."""
    begin, end = f"<!-- report:{name} -->", f"<!-- /report:{name} -->"
    doc = open(path).read() if os.path.exists(path) else ""
    block = f"{begin}\n{text}{end}"
    if begin in doc and end in doc:
        doc = doc[: doc.index(begin)] + block + doc[doc.index(end) + len(end):]
    else:
        doc = doc.rstrip("\n") + f"\n\n{block}\n"
    with open(path, "w") as f:
        f.write(doc)


def merge_records(path: str, records) -> list:
    """The records of `path` with `records` added; a new record replaces one of the same (case, impl)."""
    old = json.load(open(path)) if os.path.exists(path) else []
    new_keys = {(r["case"], r["impl"]) for r in records}
    merged = [r for r in old if (r["case"], r["impl"]) not in new_keys] + list(records)
    with open(path, "w") as f:
        f.write(json.dumps(merged, indent=1) + "\n")
    return merged


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("results")
    ap.add_argument("--markdown")
    ap.add_argument("--plot", help="PNG of time against T for the sweep cases")
    ap.add_argument("--update", help="markdown file whose generated sections to rewrite (BENCHMARK_H200.md)")
    ap.add_argument("--command", default="not recorded", help="the command that produced the records")
    ap.add_argument("--sections", default=",".join(SECTIONS),
                    help="comma-separated generated sections for --update (default: all)")
    ap.add_argument("--merge", help="results file (bench/results/h200.json) to add these records to")
    args = ap.parse_args()
    with open(args.results) as f:
        records = json.load(f)
    if args.merge:
        merge_records(args.merge, records)
    if args.plot:
        plot(records, args.plot)
    records = [r for r in records if not r["case"].startswith("sweep_")]
    timed = [r for r in records if not r["case"].startswith("grad_accuracy_") and r["case"] not in CP_ROWS]
    text = table(timed) if timed else ""
    if any(r["case"].startswith(("train_", "grad_accuracy_")) for r in records):
        text += "\n\n" + train_table(records)
    if any(r["case"] in CP_ROWS for r in records):
        text += "\n\n" + cp_table(records)
    print(text)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text + "\n")
    if args.update:
        kinds = args.sections.split(",")
        unknown = set(kinds) - set(SECTIONS)
        if unknown:
            ap.error(f"--sections: unknown {sorted(unknown)}; known: {', '.join(SECTIONS)}")
        update_sections(args.update, records, args.command, kinds)


if __name__ == "__main__":
    main()
