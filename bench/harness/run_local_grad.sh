#!/usr/bin/env bash
# Device-side: build local_grad_harness for sm_90a from csrc (plain and with phase clocks) and run it.
#   bash bench/harness/run_local_grad.sh [csrc dir, default csrc]
set -euo pipefail
src=${1:-csrc}
source bench/harness/nvcc_flags.sh
python3 bench/harness/phase_clocks.py "$src" /tmp/lgc/csrc local_grad
nvcc $flags -I"$src" bench/harness/local_grad_harness.cu -o /tmp/lg_plain &
nvcc $flags -I/tmp/lgc/csrc -DPHASE_CLOCKS bench/harness/local_grad_harness.cu -o /tmp/lg_clocks &
wait
for gate in channel scalar channel-raw scalar-raw scalar-rawin; do for shape in "8192 32" "8192 96"; do /tmp/lg_plain $shape $gate; done; done
for gate in channel scalar channel-raw scalar-raw scalar-rawin; do /tmp/lg_clocks 8192 32 $gate; done
