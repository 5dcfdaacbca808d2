#!/usr/bin/env bash
# Device-side: build prepare_harness for sm_90a from csrc (plain and with phase clocks) and run it.
#   bash bench/harness/run_prepare.sh [csrc dir, default csrc]
set -euo pipefail
src=${1:-csrc}
source bench/harness/nvcc_flags.sh
python3 bench/harness/phase_clocks.py "$src" /tmp/pc/csrc prepare
nvcc $flags -I"$src" bench/harness/prepare_harness.cu -o /tmp/prep_plain &
nvcc $flags -I/tmp/pc/csrc -DPHASE_CLOCKS bench/harness/prepare_harness.cu -o /tmp/prep_clocks &
wait
for shape in "8192 96" "8192 16"; do /tmp/prep_plain $shape; done
/tmp/prep_clocks 8192 96
