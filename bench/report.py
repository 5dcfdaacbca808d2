"""Turn benchmark records (bench/results/*.json) into a markdown table: one row per case, one column
per implementation (median ms), the HBM floor, and each flashkda figure as a fraction of the floor."""

import argparse
import json
from collections import OrderedDict


def table(records):
    impls = list(OrderedDict.fromkeys(r["impl"] for r in records))
    cases = list(OrderedDict.fromkeys(r["case"] for r in records))
    by = {(r["case"], r["impl"]): r for r in records}
    head = ["case"] + [f"{i} ms" for i in impls] + ["floor ms (fp32 state)", "flashkda / floor", "host µs"]
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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("results")
    ap.add_argument("--markdown")
    args = ap.parse_args()
    with open(args.results) as f:
        records = json.load(f)
    text = table(records)
    print(text)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
