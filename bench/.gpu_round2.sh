set -uo pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site
t0=$(date +%s)
FLASHKDA_CUDA_ARCHS=90a MAX_JOBS=16 python3 setup.py -q build_ext --inplace >$OUT/build.log 2>&1 || { tail -30 $OUT/build.log; exit 1; }
echo "build $(( $(date +%s) - t0 )) s"
export PYTHONPATH=.:bench:tests:/tmp/site
timeout 400 python3 -m pytest -q -x tests/test_cuda_decode_bulk.py tests/test_cuda_recurrent.py --tb=short -p no:cacheprovider 2>&1 | grep -v -i "warn\|DEBUG" | tail -15
timeout 200 python3 -m pytest -q -x tests/test_cuda_chunk.py -m "not slow" --tb=short -p no:cacheprovider 2>&1 | tail -2
timeout 120 python3 bench/diagnose.py --no-fla
timeout 120 compute-sanitizer --tool memcheck --print-limit 5 python3 -m pytest -q -x tests/test_cuda_decode_bulk.py -p no:cacheprovider 2>&1 | grep -E "SUMMARY|Invalid|passed|failed" | head
ncu --clock-control none --metrics regex:smsp__average_warps_issue_stalled_.*_per_issue_active.ratio,smsp__issue_active.avg.pct_of_peak_sustained_active -k regex:chunk_recurrence -c 1 python3 bench/ncu_chunk.py > $OUT/ncu_rec.txt 2>&1
grep -E "stalled|issue_active" $OUT/ncu_rec.txt | sort -k3 -n -r | head -14
