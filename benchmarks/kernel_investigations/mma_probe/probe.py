"""Runs the tensor-core fragment probe (kernels/mma_probe.mojo) on a GPU and
checks it against NumPy; with `--compile sm_90` only compiles it through a
virtual device.

    python benchmarks/kernel_investigations/mma_probe/probe.py [--compile sm_90]
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

KERNELS = Path(__file__).parent / "kernels"


def build():
    from max.dtype import DType
    from max.graph import DeviceRef, Graph, TensorType, ops

    gpu = DeviceRef.GPU()
    types = [TensorType(DType.bfloat16, s, device=gpu) for s in ([16, 16], [16, 16], [16, 8])]
    with Graph("mma_probe", input_types=types, custom_extensions=[KERNELS]) as g:
        s, o = ops.custom(
            "mma_probe",
            device=gpu,
            values=list(g.inputs),
            out_types=[
                TensorType(DType.float32, [16, 16], device=gpu),
                TensorType(DType.float32, [16, 8], device=gpu),
            ],
        )
        g.output(s, o)
    return g


def main() -> None:
    import max.driver as driver

    if "--compile" in sys.argv:
        driver.set_virtual_device_api("cuda")
        driver.set_virtual_device_target_arch(sys.argv[sys.argv.index("--compile") + 1])
        driver.set_virtual_device_count(1)
    from max.driver import CPU, Accelerator, Buffer
    from max.engine import InferenceSession

    model = InferenceSession(devices=[CPU(), Accelerator()]).load(build())
    if "--compile" in sys.argv:
        print("mma probe compiled")
        return
    import torch

    rng = np.random.default_rng(0)
    a, k = (torch.from_numpy(rng.standard_normal((16, 16), np.float32)).bfloat16() for _ in "ak")
    v = torch.from_numpy(rng.standard_normal((16, 8), np.float32)).bfloat16()
    s, o = model.execute(*(Buffer.from_dlpack(x.cuda()) for x in (a, k, v)))
    s = torch.from_dlpack(s).cpu().numpy().astype(np.float64)
    o = torch.from_dlpack(o).cpu().numpy().astype(np.float64)
    want_s = a.double().numpy() @ k.double().numpy().T
    p = torch.from_numpy(s).bfloat16().double().numpy()
    want_o = p @ v.double().numpy()
    err_s = np.abs(s - want_s).max() / np.abs(want_s).max()
    err_o = np.abs(o - want_o).max() / np.abs(want_o).max()
    ok = err_s < 1e-5 and err_o < 1e-5
    print(f"mma probe: S rel err {err_s:.2e}, O rel err {err_o:.2e}: {'PASS' if ok else 'FAIL'}")
    if not ok:
        print("S got\n", np.round(s[:4], 2), "\nS want\n", np.round(want_s[:4], 2))
        print("O got\n", np.round(o[:4], 2), "\nO want\n", np.round(want_o[:4], 2))
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
