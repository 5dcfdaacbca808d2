#!/usr/bin/env bash
# One run on a GPU machine: build the extension for the arch in FLASHKDA_CUDA_ARCHS (default 90a),
# run the GPU tests and the benchmarks, and print a short table last. Wheels that the machine lacks
# (fla-core, nvidia-cutlass) are installed from .whl/ when present. Logs and JSON go to $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1 FLA_FLASH_KDA=0
OUT=${OUT:-/tmp/flashkda_out}; mkdir -p "$OUT"
# all | tests | bench | quick (TESTS, then bench/prefill_quick.py) | prefill (benchmark rows with the FLA
# baselines, no sweep) | check (every GPU test with a time limit per step, the 64-bit test, the C++
# example built by CMake, the sanitizers on the chunked path, decode kernel times by family with FLA,
# host overhead, and bench/prefill_quick.py on the benchmark rows: one call of about five minutes
# after the build; with
# DECODE_SWEEP=1 also bench/harness/run_decode.sh, with PREPARE_CLOCKS=1 bench/harness/run_prepare.sh)
# | ab (bench/harness/ab_prepare.sh on the chunk_prepare variants in PATCHES, or with AB_LIBRARY=1
# bench/harness/ab_library.sh on whole-library variants (DECODE=1: decode too; HOST=1: the eager
# host paths), PREPARE_CLOCKS=1 the tree's phase clocks; with AB_APPLY=one of them, that patch
# applied to the tree, then the chunk tests, the sanitizers and prefill_quick)
# | fla_warm (no build: FLA's training rows, FLA's half of bench/grad_accuracy.py and two steps of
# FLA's model (FLA_STEPS picks), each under FLA_LIMIT seconds (default 170: the three stay within a
# 600 s call), FLA_K a pytest -k expression for the rows, compiling FLA's Triton kernels into the
# saved cache)
# | e2e (TESTS, by default the FLA-convention and backend tests without fla_compile, then
# bench/fla_dispatch.py and bench/e2e_fla_model.py: FLA's KDAForCausalLM with and without flashkda)
# | train (TESTS, by default the autograd, API and FLA backend tests, then bench/grad_accuracy.py,
# under GRAD_LIMIT seconds (default 150, in which a machine without FLA's Triton cache did not reach
# the varlen rows), bench/test_train.py (GRAD_IMPLS, TRAIN_K pick impls and rows), SANITIZE=1 the
# sanitizers, and, unless MODEL=0, bench/train_fla_model.py; FLA_PROFILE=1 also profiles FLA's GDN
# row (bench/train_profile.py); with HARNESS=1 first bench/harness/run_local_grad.sh, the backward's
# gradients pass alone with its phase clocks) | fla (the tests that run FLA's Triton kernels, marked
# fla_compile, or with FLA_MARK="" the whole
# backend file, then the prefill rows with the FLA baselines) | profile (bench/ncu_hotspots.sh on
# chunk_prepare, chunk_recurrence and the sm_90 decode kernel) | prefix (prefix caching: the
# required cases of bench/test_prefill.py with the plain call and FLA's flagged call, then
# bench/prefix_variants.py) | sanitize (memcheck and racecheck of tests/sanitize_chunk.py, each under
# SANITIZE_LIMIT seconds, default 150).
# FLA's Triton kernels compile (and autotune) on first use: minutes on a fresh machine (one test
# took 205 s). A Triton cache from an earlier run, carried as .cache/triton.tar.xz.NN (git-ignored:
# name .cache in the device call's carry), is unpacked first. Every run leaves its cache in
# $OUT/triton.tar.xz.NN, to be copied to .cache/ for the next one: compiled binaries, metadata and
# autotuning results only (Triton loads a cached kernel through its group file, which skips the
# missing IR files; the cache dir is the same path on every machine), xz-compressed, in parts of
# 15 MiB (the largest file that comes back is 16 MiB).
what=${1:-all}
export TRITON_CACHE_DIR=/tmp/triton_cache TRITON_CACHE_AUTOTUNING=1
mkdir -p "$TRITON_CACHE_DIR"
compgen -G ".cache/triton.tar.xz.*" >/dev/null && cat .cache/triton.tar.xz.* | tar -xJf - -C "$TRITON_CACHE_DIR"
# FLA's autotuning winners of this run (bench/fla_autotune.py) also come back, as $OUT/fla_autotune.json:
# bench/results/fla_autotune.json with them merged in, to be committed.
save_triton_cache() {
  rm -f "$OUT"/triton.tar.xz.*
  (cd "$TRITON_CACHE_DIR" && find . -type f ! -name '*.ttir' ! -name '*.ttgir' ! -name '*.llir' ! -name '*.ptx' \
    ! -name '*.source' -print0 | tar --null -T - -I 'xz -T0' -cf -) | split -b 15m -d - "$OUT/triton.tar.xz."
  python3 bench/fla_autotune.py record "$TRITON_CACHE_DIR" --out "$OUT/fla_autotune.json" \
    --gpu "$(python3 -c 'import torch; print(torch.cuda.get_device_name())')" | tail -1
}
trap save_triton_cache EXIT
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
t0=$(date +%s)
if [[ $what != fla_warm ]]; then
  FLASHKDA_CUDA_ARCHS=${FLASHKDA_CUDA_ARCHS:-90a} MAX_JOBS=${MAX_JOBS:-16} \
    python3 setup.py -q build_ext --inplace >"$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
  echo "build: $(( $(date +%s) - t0 )) s"
