"""pagedkv.norm (FlashInfer's flashinfer.norm) against float64 NumPy
references written here, in place where FlashInfer writes in place, and its
refusals before anything is written."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedkv import norm


def rms_ref(x: np.ndarray, w: np.ndarray, eps: float, gemma: bool) -> np.ndarray:
    x = x.astype(np.float64)
    scale = 1.0 / np.sqrt((x * x).mean(axis=-1, keepdims=True) + eps)
    return x * scale * (w.astype(np.float64) + (1.0 if gemma else 0.0))


def tensors(shape, dtype, seed=0, strided=False):
    g = torch.Generator().manual_seed(seed)
    if strided:
        wide = torch.randn(*shape[:-1], shape[-1] * 2, generator=g).to(dtype)
        return wide[..., : shape[-1]]
    return torch.randn(*shape, generator=g).to(dtype)


TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 111), (19, 4096), (5, 4, 128)])
@pytest.mark.parametrize("gemma", [False, True])
@pytest.mark.parametrize("strided", [False, True])
def test_rmsnorm_matches_float64(dtype, shape, gemma, strided):
    x = tensors(shape, dtype, strided=strided)
    w = tensors(shape[-1:], dtype, seed=1)
    fn = norm.gemma_rmsnorm if gemma else norm.rmsnorm
    want = rms_ref(x.float().numpy(), w.float().numpy(), 1e-6, gemma)
    got = fn(x, w)
    assert got.dtype == dtype and got.shape == x.shape
    np.testing.assert_allclose(got.double().numpy(), want, rtol=TOL[dtype], atol=TOL[dtype])
    out = torch.full_like(x, float("nan"))
    assert fn(x, w, out=out) is out
    assert torch.equal(out, got)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("gemma", [False, True])
def test_fused_add_rmsnorm_writes_both_in_place(dtype, gemma):
    x, r = tensors((7, 300), dtype), tensors((7, 300), dtype, seed=2)
    w = tensors((300,), dtype, seed=3)
    total = x.double().numpy() + r.double().numpy()
    fn = norm.gemma_fused_add_rmsnorm if gemma else norm.fused_add_rmsnorm
    assert fn(x, r, w) is None
    np.testing.assert_allclose(r.double().numpy(), total, rtol=TOL[dtype], atol=TOL[dtype])
    want = rms_ref(total, w.double().numpy(), 1e-6, gemma)
    np.testing.assert_allclose(x.double().numpy(), want, rtol=4 * TOL[dtype], atol=4 * TOL[dtype])


def assert_rounds_near(got: np.ndarray, want: np.ndarray, step: np.ndarray) -> None:
    """got (fp8 codes, widened) is finite, within two steps of want
    everywhere and within one step for at least 99% of its elements (the
    rest: near ties that rounded the other way)."""
    err = np.abs(got - want)
    assert np.isfinite(got).all()
    assert (err <= step).mean() > 0.99
    assert (err <= 2 * step).all(), err.max()


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_quantized_outputs_round_to_the_scaled_reference(fp8):
    x, w = tensors((9, 256), torch.bfloat16), tensors((256,), torch.bfloat16, seed=1)
    out = torch.empty(9, 256, dtype=fp8)
    norm.rmsnorm_quant(out, x, w, torch.tensor([0.5]))
    want = np.clip(rms_ref(x.float().numpy(), w.float().numpy(), 1e-6, False) / 0.5, -448, 448)
    want_fp8 = torch.from_numpy(want).to(fp8).double().numpy()
    step = np.abs(want_fp8) * (0.07 if fp8 == torch.float8_e4m3fn else 0.13) + 1e-3
    assert_rounds_near(out.double().numpy(), want_fp8, step)
    gamma, beta = torch.randn(256), torch.randn(256)
    norm.layernorm_quant(out, x, gamma, beta, 2.0)
    xs = x.double().numpy()
    ln = (xs - xs.mean(-1, keepdims=True)) / np.sqrt(xs.var(-1, keepdims=True) + 1e-6)
    ln = ln * gamma.double().numpy() + beta.double().numpy()
    want_fp8 = torch.from_numpy(ln / 2.0).to(fp8).double().numpy()
    step = np.abs(want_fp8) * 0.25 + 2e-2
    assert_rounds_near(out.double().numpy(), want_fp8, step)


def test_fused_add_rmsnorm_quant_updates_the_residual():
    x, r = tensors((3, 64), torch.float16), tensors((3, 64), torch.float16, seed=4)
    w = tensors((64,), torch.float16, seed=5)
    total = x.float() + r.float()
    out = torch.empty(3, 64, dtype=torch.float8_e4m3fn)
    norm.fused_add_rmsnorm_quant(out, x, r, w, 1.0)
    torch.testing.assert_close(r, total.half())
    want = torch.from_numpy(rms_ref(total.numpy(), w.float().numpy(), 1e-6, False))
    torch.testing.assert_close(out.float(), want.float(), rtol=0.13, atol=2e-2)


def test_layernorm_matches_float64():
    x = tensors((4, 129), torch.bfloat16)
    gamma, beta = torch.randn(129), torch.randn(129)
    xs = x.double().numpy()
    want = (xs - xs.mean(-1, keepdims=True)) / np.sqrt(xs.var(-1, keepdims=True) + 1e-6)
    want = want * gamma.double().numpy() + beta.double().numpy()
    got = norm.layernorm(x, gamma, beta)
    assert got.dtype == torch.bfloat16
    np.testing.assert_allclose(got.double().numpy(), want, rtol=2e-2, atol=2e-2)


def test_bad_input_raises_before_writing():
    x, w = tensors((2, 8), torch.float16), tensors((8,), torch.float16)
    r = x.clone()
    before = (x.clone(), r.clone())
    with pytest.raises(ValueError, match="weight must be"):
        norm.rmsnorm(x, w[:4])
    with pytest.raises(ValueError, match="2D or 3D"):
        norm.rmsnorm(x[0], w)
    with pytest.raises(ValueError, match="residual must have"):
        norm.fused_add_rmsnorm(x, r.float(), w)
    with pytest.raises(ValueError, match="out must be a float8"):
        norm.rmsnorm_quant(torch.empty(2, 8), x, w, 1.0)
    with pytest.raises(ValueError, match="scalar tensor"):
        norm.rmsnorm_quant(torch.empty(2, 8, dtype=torch.float8_e4m3fn), x, w, torch.ones(2))
    with pytest.raises(ValueError, match="positive"):
        norm.rmsnorm_quant(torch.empty(2, 8, dtype=torch.float8_e4m3fn), x, w, 0.0)
    with pytest.raises(RuntimeError, match="input must be bfloat16"):
        norm.layernorm_quant(
            torch.empty(2, 8, dtype=torch.float8_e4m3fn), x, torch.ones(8), torch.ones(8), 1.0
        )
    with pytest.raises(TypeError, match="torch tensors"):
        norm.rmsnorm(x.numpy(), w)
    assert torch.equal(x, before[0]) and torch.equal(r, before[1])


def test_bad_dtypes_and_eps_are_refused():
    x, w = tensors((3, 64), torch.float32), tensors((64,), torch.float32, seed=1)
    with pytest.raises(TypeError, match="input must be float32"):
        norm.rmsnorm(torch.ones(3, 64, dtype=torch.int32), w)
    out = torch.zeros(3, 64, dtype=torch.int8)
    with pytest.raises(TypeError, match="out must be torch.float32"):
        norm.rmsnorm(x, w, out=out)
    assert not out.any()
    for eps in (float("nan"), -2.0, float("inf"), "1e-6"):
        with pytest.raises(ValueError, match="eps"):
            norm.rmsnorm(x, w, eps=eps)
    r = x.clone()
    with pytest.raises(ValueError, match="eps"):
        norm.fused_add_rmsnorm(x, r, w, eps=float("nan"))
    assert torch.equal(r, x)
    with pytest.raises(ValueError, match="eps"):
        norm.layernorm(x, w, w, eps=-1.0)
    torch.testing.assert_close(norm.rmsnorm(x, w, eps=np.float32(1e-6)), norm.rmsnorm(x, w))
