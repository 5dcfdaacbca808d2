#!/usr/bin/env bash
# Where one kernel launch spends its time (the extension is built with -lineinfo):
#   bash bench/ncu_hotspots.sh [kernel regex, default chunk_prepare] [workload, default bench/ncu_chunk.py]
# The regex matches the function's name without template arguments, or with NCU_NAME_BASE=demangled
# the whole demangled name (to tell instantiations apart, e.g. the backward's two passes).
# Writes the report and the per-line / per-instruction CSVs to $OUT, then prints the stall reasons
# (warp cycles per issued instruction, by reason) and the source lines with the most stall samples.
set -uo pipefail
OUT=${OUT:-/tmp/flashkda_out}; mkdir -p "$OUT"
kernel=${1:-chunk_prepare}; workload=${2:-bench/ncu_chunk.py}
ncu --clock-control none --set full --import-source yes --kernel-name-base "${NCU_NAME_BASE:-function}" \
  -k "regex:$kernel" -c 1 -f -o "$OUT/hot" \
  python3 "$workload" >"$OUT/hot_run.log" 2>&1 || { tail -5 "$OUT/hot_run.log"; exit 1; }
ncu --import "$OUT/hot.ncu-rep" --page raw --csv >"$OUT/hot_raw.csv" 2>/dev/null
python3 - "$OUT/hot_raw.csv" <<'PY'
import csv, sys
rows = list(csv.reader(open(sys.argv[1])))
if len(rows) >= 3:
    head, vals = rows[0], rows[2]
    stalls = [(h, v) for h, v in zip(head, vals) if "issue_stalled" in h and h.endswith("per_issue_active.ratio")]
    def num(v):
        try: return float(v.replace(",", ""))
        except ValueError: return 0.0
    print("stall reasons (warp cycles per issued instruction):")
    for h, v in sorted(stalls, key=lambda x: -num(x[1]))[:12]:
        print(f"  {num(v):7.2f}  {h.split('issue_stalled_')[1].split('_per_issue')[0]}")
PY
for view in cuda sass; do
  ncu --import "$OUT/hot.ncu-rep" --page source --csv --print-source "$view" >"$OUT/hot_$view.csv" 2>"$OUT/hot_err.log" \
    || head -5 "$OUT/hot_err.log"
done
python3 bench/ncu_hotspots.py "$OUT/hot_cuda.csv" --top "${TOP:-15}" || python3 bench/ncu_hotspots.py "$OUT/hot_sass.csv" --top "${TOP:-15}"
