"""Normalizations beside attention: FlashInfer's ``flashinfer.norm``.

RMSNorm (Llama's and Gemma's ``1 + weight`` form), the fused residual add
that engines run before each norm (in place, as FlashInfer's), LayerNorm,
and the forms that quantize their output to float8 with a scale. Inputs
are torch tensors on any device torch runs; the sums are taken in float32
and the result rounded once to the output's dtype, as FlashInfer's kernels
do. Every entry point checks its shapes and dtypes and raises before it
writes anything.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

FP8 = ("float8_e4m3fn", "float8_e5m2")


def _torch():
    import torch

    return torch


def _check_norm(name: str, input: Any, weight: Any, eps: Any, out: Any = None) -> None:
    torch = _torch()
    if not isinstance(input, torch.Tensor) or not isinstance(weight, torch.Tensor):
        raise TypeError(f"{name}: input and weight must be torch tensors")
    if not input.is_floating_point() or str(input.dtype).removeprefix("torch.") in FP8:
        raise TypeError(f"{name}: input must be float32, float16 or bfloat16, got {input.dtype}")
    _check_eps(name, eps)
    if input.dim() not in (2, 3):
        raise ValueError(f"{name}: input must be 2D or 3D, got shape {tuple(input.shape)}")
    if weight.dim() != 1 or weight.shape[0] != input.shape[-1]:
        raise ValueError(
            f"{name}: weight must be ({input.shape[-1]},), got shape {tuple(weight.shape)}"
        )
    if input.stride(-1) != 1:
        raise ValueError(f"{name}: input's last dimension must be contiguous")
    if out is not None and (not isinstance(out, torch.Tensor) or out.shape != input.shape):
        raise ValueError(f"{name}: out must be a tensor of input's shape {tuple(input.shape)}")
    if out is not None and out.dtype != input.dtype:
        raise TypeError(f"{name}: out must be {input.dtype}, input's dtype, got {out.dtype}")


def _check_eps(name: str, eps: Any) -> None:
    # numbers.Real: Python's and NumPy's scalars alike.
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not 0 <= eps < math.inf:
        raise ValueError(f"{name}: eps must be a finite number >= 0, got {eps!r}")


def _scale_of(name: str, scale: Any) -> float:
    torch = _torch()
    if isinstance(scale, torch.Tensor):
        if scale.numel() != 1:
            raise ValueError(
                f"{name}: scale must be a scalar tensor, got shape {tuple(scale.shape)}"
            )
        scale = float(scale.float().item())
    scale = float(scale)
    if not scale > 0 or scale == float("inf"):
        raise ValueError(f"{name}: scale must be positive and finite, got {scale}")
    return scale


def _rms(x: Any, weight: Any, eps: float, gemma: bool) -> Any:
    """RMSNorm of x in float32 (x already float32)."""
    torch = _torch()
    w = weight.float() + 1.0 if gemma else weight.float()
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps) * w


def _to_fp8(y: Any, out: Any, scale: float) -> None:
    torch = _torch()
    finfo = torch.finfo(out.dtype)
    out.copy_(torch.clamp(y / scale, finfo.min, finfo.max).to(out.dtype))


def _check_fp8_out(name: str, out: Any, shape: tuple) -> None:
    torch = _torch()
    if not isinstance(out, torch.Tensor) or str(out.dtype).removeprefix("torch.") not in FP8:
        raise ValueError(f"{name}: out must be a float8_e4m3fn or float8_e5m2 tensor")
    if tuple(out.shape) != tuple(shape):
        raise ValueError(f"{name}: out must have shape {tuple(shape)}, got {tuple(out.shape)}")


def rmsnorm(
    input: Any, weight: Any, eps: float = 1e-6, out: Any = None, enable_pdl: bool | None = None
) -> Any:
    """``out = input / RMS(input) * weight`` over the last dimension.

    Parameters
    ----------
    input : torch.Tensor
        [batch, hidden] or [batch, heads, hidden] (rows may be strided).
    weight : torch.Tensor
        [hidden].
    eps : float
        Added to the mean square.
    out : torch.Tensor, optional
        Written in place when given.
    enable_pdl : bool, optional
        Accepted for FlashInfer's signature (a CUDA launch option).

    Returns
    -------
    torch.Tensor
        out, in input's dtype.

    Examples
    --------
    >>> import torch, pagedkv.norm
    >>> pagedkv.norm.rmsnorm(torch.ones(2, 4), torch.full((4,), 2.0))[0]
    tensor([2.0000, 2.0000, 2.0000, 2.0000])
    """
    return _rmsnorm("rmsnorm", input, weight, eps, out, gemma=False)


def gemma_rmsnorm(
    input: Any, weight: Any, eps: float = 1e-6, out: Any = None, enable_pdl: bool | None = None
) -> Any:
    """Gemma's RMSNorm: ``out = input / RMS(input) * (1 + weight)``; see `rmsnorm`.

    Examples
    --------
    >>> import torch, pagedkv.norm
    >>> pagedkv.norm.gemma_rmsnorm(torch.ones(1, 2), torch.zeros(2))
    tensor([[1.0000, 1.0000]])
    """
    return _rmsnorm("gemma_rmsnorm", input, weight, eps, out, gemma=True)


def _rmsnorm(name: str, input: Any, weight: Any, eps: float, out: Any, gemma: bool) -> Any:
    _check_norm(name, input, weight, eps, out)
    y = _rms(input.float(), weight, eps, gemma).to(input.dtype)
    if out is None:
        return y
    out.copy_(y)
    return out


def fused_add_rmsnorm(
    input: Any, residual: Any, weight: Any, eps: float = 1e-6, enable_pdl: bool | None = None
) -> None:
    """``residual += input; input = RMSNorm(residual) * weight``, both in place.

    Parameters
    ----------
    input : torch.Tensor
        [batch, hidden]: the layer's output; receives the normalized rows.
    residual : torch.Tensor
        [batch, hidden], input's dtype: receives the sum.
    weight : torch.Tensor
        [hidden].
    eps : float
        Added to the mean square.
    enable_pdl : bool, optional
        Accepted for FlashInfer's signature.

    Examples
    --------
    >>> import torch, pagedkv.norm
    >>> x, r = torch.ones(1, 2), torch.ones(1, 2)
    >>> pagedkv.norm.fused_add_rmsnorm(x, r, torch.ones(2)); r
    tensor([[2., 2.]])
    """
    _fused_add("fused_add_rmsnorm", input, residual, weight, eps, gemma=False)


def gemma_fused_add_rmsnorm(
    input: Any, residual: Any, weight: Any, eps: float = 1e-6, enable_pdl: bool | None = None
) -> None:
    """`fused_add_rmsnorm` with Gemma's ``1 + weight``.

    Examples
    --------
    >>> import torch, pagedkv.norm
    >>> x, r = torch.ones(1, 2), torch.ones(1, 2)
    >>> pagedkv.norm.gemma_fused_add_rmsnorm(x, r, torch.zeros(2)); x
    tensor([[1.0000, 1.0000]])
    """
    _fused_add("gemma_fused_add_rmsnorm", input, residual, weight, eps, gemma=True)


def _check_residual(name: str, input: Any, residual: Any) -> None:
    torch = _torch()
    if not isinstance(residual, torch.Tensor) or residual.shape != input.shape:
        raise ValueError(f"{name}: residual must be a tensor of input's shape")
    if residual.dtype != input.dtype:
        raise ValueError(f"{name}: residual must have input's dtype {input.dtype}")


def _add_into_residual(input: Any, residual: Any) -> Any:
    """``residual += input`` in place (the sum rounded once to residual's
    dtype); returns the float32 sum."""
    total = input.float() + residual.float()
    residual.copy_(total.to(residual.dtype))
    return total


def _fused_add(name: str, input: Any, residual: Any, weight: Any, eps: float, gemma: bool):
    _check_norm(name, input, weight, eps)
    _check_residual(name, input, residual)
    total = _add_into_residual(input, residual)
    input.copy_(_rms(total, weight, eps, gemma).to(input.dtype))


def rmsnorm_quant(
    out: Any,
    input: Any,
    weight: Any,
    scale: Any,
    eps: float = 1e-6,
    enable_pdl: bool | None = None,
) -> None:
    """``out = (RMSNorm(input) * weight / scale)`` in out's float8 dtype,
    saturated to its range.

    Parameters
    ----------
    out : torch.Tensor
        float8_e4m3fn or float8_e5m2, input's shape.
    input, weight, eps : see `rmsnorm`.
    scale : float or torch.Tensor
        A positive scalar.
    enable_pdl : bool, optional
        Accepted for FlashInfer's signature.

    Examples
    --------
    >>> import torch, pagedkv.norm
    >>> out = torch.empty(1, 2, dtype=torch.float8_e4m3fn)
    >>> pagedkv.norm.rmsnorm_quant(out, torch.ones(1, 2), torch.ones(2), 0.5); out.float()
    tensor([[2., 2.]])
    """
    _check_norm("rmsnorm_quant", input, weight, eps)
    _check_fp8_out("rmsnorm_quant", out, tuple(input.shape))
    s = _scale_of("rmsnorm_quant", scale)
    _to_fp8(_rms(input.float(), weight, eps, False), out, s)


def fused_add_rmsnorm_quant(
    out: Any,
    input: Any,
    residual: Any,
    weight: Any,
    scale: Any,
    eps: float = 1e-6,
    enable_pdl: bool | None = None,
) -> None:
    """``residual += input`` (in place), then ``out = RMSNorm(residual) *
    weight / scale`` in out's float8 dtype; see `rmsnorm_quant`.

    Examples
    --------
    >>> import torch, pagedkv.norm
    >>> out = torch.empty(1, 2, dtype=torch.float8_e4m3fn)
    >>> x, r = torch.ones(1, 2), torch.ones(1, 2)
    >>> pagedkv.norm.fused_add_rmsnorm_quant(out, x, r, torch.ones(2), 1.0); r
    tensor([[2., 2.]])
    """
    name = "fused_add_rmsnorm_quant"
    _check_norm(name, input, weight, eps)
    _check_residual(name, input, residual)
    _check_fp8_out(name, out, tuple(input.shape))
    s = _scale_of(name, scale)
    total = _add_into_residual(input, residual)
    _to_fp8(_rms(total, weight, eps, False), out, s)


def _check_layernorm(name: str, input: Any, gamma: Any, beta: Any, eps: Any) -> None:
    torch = _torch()
    if not all(isinstance(t, torch.Tensor) for t in (input, gamma, beta)):
        raise TypeError(f"{name}: input, gamma and beta must be torch tensors")
    _check_eps(name, eps)
    if input.dim() != 2:
        raise ValueError(f"{name}: input must be 2D, got shape {tuple(input.shape)}")
    hidden = input.shape[-1]
    if tuple(gamma.shape) != (hidden,) or tuple(beta.shape) != (hidden,):
        raise ValueError(f"{name}: gamma and beta must be ({hidden},)")


def layernorm(input: Any, gemma: Any, beta: Any, eps: float = 1e-6) -> Any:
    """``(input - mean) / sqrt(var + eps) * gemma + beta`` over the last
    dimension (FlashInfer names the scale `gemma`).

    Parameters
    ----------
    input : torch.Tensor
        [batch, hidden].
    gemma, beta : torch.Tensor
        [hidden] (float32 in FlashInfer's kernels; any float dtype here).
    eps : float
        Added to the variance.

    Returns
    -------
    torch.Tensor
        [batch, hidden] in input's dtype.

    Examples
    --------
    >>> import torch, pagedkv.norm
    >>> pagedkv.norm.layernorm(torch.tensor([[1.0, 3.0]]), torch.ones(2), torch.zeros(2))
    tensor([[-1.0000,  1.0000]])
    """
    _check_layernorm("layernorm", input, gemma, beta, eps)
    return _layernorm(input, gemma, beta, eps).to(input.dtype)


def _layernorm(input: Any, gamma: Any, beta: Any, eps: float) -> Any:
    torch = _torch()
    x = input.float()
    return torch.nn.functional.layer_norm(
        x, (x.shape[-1],), weight=gamma.float(), bias=beta.float(), eps=eps
    )


def layernorm_quant(
    out: Any, input: Any, gemma: Any, beta: Any, scale: Any, eps: float = 1e-6
) -> None:
    """`layernorm` rounded to input's dtype, divided by `scale` and stored
    in out's float8 dtype (FlashInfer's kernel takes bfloat16 contiguous
    input; so does this, with the same errors).

    Examples
    --------
    >>> import torch, pagedkv.norm
    >>> out = torch.empty(1, 2, dtype=torch.float8_e4m3fn)
    >>> x = torch.tensor([[1.0, 3.0]], dtype=torch.bfloat16)
    >>> pagedkv.norm.layernorm_quant(out, x, torch.ones(2), torch.zeros(2), 1.0); out.float()
    tensor([[-1.,  1.]])
    """
    torch = _torch()
    name = "layernorm_quant"
    _check_layernorm(name, input, gemma, beta, eps)
    if input.dtype != torch.bfloat16:
        raise RuntimeError(f"{name}: input must be bfloat16, got {input.dtype}")
    if not input.is_contiguous():
        raise RuntimeError(f"{name}: input must be contiguous")
    _check_fp8_out(name, out, tuple(input.shape))
    s = _scale_of(name, scale)
    y = _layernorm(input, gemma, beta, eps).to(input.dtype).float()
    _to_fp8(y, out, s)
