"""Summarise an Nsight Compute source-page CSV (`ncu --import R --page source --csv --print-source cuda|sass`):
the source lines with the most warp-stall samples and the most executed instructions.

    python bench/ncu_hotspots.py hot_cuda.csv [--top 25]
"""

from __future__ import annotations

import argparse
import csv


def number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    with open(args.csv, newline="") as f:
        rows = list(csv.reader(f))
    head_at = next((i for i, r in enumerate(rows) if any("Source" in c for c in r)), None)
    if head_at is None:
        print("no source table found; first lines:", rows[:3])
        return
    head, body = rows[head_at], [r for r in rows[head_at + 1:] if len(r) == len(rows[head_at])]
    col = {name: i for i, name in enumerate(head)}
    src = next(i for n, i in col.items() if "Source" in n)
    line = next((i for n, i in col.items() if n.strip() in ("#", "Line", "Line No", "Line Number", "Address")), None)
    samples = next((i for n, i in col.items() if "Sampling (All" in n), None)
    executed = next((i for n, i in col.items() if n.startswith("Instructions Executed")), None)
    print("columns:", " | ".join(head))
    if samples is None and executed is None:
        raise SystemExit("no metric columns in this export")
    for title, idx in (("warp stall samples", samples), ("instructions executed", executed)):
        if idx is None:
            continue
        total = sum(number(r[idx]) for r in body) or 1.0
        print(f"\ntop {args.top} lines by {title} (total {total:,.0f})")
        for r in sorted(body, key=lambda r: -number(r[idx]))[: args.top]:
            where = r[line] if line is not None else ""
            print(f"{number(r[idx]) / total:6.1%}  {where:>5}  {r[src].strip()[:110]}")


if __name__ == "__main__":
    main()
