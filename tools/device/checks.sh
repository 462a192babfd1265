#!/usr/bin/env bash
# On the lent GPU machine, after receive.sh: starts GPU checks as background
# jobs (they outlive the call; tools/device/env.sh's wait_jobs follows them).
#
#   bash tools/device/checks.sh [JOB...]    # default: every job, in this order
#
# bf16-bisect: the bfloat16 step-graph bisection rig, one decoder layer's
#   ops first.
# bf16-max-products: its layer and engine parts with MAX's own bfloat16
#   matmul (not in the default list).
# mma-probe: the tensor-core fragment probe.
# gpu-tests: the suite's GPU tests.
# model-tests: the real model's tests on the GPU (greedy answers against
#   transformers', the server), then the demo (float32 and bfloat16 weights)
#   and `generate` with it.
# gemma-tests: Gemma 3's tests on the GPU (staged with GEMMA=1: greedy
#   answers against transformers' past its local layers' window, the window
#   group's pages, the server), then its demo (not in the default list).
source tools/device/env.sh
jobs=("$@")
[ ${#jobs[@]} -eq 0 ] && jobs=(bf16-bisect mma-probe gpu-tests model-tests)
for name in "${jobs[@]}"; do
  case $name in
  bf16-bisect) job bf16-bisect python3 benchmarks/kernel_investigations/bf16_step_bisect.py \
    --device gpu --parts layer,engine,ops,products,pool,subgraph ;;
  bf16-max-products) job bf16-max-products python3 \
    benchmarks/kernel_investigations/bf16_step_bisect.py --device gpu --parts layer,engine \
    --max-16bit-products ;;
  mma-probe) job mma-probe python3 benchmarks/kernel_investigations/mma_probe/probe.py ;;
  gpu-tests) job gpu-tests python3 -m pytest -m gpu -q -ra -p no:cacheprovider \
    -o faulthandler_timeout=1200 ;;
  model-tests) job model-tests bash -c 'PAGEDKV_TEST_DEVICE=gpu python3 -m pytest \
    tests/models/test_smollm2.py tests/serve/test_serve.py -q -ra -p no:cacheprovider \
    -o faulthandler_timeout=1200; s=$?; python3 -m pagedkv demo --device gpu || s=1;
    python3 -m pagedkv demo --device gpu --weights bf16 || s=1;
    python3 -m pagedkv generate --device gpu --json --max-new-tokens 24 \
      "What is the capital of France?" "Write a haiku about the sea." || s=1; exit $s' ;;
  gemma-tests) job gemma-tests bash -c 'PAGEDKV_TEST_DEVICE=gpu python3 -m pytest \
    tests/models/test_gemma3.py -m slow -q -ra -p no:cacheprovider -o faulthandler_timeout=1200;
    s=$?; python3 -m pagedkv demo --device gpu --model gemma3-270m || s=1; exit $s' ;;
  *) echo "unknown job $name" >&2; exit 2 ;;
  esac
  echo "started $name"
done
