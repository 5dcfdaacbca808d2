set -uo pipefail
export PYTHONUNBUFFERED=1 FLA_FLASH_KDA=0
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl 2>/dev/null
t0=$(date +%s)
FLASHKDA_CUDA_ARCHS=90a MAX_JOBS=16 PYTHONPATH=/tmp/site python3 setup.py -q build_ext --inplace >$OUT/build.log 2>&1 || { tail -30 $OUT/build.log; exit 1; }
echo "build $(( $(date +%s) - t0 )) s"
export PYTHONPATH=.:bench:tests:/tmp/site
timeout 200 python3 -m pytest -q tests/ -m "not slow" --tb=line -p no:cacheprovider > $OUT/tests.log 2>&1; tail -4 $OUT/tests.log | cut -c1-300
grep -E "^(FAILED|ERROR)|Error" $OUT/tests.log | head -12 | cut -c1-300
timeout 60 python3 -m pytest -q -m slow tests/test_cuda_chunk.py::test_64bit_offsets -p no:cacheprovider 2>&1 | tail -1
for tool in memcheck racecheck; do timeout 60 compute-sanitizer --tool $tool --print-limit 5 python3 tests/sanitize_chunk.py 2>&1 | grep -E "SUMMARY|Race reported|Invalid" | head -3; done
timeout 60 compute-sanitizer --tool memcheck --print-limit 5 python3 -m pytest -q -x tests/test_cuda_decode_bulk.py -k "agree" -p no:cacheprovider 2>&1 | grep -E "SUMMARY|Invalid|passed|failed" | head -3
timeout 120 python3 bench/diagnose.py > $OUT/diagnose.txt 2>&1; grep -v -i warn $OUT/diagnose.txt | tail -9
FLASHKDA_FLA_BACKEND=0 timeout 60 python3 bench/host_profile.py > $OUT/host.txt 2>&1; tail -12 $OUT/host.txt
timeout 150 python3 bench/prefill_quick.py --splits 0 --json $OUT/quick.json > $OUT/quick.txt 2>&1; grep -v -i warn $OUT/quick.txt