fi
rc=0
# memcheck and racecheck on tests/sanitize_chunk.py (every path of the chunked kernels, the
# backward's included), each stopped after $1 seconds; the findings also in $OUT/sanitize.txt.
run_sanitizers() {
  local tool status
  for tool in memcheck racecheck; do
    PYTHONPATH=.:tests${PYTHONPATH:+:$PYTHONPATH} timeout "$1" compute-sanitizer --tool $tool --print-limit 5 \
      python3 tests/sanitize_chunk.py >"$OUT/$tool.log" 2>&1
    status=$?
    { grep -E "SUMMARY|Race reported|Invalid|access at" "$OUT/$tool.log" | head -12
      (( status == 124 )) && echo "$tool: stopped after $1 s"; } | tee -a "$OUT/sanitize.txt" | head -3
  done
}
if [[ $what == sanitize ]]; then
  run_sanitizers ${SANITIZE_LIMIT:-150}
fi
if [[ $what == fla_warm ]]; then
  # FLA's Triton kernels for the training benchmarks, compiled (and autotuned) into the cache that
  # the EXIT trap saves, with no build beside them: FLA's training rows (timed: nothing else runs),
  # FLA's half of bench/grad_accuracy.py, two steps of FLA's model. Each step under its own limit
  # (FLA_LIMIT, seconds), so that a slow compile still leaves the cache of the others.
  export PYTHONPATH=.:bench:tests${PYTHONPATH:+:$PYTHONPATH}
  # The cache is saved after each step too: a call stopped by the machine's own limit runs no trap.
  # pytest's faulthandler prints where a row still is after FLA_LIMIT - 20 seconds.
  # FLA_STEPS picks among rows, grad, model; FLA_AUTOTUNE_WATCH (seconds, default 60) prints each
  # config FLA's autotuners time (the rows' full log: $OUT/fla_rows.log) and the stack of one that
  # takes longer.
  steps=" ${FLA_STEPS:-rows grad model} "
  export FLA_AUTOTUNE_WATCH=${FLA_AUTOTUNE_WATCH:-60}
  if [[ $steps == *" rows "* ]]; then
    FLASHKDA_FLA_BACKEND=0 timeout ${FLA_LIMIT:-170} \
      python3 -m pytest -q -s bench/test_train.py -k "not flashkda ${FLA_K:+and ($FLA_K)}" \
      -o faulthandler_timeout=$(( ${FLA_LIMIT:-170} - 20 )) \
      -p no:cacheprovider --flashkda-results "$OUT/train_fla.json" --benchmark-disable-gc >"$OUT/fla_rows.log" 2>&1
    grep -v -i warn "$OUT/fla_rows.log" | tail -40 | cut -c1-240
    save_triton_cache
  fi
  if [[ $steps == *" grad "* ]]; then  # SIGABRT at the limit: Python's faulthandler prints where each thread was.
    timeout -s ABRT ${FLA_LIMIT:-170} python3 -X faulthandler bench/grad_accuracy.py --impls fla --json "$OUT/grad_fla.json" \
      2>&1 | grep -v -i warn | tail -30
    save_triton_cache
  fi
  [[ $steps == *" model "* ]] && timeout -s ABRT ${FLA_LIMIT:-170} python3 -X faulthandler bench/train_fla_model.py --warm \
    2>&1 | grep -v -i warn | tail -30
  echo "fla_warm: $(( $(date +%s) - t0 )) s"
