"""FlashInfer's ``flashinfer.trace.default_check``: the output comparison its
tests use, written here from its documented behaviour."""

from __future__ import annotations

from typing import Any


def _tolerance(dtype: Any) -> float:
    import torch

    if dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return 0.1
    if dtype in (torch.float16, torch.bfloat16):
        return 1e-2
    return 1e-5


def default_check(
    reference_outputs: Any,
    actual_outputs: Any,
    *,
    rtol: float | None = None,
    atol: float | None = None,
    max_mismatch_pct: float = 0.0,
    min_cos_sim: float | None = 1.0 - 1e-3,
) -> bool:
    """Whether each actual output matches its reference: same shape; for
    floating tensors at most `max_mismatch_pct` percent of elements outside
    ``atol + rtol * |ref|`` (defaults by dtype, 0.1 for float8) and, when
    `min_cos_sim` is given, cosine similarity at least that; other tensors
    equal up to the same share; other values equal."""
    import torch

    if isinstance(reference_outputs, dict) or isinstance(actual_outputs, dict):
        if not (isinstance(reference_outputs, dict) and isinstance(actual_outputs, dict)):
            return False
        if reference_outputs.keys() != actual_outputs.keys():
            return False
        keys = list(reference_outputs)
        refs = [reference_outputs[k] for k in keys]
        actuals = [actual_outputs[k] for k in keys]
    else:
        refs = (
            list(reference_outputs)
            if isinstance(reference_outputs, list | tuple)
            else [reference_outputs]
        )
        actuals = (
            list(actual_outputs) if isinstance(actual_outputs, list | tuple) else [actual_outputs]
        )
    if len(refs) != len(actuals):
        return False
    for ref, actual in zip(refs, actuals, strict=True):
        if isinstance(ref, torch.Tensor) != isinstance(actual, torch.Tensor):
            return False
        if not isinstance(ref, torch.Tensor):
            if ref != actual:
                return False
            continue
        if ref.shape != actual.shape:
            return False
        if ref.numel() == 0:
            continue
        tol = _tolerance(actual.dtype)
        r, a = ref.double(), actual.double()
        if ref.is_floating_point() or actual.is_floating_point():
            bad = ~torch.isclose(
                a, r, rtol=tol if rtol is None else rtol, atol=tol if atol is None else atol
            )
        else:
            bad = a != r
        if bad.double().mean().item() * 100 > max_mismatch_pct:
            return False
        if min_cos_sim is not None and ref.is_floating_point():
            cos = torch.nn.functional.cosine_similarity(r.flatten(), a.flatten(), dim=0).item()
            if cos < min_cos_sim:
                return False
    return True
