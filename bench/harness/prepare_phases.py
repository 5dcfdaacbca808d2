"""chunk_prepare's executed instructions and stall samples by phase, from an Nsight Compute profile.

The phases are those of phase_clocks.py (the kernel body cut at its MARKS lines). Each SASS
instruction of the profile takes the phase of the last kernel-body source line that `nvdisasm -g`
names at or before it, so code inlined from helpers counts where it is called.

    # device: the harness with line info, one profiled launch, the per-instruction export
    nvcc -std=c++17 -O3 -gencode arch=compute_90a,code=sm_90a --expt-relaxed-constexpr -lineinfo \\
         -Icsrc bench/harness/prepare_harness.cu -o prep
    ncu --section SourceCounters --section WarpStateStats -k regex:chunk_prepare -s 3 -c 1 -o prep ./prep 8192 96
    ncu -i prep.ncu-rep --page source --csv --print-source sass > prep_sass.csv
    # anywhere with nvdisasm: the same harness as a cubin (same compiler), then
    nvcc ... -lineinfo -Icsrc bench/harness/prepare_harness.cu -cubin -o prep.cubin
    nvdisasm -g -c prep.cubin > prep.sass
    python bench/harness/prepare_phases.py prep.sass prep_sass.csv --warps 98304   # T/64 * H * 8

Counts are per warp with --warps (the number of warps launched).
"""

from __future__ import annotations

import argparse
import collections
import csv
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from phase_clocks import MARKS  # noqa: E402

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "../../csrc/flashkda/prefill/chunk_prepare.cuh")
KERNEL = "chunk_prepare_kernel"


def phases(source: str):
    """(first line, label) of each phase of the kernel body, and the body's last line."""
    lines = open(source).read().split("\n")
    start = next(i for i, l in enumerate(lines) if KERNEL + "(" in l and "__global__" in l) + 1
    end = next(i for i in range(start, len(lines)) if lines[i] == "}") + 1
    cuts = [(start, "start")]
    for i in range(start, end):
        if any(lines[i - 1].startswith(m) for m in MARKS):
            cuts.append((i, lines[i - 1].strip()[:48]))
    return cuts, end


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("sass", help="nvdisasm -g -c output of the profiled binary")
    ap.add_argument("csv", help="ncu --page source --csv --print-source sass")
    ap.add_argument("--warps", type=float, default=1.0)
    ap.add_argument("--source", default=SOURCE)
    args = ap.parse_args()
    cuts, body_end = phases(args.source)
    name = os.path.basename(args.source)

    def phase_of(line: int) -> str:
        return [label for first, label in cuts if line >= first][-1]

    text = open(args.sass).read().split("\n")
    begin = next(i for i, l in enumerate(text) if l.startswith(".text.") and KERNEL in l)
    phase, where = cuts[0][1], {}
    for l in text[begin + 1:]:
        if l.startswith(".text."):
            break
        m = re.match(r'\s*//## File "(.*?)", line (\d+)', l)
        if m:
            if os.path.basename(m.group(1)) == name and cuts[0][0] <= int(m.group(2)) <= body_end:
                phase = phase_of(int(m.group(2)))
            continue
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/", l)
        if m:
            where[int(m.group(1), 16)] = phase

    rows = list(csv.reader(open(args.csv, newline="")))
    head_at = next(i for i, r in enumerate(rows) if "Address" in r)
    head = rows[head_at]
    body = [dict(zip(head, r)) for r in rows[head_at + 1:] if len(r) == len(head)]
    base = int(body[0]["Address"], 16)
    stalls = [h for h in head if h.startswith("stall_") and "Not Issued" not in h]
    agg = collections.defaultdict(collections.Counter)

    def num(x: str) -> float:
        return float(x.replace(",", "")) if x not in ("", "-") else 0.0

    for d in body:
        a = agg[where.get(int(d["Address"], 16) - base, "?")]
        a["instructions"] += num(d["Instructions Executed"])
        a["samples"] += num(d["Warp Stall Sampling (All Samples)"])
        for s in stalls:
            a[s] += num(d[s])
    total_i = sum(a["instructions"] for a in agg.values()) or 1.0
    total_s = sum(a["samples"] for a in agg.values()) or 1.0
    print(f"{'phase (starts after)':50} {'instr':>8} {'instr %':>7} {'samples %':>9}  largest stall reasons (% of all samples)")
    for _, label in cuts + [(0, "?")]:
        if label not in agg:
            continue
        a = agg[label]
        top = sorted(((a[s], s[len("stall_"):]) for s in stalls), reverse=True)[:3]
        print(f"{label:50} {a['instructions'] / args.warps:8.1f} {100 * a['instructions'] / total_i:7.1f} "
              f"{100 * a['samples'] / total_s:9.1f}  " + ", ".join(f"{n} {100 * v / total_s:.1f}" for v, n in top))
    print(f"{'total':50} {total_i / args.warps:8.1f}")


if __name__ == "__main__":
    main()
