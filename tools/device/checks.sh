#!/usr/bin/env bash
# On the lent GPU machine, after receive.sh: starts the GPU checks as
# background jobs (they outlive the call; tools/device/env.sh's wait_jobs
# follows them): the suite's GPU tests; the real model's tests on the GPU
# (greedy answers against transformers', the server), then the demo and
# `generate` with the real model; the tensor-core fragment probe; the
# bfloat16 step-graph bisection rig.
source tools/device/env.sh
job gpu-tests python3 -m pytest -m gpu -q -ra -p no:cacheprovider \
  -o faulthandler_timeout=1200
job model-tests bash -c 'PAGEDKV_TEST_DEVICE=gpu python3 -m pytest tests/models/test_smollm2.py \
  tests/serve/test_serve.py -q -ra -p no:cacheprovider -o faulthandler_timeout=1200;
  s=$?; python3 -m pagedkv demo --device gpu || s=1;
  python3 -m pagedkv generate --device gpu --json --max-new-tokens 24 \
    "What is the capital of France?" "Write a haiku about the sea." || s=1; exit $s'
job mma-probe python3 benchmarks/kernel_investigations/mma_probe/probe.py
job bf16-bisect python3 benchmarks/kernel_investigations/bf16_step_bisect.py --device gpu
echo "started gpu-tests, model-tests, mma-probe and bf16-bisect"
