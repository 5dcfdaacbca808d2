set -uo pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
(FLASHKDA_CUDA_ARCHS=90a MAX_JOBS=16 python3 setup.py -q build_ext --inplace >$OUT/build.log 2>&1 || tail -30 $OUT/build.log) &
[[ ${HARNESS:-1} == 1 ]] && bash bench/harness/run_prepare.sh > $OUT/harness.txt 2>&1
wait
[[ ${HARNESS:-1} == 1 ]] && cat $OUT/harness.txt
export PYTHONPATH=.:bench:tests:/tmp/site
python3 -m pytest -q tests/test_cuda_chunk.py -m "not slow" --tb=short -p no:cacheprovider -x 2>&1 | grep -v DEBUG | tail -15
python3 bench/prefill_quick.py --json $OUT/quick.json ${QUICK_ARGS:-} 2>&1 | grep -v -i warn
if [[ ${SANITIZE:-0} == 1 ]]; then
  for tool in memcheck racecheck; do
    compute-sanitizer --tool $tool --print-limit 5 python3 tests/sanitize_chunk.py 2>&1 | grep -E "SUMMARY|Race reported|Invalid|done" | head -8
  done
fi
