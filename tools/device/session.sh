#!/usr/bin/env bash
# On the lent GPU machine, in the last part's call: installs what
# tools/device/stage.sh packed, then spends one call's time on the GPU in
# the order that served a 15-minute lease best:
#
#   1. the decode kernels' device times, alone on the GPU (compiling its
#      kernels takes most of its first 2 minutes);
#   2. the correctness jobs of tools/device/checks.sh side by side (the
#      suite's GPU tests, the real model's tests and demos; they compile
#      graphs on the CPU cores and barely share the GPU);
#   3. the eager decode benchmark, with what is left of the call.
#
#   bash tools/device/session.sh N [SECONDS]   # N parts; SECONDS: the call's
#                                              # budget (default 520)
#
# Each job's log comes back under $OUT (tools/device/env.sh's collect).
set -uo pipefail
parts=$1
budget=${2:-520}
bash tools/device/receive.sh "$parts" || exit 1
source tools/device/env.sh
start=$SECONDS
left() { echo $(($1 - (SECONDS - start))); }

job profile timeout 200 python3 benchmarks/kernel_investigations/decode_gpu_profile.py --reps 20
wait_jobs 205 profile
bash tools/device/checks.sh gpu-tests model-tests
TAIL_LINES=40 wait_jobs "$(left $((budget - 90)))" gpu-tests model-tests
job bench timeout "$(left $((budget - 5)))" python3 benchmarks/decode_gpu.py --parts decode --reps 30 \
  --skip pagedkv-generic
TAIL_LINES=60 wait_jobs "$(left "$budget")" bench
collect profile gpu-tests model-tests bench
