"""Turn benchmark records (bench/results/*.json) into a markdown table: one row per case, one column
per implementation (median ms), the HBM floor, and each flashkda figure as a fraction of the floor."""

import argparse
import json
from collections import OrderedDict


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
    fig, axes = plt.subplots(1, len(heads), figsize=(5 * len(heads), 4), squeeze=False)
    for ax, h in zip(axes[0], heads):
        rows = [(t, r) for t, hh, r in sweep if hh == h]
        for impl in OrderedDict.fromkeys(r["impl"] for _, r in rows):
            pts = sorted((t, r["median_ms"]) for t, r in rows if r["impl"] == impl)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=impl)
        floor = sorted({(t, r["floor_ms"]) for t, r in rows if r["impl"] == "flashkda"})
        ax.plot([p[0] for p in floor], [p[1] for p in floor], "k--", label="HBM floor")
        ax.set(xscale="log", yscale="log", xlabel="T (tokens)", ylabel="ms", title=f"H = {h}, D = 128, B = 1")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("results")
    ap.add_argument("--markdown")
    ap.add_argument("--plot", help="PNG of time against T for the sweep cases")
    args = ap.parse_args()
    with open(args.results) as f:
        records = json.load(f)
    if args.plot:
        plot(records, args.plot)
    records = [r for r in records if not r["case"].startswith("sweep_")]
    text = table(records)
    print(text)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
