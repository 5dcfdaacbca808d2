#!/usr/bin/env bash
# Device-side: build decode_harness.cu for several tunings in parallel (sm_90a) and time each at the
# given N values. Usage: bash bench/harness/run_decode.sh [N ...]   (default 64 256 1024)
set -uo pipefail
ns=${*:-64 256 1024}
source bench/harness/nvcc_flags.sh
flags="$flags -Icsrc"
configs=("float:4,32,2" "float:4,64,1" "float:8,64,1" "__nv_bfloat16:4,32,3" "__nv_bfloat16:4,64,2"
         "__nv_bfloat16:4,64,3" "__nv_bfloat16:8,64,2" "__nv_bfloat16:8,128,1")
for c in "${configs[@]}"; do
  state=${c%%:*}; IFS=, read -r cw rows bps <<< "${c#*:}"
  nvcc $flags -DSTATE=$state -DCONSUMER_WARPS=$cw -DITEM_ROWS=$rows -DBLOCKS_PER_SM=$bps \
    bench/harness/decode_harness.cu -o "/tmp/dh_${state}_${cw}_${rows}_${bps}" > "/tmp/dh_${state}_${cw}_${rows}_${bps}.log" 2>&1 &
done
wait
for c in "${configs[@]}"; do
  state=${c%%:*}; tune=${c#*:}; bin="/tmp/dh_${state}_${tune//,/_}"  # same name as built above
  if [[ -x $bin ]]; then for n in $ns; do "$bin" "$n"; done; else echo "$c: build failed"; tail -3 "$bin.log"; fi
done
