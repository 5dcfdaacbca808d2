#!/usr/bin/env bash
# Device-side A/B of chunk_local_grad's gradients pass: the checked-out csrc and csrc with each patch
# applied (git diffs against the repository root), each built into local_grad_harness.cu for sm_90a
# in parallel, timed in turn twice (ABAB, so drift shows) at T = 8192, HV = 32 and 96 for each gate
# form in GATES (default channel; local_grad_harness.cu's forms, e.g. "channel scalar scalar-raw"),
# and each variant's gradients compared with the base's (compare_outputs.py).
# Timing and agreement only: a variant that wins still has to pass the GPU tests once applied.
#   bash bench/harness/ab_local_grad.sh [variant.patch ...]
set -uo pipefail
source bench/harness/ab_variants.sh
for i in "${!names[@]}"; do
  nvcc $flags -I"${dirs[$i]}" bench/harness/local_grad_harness.cu -o "/tmp/lg_ab_${names[$i]}" \
    > "/tmp/lg_ab_${names[$i]}.log" 2>&1 &
done
wait
for round in 1 2; do
  for name in "${names[@]}"; do
    if [[ ! -x /tmp/lg_ab_$name ]]; then [[ $round == 1 ]] && { echo "$name: build failed"; tail -3 "/tmp/lg_ab_$name.log"; }; continue; fi
    for gate in ${GATES:-channel}; do for hv in 32 96; do echo "$name $gate $(/tmp/lg_ab_$name 8192 $hv $gate)"; done; done
  done
done
for gate in ${GATES:-channel}; do
  [[ -x /tmp/lg_ab_base ]] && /tmp/lg_ab_base 8192 32 $gate /tmp/lg_ab_base.bin >/dev/null
  for name in "${names[@]:1}"; do
    [[ -x /tmp/lg_ab_$name ]] && /tmp/lg_ab_$name 8192 32 $gate "/tmp/lg_ab_$name.bin" >/dev/null \
      && echo "$name vs base ($gate): $(python3 bench/harness/compare_outputs.py /tmp/lg_ab_base.bin "/tmp/lg_ab_$name.bin" 8192 32 $gate)"
  done
done
