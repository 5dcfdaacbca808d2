#!/usr/bin/env bash
# Source-line hot spots of one kernel launch (the extension is built with -lineinfo):
#   bash bench/ncu_hotspots.sh [kernel regex, default chunk_prepare] [workload, default bench/ncu_chunk.py]
# Writes the report and the per-line CSV to $OUT and prints the lines with the most stall samples.
set -uo pipefail
OUT=${OUT:-/tmp/flashkda_out}; mkdir -p "$OUT"
kernel=${1:-chunk_prepare}; workload=${2:-bench/ncu_chunk.py}
ncu --clock-control none --set full --import-source yes -k "regex:$kernel" -c 1 -f -o "$OUT/hot" \
  python3 "$workload" >"$OUT/hot_run.log" 2>&1 || { tail -5 "$OUT/hot_run.log"; exit 1; }
ncu --import "$OUT/hot.ncu-rep" --page source --csv --print-source cuda >"$OUT/hot_cuda.csv" 2>"$OUT/hot_err.log" \
  || head -5 "$OUT/hot_err.log"
python3 bench/ncu_hotspots.py "$OUT/hot_cuda.csv"
