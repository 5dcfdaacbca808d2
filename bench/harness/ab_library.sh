#!/usr/bin/env bash
# Device-side A/B timing of whole-library variants: a copy of the checked-out tree and one with each
# patch applied (git diffs against the repository root), each built as its own extension for
# sm_90a in parallel, then bench/prefill_quick.py run from each tree in turn, twice, the second
# time in reverse order (so that drift and the order show): end to end and per kernel, lower-bound
# gate, no segments. Use it when a change touches
# both kernels (a record layout), where ab_prepare.sh sees only one side. Timing only: a variant
# that wins still has to pass the GPU tests after it is applied.
#   bash bench/harness/ab_library.sh [variant.patch ...]
# DECODE=1 also times the decode kernels of each tree (bench/diagnose.py --no-fla: CUDA-graph kernel
# time per call, fp32 pools at every N and a bf16 pool, default and sm_80 families) for a change
# that reaches them. HOST=1 also runs bench/host_profile.py in each tree (host µs of an eager decode
# call and of a small prefill call, their parts, and their CUDA-event times) for a change to an
# eager path. TRAIN=1 also times training calls in each tree: their kernels (bench/train_profile.py,
# the KDA and GDN rows at T = 8192, H = 32) and those two rows' forward + backward (bench/test_train.py).
# ROWS (environment) overrides the rows; the nvidia-cutlass wheel must be importable
# for the builds (PYTHONPATH), as for any build of the extension.
set -uo pipefail
rows=${ROWS:-varlen_1024x8_H96,fixed_8k_H96,fixed_32k_H8,fixed_8k_H64}
# Every tree, the checked-out one ("base") included, is a fresh copy under /tmp/ab_library, built
# the same way, so that no tree runs from another directory or an older build.
names=() dirs=()
for variant in base "$@"; do
  name=$(basename "$variant" .patch)
  dir=/tmp/ab_library/$name
  rm -rf "$dir" && mkdir -p "$dir"
  tar -c --exclude=./.git --exclude=./build --exclude='*.so' --exclude=./.cache --exclude=./.whl . | tar -x -C "$dir"
  if [[ $variant == base ]] || patch -s -p1 -d "$dir" < "$variant"; then
    names+=("$name") dirs+=("$dir")
  else
    echo "$name: patch failed"
  fi
done
jobs_each=$(( $(nproc) / ${#names[@]} )); (( jobs_each < 1 )) && jobs_each=1
for i in "${!names[@]}"; do
  (cd "${dirs[$i]}" && FLASHKDA_CUDA_ARCHS=90a MAX_JOBS=$jobs_each python3 setup.py -q build_ext --inplace \
     > "/tmp/ab_library_${names[$i]}.log" 2>&1) &
done
wait
for i in "${!names[@]}"; do
  if ! ls "${dirs[$i]}"/flashkda/_C*.so > /dev/null 2>&1; then
    echo "${names[$i]}: build failed"; tail -5 "/tmp/ab_library_${names[$i]}.log"; exit 1
  fi
done
forward=("${!names[@]}") backward=()
for i in "${forward[@]}"; do backward=("$i" "${backward[@]}"); done
for round in 1 2; do
  order=("${forward[@]}"); (( round == 2 )) && order=("${backward[@]}")
  for i in "${order[@]}"; do
    echo "== ${names[$i]}, round $round"
    (cd "${dirs[$i]}" && PYTHONPATH="${PYTHONPATH:-}:.:bench" python3 bench/prefill_quick.py --rows "$rows" \
       --splits 0 --no-accuracy 2>&1 | grep "lb/split0")
    if [[ ${DECODE:-0} == 1 ]]; then
      (cd "${dirs[$i]}" && PYTHONPATH="${PYTHONPATH:-}:.:bench" python3 bench/diagnose.py --no-fla 2>&1 | grep -v -i warn \
         | tail -n +2)
    fi
    if [[ ${HOST:-0} == 1 ]]; then
      (cd "${dirs[$i]}" && PYTHONPATH="${PYTHONPATH:-}:.:bench" python3 bench/host_profile.py 2>&1 | grep -v -i warn)
    fi
    if [[ ${TRAIN:-0} == 1 ]]; then  # training calls: kernels by GPU time and the T = 8192, H = 32 rows
      for case in train_T8k_H32 train_gdn_T8k_H32; do
        (cd "${dirs[$i]}" && PYTHONPATH="${PYTHONPATH:-}:.:bench" python3 bench/train_profile.py --case $case --top 10 \
           2>&1 | grep -E "chunk_|Self CUDA|: kernels ")
      done
      results=/tmp/ab_library_train_${names[$i]}_$round.json
      (cd "${dirs[$i]}" && FLASHKDA_FLA_BACKEND=0 PYTHONPATH="${PYTHONPATH:-}:.:bench" python3 -m pytest -q -s \
         bench/test_train.py -k "flashkda and (gdn or T8k_H32)" -p no:cacheprovider --flashkda-results "$results" \
         --benchmark-disable-gc > /dev/null 2>&1 \
         && PYTHONPATH="${PYTHONPATH:-}:.:bench" python3 bench/report.py "$results" --markdown /dev/stdout | grep "^| train_")
    fi
  done
done
