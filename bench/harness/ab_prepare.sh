#!/usr/bin/env bash
# Device-side A/B timing of chunk_prepare variants: the checked-out csrc and csrc with each patch
# applied (git diffs against the repository root), each built into prepare_harness.cu for sm_90a
# in parallel, then timed in turn, twice (ABAB, so drift shows) at T = 8192 and H = 96, 64, 16.
# Timing only: a variant that wins still has to pass the GPU tests after it is applied.
#   bash bench/harness/ab_prepare.sh [variant.patch ...]
set -uo pipefail
source bench/harness/ab_variants.sh
for i in "${!names[@]}"; do
  nvcc $flags -I"${dirs[$i]}" bench/harness/prepare_harness.cu -o "/tmp/ab_${names[$i]}" > "/tmp/ab_${names[$i]}.log" 2>&1 &
done
wait
for round in 1 2; do
  for name in "${names[@]}"; do
    if [[ ! -x /tmp/ab_$name ]]; then [[ $round == 1 ]] && { echo "$name: build failed"; tail -3 "/tmp/ab_$name.log"; }; continue; fi
    for h in 96 64 16; do echo "$name $(/tmp/ab_$name 8192 $h)"; done
  done
done