fi
if [[ $what == all || $what == tests ]]; then
  python3 -m pytest -q -x ${TESTS:-tests/} -p no:cacheprovider 2>&1 | tee "$OUT/tests.log" | tail -25 || rc=1
  python3 -m flashkda 2>&1 | tee "$OUT/main.log" || rc=1
fi
if [[ $what == quick ]]; then
  python3 -m pytest -q ${TESTS:-tests/test_cuda_chunk.py} -m "not slow" --tb=line -p no:cacheprovider 2>&1 \
    | grep -v DEBUG | tail -25 || rc=1
  if [[ ${SANITIZE:-0} == 1 ]]; then  # memcheck + racecheck on a small varlen case of every kernel path
    run_sanitizers 120
  fi
  PYTHONPATH=.:bench${PYTHONPATH:+:$PYTHONPATH} python3 bench/prefill_quick.py --json "$OUT/quick.json" ${QUICK_ARGS:-} \
    2>&1 | grep -v -i warn || rc=1
  [[ ${HOTSPOTS:-0} == 1 ]] && PYTHONPATH=.:bench${PYTHONPATH:+:$PYTHONPATH} bash bench/ncu_hotspots.sh chunk_prepare
fi
if [[ $what == check ]]; then
  export PYTHONPATH=.:bench:tests${PYTHONPATH:+:$PYTHONPATH}
  # -v: one line per test, so a run cut by the time limit still names what failed and where it stopped.
  timeout ${TEST_LIMIT:-240} python3 -m pytest -v tests/ -m "not slow and not fla_compile" --tb=line -p no:cacheprovider \
    >"$OUT/tests.log" 2>&1
  grep -cE " PASSED " "$OUT/tests.log"; tail -1 "$OUT/tests.log" | cut -c1-300
  grep -E " (FAILED|ERROR) |^(FAILED|ERROR)" "$OUT/tests.log" | sort -u | head -12 | cut -c1-250
  timeout 90 python3 -m pytest -q -m slow tests/test_cuda_chunk.py -p no:cacheprovider 2>&1 | tail -1
  # the library from C++ alone (CMake): a varlen prefill and a decode step against a host recurrence
  { cmake -S . -B build/cmake -DCMAKE_CUDA_ARCHITECTURES=90a >/dev/null \
      && cmake --build build/cmake -j 16 --target flashkda_prefill_decode >"$OUT/cmake.log" 2>&1 \
      && timeout 60 ./build/cmake/flashkda_prefill_decode; } 2>&1 | tail -3
  run_sanitizers 120
  FLASHKDA_FLA_BACKEND=0 timeout 150 python3 bench/diagnose.py 2>&1 | grep -v -i warn | tail -8
  FLASHKDA_FLA_BACKEND=0 timeout 60 python3 bench/host_profile.py 2>&1 | tail -11
  timeout 200 python3 bench/prefill_quick.py --splits 0 --segments "${SEGMENTS:-0,16,32,64}" --json "$OUT/quick.json" 2>&1 | grep -v -i warn
  [[ ${DECODE_SWEEP:-0} == 1 ]] && timeout 300 bash bench/harness/run_decode.sh
  [[ ${PREPARE_CLOCKS:-0} == 1 ]] && timeout 200 bash bench/harness/run_prepare.sh
