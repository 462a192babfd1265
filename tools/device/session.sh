#!/usr/bin/env bash
# On the lent GPU machine, in the last part's call: installs what
# tools/device/stage.sh packed, then spends one call's time on the GPU,
# phase by phase, in the order given (the default served a 15-minute lease
# best):
#
#   profile: the decode kernels' device times, alone on the GPU (compiling
#      its kernels takes most of its first 2 minutes), FlashInfer's beside
#      them where staged, and the fixed-split sweep;
#   checks: the correctness jobs of tools/device/checks.sh side by side (the
#      suite's GPU tests, the real model's tests and demos; they compile
#      graphs on the CPU cores and barely share the GPU);
#   bench: the eager decode benchmark, with what is left of the call.
#
#   bash tools/device/session.sh N [SECONDS [PHASE...]]   # N parts; SECONDS:
#                            # the call's budget (default 520); PHASE: profile,
#                            # checks, bench (default: all three, in that order)
#
# Each job's log comes back under $OUT (tools/device/env.sh's collect).
set -uo pipefail
parts=$1
budget=${2:-520}
shift $(($# < 2 ? $# : 2))
phases=("$@")
[ ${#phases[@]} -eq 0 ] && phases=(profile checks bench)
bash tools/device/receive.sh "$parts" || exit 1
source tools/device/env.sh
start=$SECONDS
left() { echo $(($1 - (SECONDS - start))); }

for phase in "${phases[@]}"; do
  case $phase in
  profile)
    # At most PROFILE_SECONDS (240: the profile and its sweep took 196 s on
    # an H100), so that the phases after it keep their time.
    cap=$(left $((budget - 5)))
    [ "$cap" -gt "${PROFILE_SECONDS:-240}" ] && cap=${PROFILE_SECONDS:-240}
    job profile timeout "$cap" python3 \
      benchmarks/kernel_investigations/decode_gpu_profile.py --reps 20 --skip pagedkv-generic \
      --split-sweep
    TAIL_LINES=200 wait_jobs "$((cap + 5))" profile
    collect profile ;;
  checks)
    bash tools/device/checks.sh gpu-tests model-tests
    TAIL_LINES=40 wait_jobs "$(left $((budget - 5)))" gpu-tests model-tests
    collect gpu-tests model-tests ;;
  bench)
    job bench timeout "$(left $((budget - 5)))" python3 benchmarks/decode_gpu.py --parts decode \
      --reps 30 --skip pagedkv-generic
    TAIL_LINES=60 wait_jobs "$(left "$budget")" bench
    collect bench ;;
  *) echo "unknown phase $phase" >&2; exit 2 ;;
  esac
done
