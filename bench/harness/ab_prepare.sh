#!/usr/bin/env bash
# Device-side A/B timing of chunk_prepare variants: the checked-out csrc and csrc with each patch
# applied (git diffs against the repository root), each built into prepare_harness.cu for sm_90a
# in parallel, then timed in turn, twice (ABAB, so drift shows) at T = 8192 and H = 96, 64, 16.
# Timing only: a variant that wins still has to pass the GPU tests after it is applied.
#   bash bench/harness/ab_prepare.sh [variant.patch ...]
set -uo pipefail
# CuTe/CUTLASS headers: where setup.py finds them (CUTLASS_HOME, third_party/cutlass, the wheel).
cutlass=$(python3 -c "import setup; print(setup.find_cutlass_include())") || exit 1
flags="-std=c++17 -O3 -I$cutlass -gencode arch=compute_90a,code=sm_90a --expt-relaxed-constexpr"
names=(base) dirs=(csrc)
for patch in "$@"; do
  name=$(basename "$patch" .patch) dir=/tmp/ab/$name
  rm -rf "$dir" && mkdir -p "$dir" && cp -r csrc "$dir/"
  if patch -s -p1 -d "$dir" < "$patch"; then names+=("$name") dirs+=("$dir/csrc"); else echo "$name: patch failed"; fi
done
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
