#!/usr/bin/env bash
# On the lent GPU machine, with nothing else running: the GPU benchmarks, one
# after another, each as a background job (tools/device/env.sh).
source tools/device/env.sh
job bench bash -c 'nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw --format=csv;
  python3 benchmarks/decode_gpu.py --reps 50; s=$?;
  python3 benchmarks/kernel_investigations/decode_gpu_profile.py --reps 20 || s=1;
  python3 benchmarks/kernel_investigations/cuda_graph_probe.py || s=1;
  python3 benchmarks/serve.py --device gpu --dtypes float32 --requests 1,64 || s=1; exit $s'
echo "started bench"
