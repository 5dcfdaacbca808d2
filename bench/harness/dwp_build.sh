#!/usr/bin/env bash
# usage: dwp_build.sh outdir cfg...   cfg = STATE:ROWS:WARPS:MINB[:NOMATH[:STRIDED[:ITEMS_PER_TOKEN[:L2HINT[:DBUF]]]]]
out=$1; shift
for c in "$@"; do IFS=: read -r st r w b nm sr mt lh db <<< "$c"
  nvcc -std=c++17 -O3 -Icsrc -gencode arch=compute_90a,code=sm_90a -Xptxas -v --expt-relaxed-constexpr -DSTATE=$st -DROWS=$r -DWARPS=$w -DMINB=$b -DNOMATH=${nm:-0} -DSTRIDED=${sr:-0} -DITEMS_PER_TOKEN=${mt:-1} -DL2HINT=${lh:-0} -DDBUF=${db:-0} bench/harness/decode_warp_probe.cu -o $out/dwp_${st}_${r}_${w}_${b}_${nm:-0}_${sr:-0}_${mt:-1}_${lh:-0}_${db:-0} > $out/dwp_${st}_${r}_${w}_${b}_${nm:-0}_${sr:-0}_${mt:-1}_${lh:-0}_${db:-0}.log 2>&1 &
done; wait
for c in "$@"; do IFS=: read -r st r w b nm sr mt lh db <<< "$c"; echo "$c: $(grep -A2 'decode_warp' $out/dwp_${st}_${r}_${w}_${b}_${nm:-0}_${sr:-0}_${mt:-1}_${lh:-0}_${db:-0}.log | grep -o 'Used [0-9]* registers\|[0-9]* bytes spill stores' | tr '\n' ' ')"; done