fi
if [[ $what == ab ]]; then  # chunk_prepare variants: PATCHES (carried, e.g. in .cache) timed against the tree
  if [[ ${AB_LIBRARY:-0} == 1 ]]; then
    bash bench/harness/ab_library.sh ${PATCHES:-} 2>&1 | tee "$OUT/ab.txt"
  else
    bash bench/harness/ab_prepare.sh ${PATCHES:-} 2>&1 | tee "$OUT/ab.txt"
  fi
  [[ ${PREPARE_CLOCKS:-0} == 1 ]] && timeout 200 bash bench/harness/run_prepare.sh 2>&1 | tee "$OUT/clocks.txt"
  # then one variant through the GPU tests: AB_APPLY=patch, or AB_APPLY=tree for the tree as it is
  if [[ -n ${AB_APPLY:-} ]] && { [[ $AB_APPLY == tree ]] || patch -s -p1 < "$AB_APPLY"; }; then
    export PYTHONPATH=.:bench:tests${PYTHONPATH:+:$PYTHONPATH}
    if [[ $AB_APPLY != tree ]]; then
      touch csrc/kernels/*.cu
      FLASHKDA_CUDA_ARCHS=${FLASHKDA_CUDA_ARCHS:-90a} MAX_JOBS=${MAX_JOBS:-16} \
        python3 setup.py -q build_ext --inplace >"$OUT/build_ab.log" 2>&1 || { tail -20 "$OUT/build_ab.log"; exit 1; }
    fi
    timeout ${TEST_LIMIT:-120} python3 -m pytest -q ${TESTS:-tests/test_cuda_chunk.py} -m "not slow" --tb=line -p no:cacheprovider \
      2>&1 | tail -2
    run_sanitizers 120
    timeout 120 python3 bench/prefill_quick.py --splits 0 --json "$OUT/quick.json" 2>&1 | grep -v -i warn
  fi
fi
if [[ $what == profile ]]; then  # Nsight Compute: stall reasons and hot lines (printed; reports stay on the machine)
  export PYTHONPATH=.:bench${PYTHONPATH:+:$PYTHONPATH}
  for k in chunk_prepare chunk_recurrence; do
    OUT=/tmp/profile/$k timeout 200 bash bench/ncu_hotspots.sh "$k" bench/ncu_chunk.py 2>&1 | head -60
  done
  OUT=/tmp/profile/decode timeout 200 bash bench/ncu_hotspots.sh decode_step_bulk bench/ncu_decode.py 2>&1 | head -60
  # the backward's gradients pass (its first launch: train_profile.py's warm-up step, T = 8192, H = 32)
  OUT=/tmp/profile/bwd NCU_NAME_BASE=demangled timeout 300 bash bench/ncu_hotspots.sh 'Pass\)1>' \
    bench/train_profile.py 2>&1 | head -60
fi
if [[ $what == fla ]]; then
  export PYTHONPATH=.:bench:tests${PYTHONPATH:+:$PYTHONPATH}
  timeout ${TEST_LIMIT:-400} python3 -m pytest -q tests/test_fla_backend.py -m "${FLA_MARK-fla_compile}" --tb=short -p no:cacheprovider \
    --durations=3 2>&1 | tail -6
fi
if [[ $what == prefill || $what == fla ]]; then
  # PREFILL_MARK="" also runs the T sweep (marked sweep) and draws its plot.
  # PREFILL_K: a pytest -k expression (e.g. the cases a run cut short by BENCH_LIMIT did not reach).
  FLASHKDA_FLA_BACKEND=0 timeout ${BENCH_LIMIT:-300} python3 -m pytest -q bench/test_prefill.py -m "${PREFILL_MARK-not sweep}" \
    ${PREFILL_K:+-k "$PREFILL_K"} \
    -p no:cacheprovider --flashkda-results "$OUT/results.json" --benchmark-disable-gc --benchmark-columns=median 2>&1 | tail -3
  python3 bench/report.py "$OUT/results.json" --markdown "$OUT/table.md" \
    ${PREFILL_MARK+--plot "$OUT/prefill_vs_T.png"} || rc=1
fi
if [[ $what == prefix ]]; then
  FLASHKDA_FLA_BACKEND=0 timeout ${BENCH_LIMIT:-200} python3 -m pytest -q bench/test_prefill.py -k prefix -p no:cacheprovider \
    --flashkda-results "$OUT/results.json" --benchmark-disable-gc --benchmark-columns=median 2>&1 | tail -1
  FLASHKDA_FLA_BACKEND=0 PYTHONPATH=.:bench${PYTHONPATH:+:$PYTHONPATH} timeout 120 python3 bench/prefix_variants.py \
    2>&1 | grep -v -i warn
  python3 bench/report.py "$OUT/results.json" --markdown "$OUT/table.md" >/dev/null && cat "$OUT/table.md" || rc=1
fi
if [[ $what == e2e ]]; then  # the FLA drop-in: TESTS, FLA's dispatch host cost, FLA's KDA model end to end
  export PYTHONPATH=.:bench:tests${PYTHONPATH:+:$PYTHONPATH}
  timeout ${TEST_LIMIT:-240} python3 -m pytest -q ${TESTS:-tests/test_fla_conventions.py tests/test_fla_backend.py} \
    -m "${TEST_MARK-not slow and not fla_compile}" ${TEST_K:+-k "$TEST_K"} --tb=short -p no:cacheprovider 2>&1 | tail -12
  timeout 150 python3 bench/fla_dispatch.py --json "$OUT/dispatch.json" 2>&1 | grep -v -i warn | tail -4
  timeout ${E2E_LIMIT:-360} python3 bench/e2e_fla_model.py --json "$OUT/e2e.json" ${E2E_ARGS:-} 2>&1 \
    | grep -v -i warn | tail -14
fi
if [[ $what == train ]]; then  # training: gradient tests, gradient accuracy, fwd+bwd rows, FLA's model trained
  export PYTHONPATH=.:bench:tests${PYTHONPATH:+:$PYTHONPATH}  # every step's log also in $OUT (a time-out keeps it)
  [[ ${HARNESS:-0} == 1 ]] && timeout 120 bash bench/harness/run_local_grad.sh 2>&1 | tail -24 | tee "$OUT/local_grad.txt"
  timeout 120 python3 bench/train_profile.py 2>&1 | grep -v -i warn | tee "$OUT/train_profile.txt" | head -30
  timeout 120 python3 bench/train_profile.py --case train_gdn_T8k_H32 --top 10 2>&1 | grep -v -i warn \
    | tee "$OUT/train_profile_gdn.txt" | head -20
  # FLA_PROFILE=1: FLA's GDN row by kernel too, its kernel time beside its step time (compiles FLA's kernels)
  [[ ${FLA_PROFILE:-0} == 1 ]] && timeout 240 python3 bench/train_profile.py --case train_gdn_T8k_H32 --impl fla --top 10 \
    2>&1 | grep -v -i warn | tee "$OUT/train_profile_gdn_fla.txt" | tail -16
  timeout ${TEST_LIMIT:-300} python3 -m pytest -q ${TESTS:-tests/test_autograd.py tests/test_api.py tests/test_fla_backend.py} \
    -m "${TEST_MARK-not slow}" ${TEST_K:+-k "$TEST_K"} --tb=short -p no:cacheprovider >"$OUT/train_tests.log" 2>&1
  tail -3 "$OUT/train_tests.log" | cut -c1-300; grep -E "^(FAILED|ERROR)" "$OUT/train_tests.log" | head -12 | cut -c1-300
  timeout ${GRAD_LIMIT:-150} python3 bench/grad_accuracy.py --impls "${GRAD_IMPLS:-flashkda,fla}" --json "$OUT/grad.json" 2>&1 | grep -v -i warn | tee "$OUT/grad.txt"
  FLASHKDA_FLA_BACKEND=0 timeout ${BENCH_LIMIT:-240} python3 -m pytest -q bench/test_train.py ${TRAIN_K:+-k "$TRAIN_K"} \
    -o faulthandler_timeout=$(( ${BENCH_LIMIT:-240} - 20 )) -p no:cacheprovider --flashkda-results "$OUT/train.json" --benchmark-disable-gc 2>&1 | tail -2
  python3 bench/report.py "$OUT/train.json" --markdown "$OUT/train_table.md" >/dev/null && cat "$OUT/train_table.md"
  if [[ ${SANITIZE:-0} == 1 ]]; then  # memcheck + racecheck on every kernel path, the backward's included
    run_sanitizers 150
  fi
  [[ ${MODEL:-1} == 1 ]] && timeout ${E2E_LIMIT:-300} python3 bench/train_fla_model.py --json "$OUT/train_model.json" \
    ${E2E_ARGS:-} 2>&1 | grep -v -i warn | tee "$OUT/train_model.txt" | tail -6
fi
if [[ $what == all || $what == bench ]]; then
  # FLASHKDA_FLA_BACKEND=0: the FLA baselines must run FLA itself, not flashkda registered inside it.
  FLASHKDA_FLA_BACKEND=0 python3 -m pytest -q bench/ -p no:cacheprovider --flashkda-results "$OUT/results.json" \
    --benchmark-disable-gc --benchmark-columns=median 2>&1 | tail -5
  FLASHKDA_FLA_BACKEND=0 PYTHONPATH=.:bench${PYTHONPATH:+:$PYTHONPATH} python3 bench/host_profile.py || rc=1
  FLASHKDA_FLA_BACKEND=0 PYTHONPATH=.:bench${PYTHONPATH:+:$PYTHONPATH} python3 bench/diagnose.py | tee "$OUT/graph.txt" || rc=1
  python3 bench/report.py "$OUT/results.json" --markdown "$OUT/table.md" --plot "$OUT/prefill_vs_T.png" || rc=1
fi
exit $rc
