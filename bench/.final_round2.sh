set -uo pipefail
export PYTHONUNBUFFERED=1 FLA_FLASH_KDA=0 FLASHKDA_FLA_BACKEND=0
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl 2>/dev/null
FLASHKDA_CUDA_ARCHS=90a MAX_JOBS=16 PYTHONPATH=/tmp/site python3 setup.py -q build_ext --inplace >$OUT/build.log 2>&1 || { tail -30 $OUT/build.log; exit 1; }
export PYTHONPATH=.:bench:tests:/tmp/site
timeout 150 python3 -m pytest -q tests/test_cuda_decode_bulk.py tests/test_cuda_recurrent.py tests/test_fla_backend.py tests/test_reference.py tests/test_api.py -m "not slow" --tb=line -p no:cacheprovider > $OUT/tests.log 2>&1; tail -2 $OUT/tests.log | cut -c1-300
grep -E "^(FAILED|ERROR)" $OUT/tests.log | head -8 | cut -c1-250
timeout 100 python3 bench/diagnose.py > $OUT/diagnose.txt 2>&1; grep -v -i warn $OUT/diagnose.txt | tail -8
timeout 120 python3 -m pytest -q bench/test_decode.py -p no:cacheprovider --flashkda-results $OUT/decode.json --benchmark-disable-gc --benchmark-columns=median > $OUT/decode.txt 2>&1; tail -2 $OUT/decode.txt
python3 - <<'PY'
import json, os
recs = json.load(open(os.environ["OUT"] + "/decode.json"))
for r in recs: print(r["case"], r["impl"], round(r["median_ms"], 4), round(r["floor_ms"], 4), r.get("host_us", ""))
PY
