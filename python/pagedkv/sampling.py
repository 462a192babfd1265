"""Token sampling beside attention: FlashInfer's ``flashinfer.sampling`` in
torch, on the CPU (or wherever the tensors are).

Every entry point takes probabilities (or logits, turned into float32
probabilities by softmax) [B, V] and draws one token a row:

- top-p keeps the most likely tokens whose mass reaches p: a token stays
  when the ascending cumulative mass above it exceeds ``1 - p``;
- top-k keeps the tokens at least as likely as the k-th (ties kept);
- min-p keeps the tokens at least ``min_p`` times the most likely;
- ``top_k_top_p`` applies top-k, renormalizes and applies top-p
  (``filter_apply_order="top_k_first"``), or keeps what both keep on the
  original distribution (``"joint"``).

Per-row parameters are a float/int or a tensor [B]. ``indices`` [N] maps N
outputs to rows (many draws from one distribution without copying it).
Draws are inverse-CDF lookups of uniforms from ``generator``, or from
``seed``/``offset`` (the same pair gives the same draws). Outputs are int32
(indices' dtype when given). A row whose kept mass is zero (or NaN) is
invalid: its output is 0 and ``return_valid=True`` reports it. Which
tokens a filter keeps is decided on the host, in NumPy (`top_p_mask`,
`top_k_mask`, `min_p_mask`: the engine's sampler calls the same rules).
"""

from __future__ import annotations

from typing import Any


def _torch() -> Any:
    import torch

    return torch


def _rows(x: Any, name: str) -> Any:
    torch = _torch()
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or not x.is_floating_point():
        raise ValueError(f"{name} must be a 2-D floating torch tensor [batch, vocab]")
    return x.float()


def _check_param(shape: tuple[int, ...], batch: int, name: str) -> None:
    """FlashInfer's rule for a sampling parameter given as an array: one
    value a row, [batch] (a number is the other form); its messages."""
    if len(shape) == 0:
        raise ValueError(
            f"{name}: Expected a 1D tensor of shape (batch_size,) or scalar for the sampling "
            "parameter, but got a 0-dimensional tensor."
        )
    if len(shape) > 1:
        raise ValueError(
            f"{name}: Expected a 1D tensor or scalar for the sampling parameter, but got a "
            f"{len(shape)}D tensor."
        )
    if shape[0] != batch:
        raise ValueError(
            f"{name}: Sampling parameter tensor batch size mismatch: expected length {batch} "
            f"to match the reference tensor batch size, but got length {shape[0]}."
        )


def _per_row(value: Any, batch: int, name: str, dtype: Any) -> Any:
    """A number or a tensor [batch] as a tensor [batch, 1] of dtype."""
    torch = _torch()
    if isinstance(value, torch.Tensor):
        _check_param(tuple(value.shape), batch, name)
        return value.to(dtype)[:, None]
    return torch.full((batch, 1), value, dtype=dtype)


def _probs(probs: Any, check_nan: bool) -> Any:
    """probs [B, V] as float32 rows (`_rows`); with check_nan, FlashInfer's
    error for a NaN in them."""
    p = _rows(probs, "probs")
    if check_nan and bool(_torch().isnan(p).any()):
        raise ValueError("Input probs contains NaN.")
    return p


def top_p_mask(probs: Any, top_p: Any) -> Any:
    """bool [B, V]: the tokens top-p keeps: a token stays when it and the
    tokens less likely than it hold more than 1 - top_p of the mass (the
    most likely always stays).

    probs: [B, V], a NumPy array or a torch tensor (the mask comes back as
    the same kind, on the same device); top_p: a number or one a row [B].
    The engine's sampler (pagedkv.graphs.sampling) keeps tokens by these
    same rules. Equal probabilities are ordered by token id, lower first,
    so a row always gives the same mask.

    Examples
    --------
    >>> import numpy as np, pagedkv.sampling as s
    >>> s.top_p_mask(np.array([[0.5, 0.3, 0.2]]), 0.7)
    array([[ True,  True, False]])
    """
    return _on_rows(_top_p_rule, probs, top_p, "top_p")


def top_k_mask(probs: Any, top_k: Any) -> Any:
    """bool [B, V]: the tokens at least as likely as each row's k-th (ties
    kept; k is clamped to [1, V]). probs and the mask as in top_p_mask."""
    return _on_rows(_top_k_rule, probs, top_k, "top_k")


def min_p_mask(probs: Any, min_p: Any) -> Any:
    """bool [B, V]: the tokens at least min_p times the row's most likely.
    probs and the mask as in top_p_mask."""
    return _on_rows(_min_p_rule, probs, min_p, "min_p")


def _on_rows(rule: Any, probs: Any, value: Any, name: str) -> Any:
    """rule(probs [B, V], value [B, 1]) on NumPy, for a NumPy or torch probs."""
    import numpy as np

    if isinstance(probs, np.ndarray):
        if probs.ndim != 2:
            raise ValueError(f"probs must be [batch, vocab], got shape {probs.shape}")
        return rule(probs, _column(value, probs.shape[0], name))
    torch = _torch()
    rows = probs.detach().cpu()
    rows = (rows if rows.dtype in (torch.float32, torch.float64) else rows.float()).numpy()
    given = value.detach().cpu().numpy() if isinstance(value, torch.Tensor) else value
    return torch.from_numpy(rule(rows, _column(given, rows.shape[0], name))).to(probs.device)


def _column(value: Any, batch: int, name: str) -> Any:
    """A number, or an array [batch] (`_check_param`), as an array [1 or batch, 1]."""
    import numpy as np

    if isinstance(value, np.ndarray):
        _check_param(value.shape, batch, name)
        return value.reshape(-1, 1)
    return np.full((1, 1), value)


def _top_p_rule(probs: Any, p: Any) -> Any:
    import numpy as np

    # Ascending, equal probabilities by id from the highest: the lowest ids
    # of a tie are the last dropped.
    order = np.argsort(-probs, axis=-1, kind="stable")[:, ::-1]
    ascending = np.take_along_axis(probs, order, axis=-1)
    # A token stays when its mass and all less likely tokens' exceeds 1 - p.
    # Accumulated in float64, rounded to probs' dtype (as torch's CPU cumsum
    # does, which FlashInfer's references use).
    cdf = np.cumsum(ascending, axis=-1, dtype=np.float64).astype(probs.dtype)
    keep_sorted = cdf > (1 - p).astype(probs.dtype)
    keep_sorted[:, -1] = True
    keep = np.empty_like(keep_sorted)
    np.put_along_axis(keep, order, keep_sorted, axis=-1)
    return keep


def _top_k_rule(probs: Any, k: Any) -> Any:
    import numpy as np

    vocab = probs.shape[1]
    keep = np.ones(probs.shape, bool)
    for row, k_row in enumerate(np.broadcast_to(k, (probs.shape[0], 1))[:, 0]):
        k_row = min(max(int(k_row), 1), vocab)
        if k_row < vocab:
            # The k-th largest without sorting the row.
            keep[row] = probs[row] >= np.partition(probs[row], vocab - k_row)[vocab - k_row]
    return keep


def _min_p_rule(probs: Any, p: Any) -> Any:
    return probs >= p.astype(probs.dtype) * probs.max(axis=-1, keepdims=True)


def _renormalized(probs: Any, keep: Any) -> Any:
    kept = probs * keep
    total = kept.sum(dim=-1, keepdim=True)
    return kept / total.where(total > 0, _torch().ones_like(total))


def _uniforms(count: int, generator: Any, seed: Any, offset: Any) -> Any:
    """count uniforms in [0, 1): from generator, or from (seed, offset)."""
    torch = _torch()
    if seed is None and offset is None:
        return torch.rand(count, generator=generator, dtype=torch.float64)
    seeds = torch.as_tensor(0 if seed is None else seed, dtype=torch.int64).reshape(-1)
    offsets = torch.as_tensor(0 if offset is None else offset, dtype=torch.int64).reshape(-1)
    for name, t in (("seed", seeds), ("offset", offsets)):
        if t.numel() not in (1, count):
            raise ValueError(f"{name} must be one value or one per output row ({count})")
    seeds, offsets = seeds.expand(count), offsets.expand(count)
    out = torch.empty(count, dtype=torch.float64)
    for i in range(count):
        g = torch.Generator().manual_seed(int(seeds[i]) * 1_000_003 + int(offsets[i]) + i)
        out[i] = torch.rand(1, generator=g, dtype=torch.float64)
    return out


def _draw(
    probs: Any, indices: Any, generator: Any, seed: Any, offset: Any, return_valid: bool
) -> Any:
    """One token an output from rows probs [B, V] (unnormalized allowed)."""
    torch = _torch()
    if indices is not None and (
        not isinstance(indices, torch.Tensor)
        or indices.dim() != 1
        or indices.is_floating_point()
        or indices.dtype == torch.bool
    ):
        raise TypeError("indices must be a 1-D integer torch tensor (a row of probs per output)")
    rows = torch.arange(probs.shape[0]) if indices is None else indices.long().cpu()
    if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= probs.shape[0]):
        raise ValueError(f"indices must be in [0, {probs.shape[0]})")
    u = _uniforms(rows.numel(), generator, seed, offset)
    p = probs.float().contiguous()
    if rows.numel() <= p.shape[0]:  # a draw a row: no prefix sums over whole rows
        out, valid = _inverse_cdf_by_blocks(p if indices is None else p[rows], u)
    else:  # many draws from few rows: each row's prefix sums once
        out = torch.zeros(rows.numel(), dtype=torch.int64)
        valid = torch.zeros(rows.numel(), dtype=torch.bool)
        for r in torch.unique(rows).tolist():
            at = (rows == r).nonzero().flatten()
            out[at], valid[at] = _inverse_cdf_of_row(p[r], u[at])
    out = torch.where(valid, out, 0)
    dtype = torch.int32 if indices is None else indices.dtype
    samples = out.to(dtype).to(probs.device)
    if return_valid:
        return samples, valid.to(probs.device)
    return samples


CDF_BLOCK = 1024
"""Tokens a block in `_inverse_cdf_by_blocks`' two-level search."""


def _inverse_cdf_by_blocks(p: Any, u: Any) -> tuple[Any, Any]:
    """(token [M], valid [M]) at mass u [M] (float64, in [0, 1)) of each row
    of p [M, V] (float32, contiguous, unnormalized): the block of CDF_BLOCK
    tokens holding it from the blocks' sums, then the token inside.
    A token without mass is never drawn; where rounding puts u * total past
    the end, the last token with mass is. valid: the row's mass is finite
    and positive."""
    torch = _torch()
    rows, vocab = p.shape
    whole = vocab // CDF_BLOCK
    sums = []
    if whole:
        blocks = p.as_strided((rows, whole, CDF_BLOCK), (vocab, CDF_BLOCK, 1))
        sums.append(blocks.sum(-1))
    if vocab % CDF_BLOCK:
        sums.append(p[:, whole * CDF_BLOCK :].sum(-1, keepdim=True))
    # torch sums float32 blocks pairwise (accurate to float32's rounding);
    # the blocks' running total is float64.
    block_cdf = torch.cumsum(torch.cat(sums, 1).double(), 1)
    total = block_cdf[:, -1:].contiguous()
    target = (u[:, None] * total).contiguous()
    # The first block whose cumulative mass exceeds the target (never one
    # without mass), at most the last block with mass.
    block = torch.minimum(
        torch.searchsorted(block_cdf, target, right=True),
        torch.searchsorted(block_cdf, total),
    ).clamp(max=block_cdf.shape[1] - 1)
    before = torch.where(block > 0, block_cdf.gather(1, (block - 1).clamp(min=0)), 0.0)
    columns = block * CDF_BLOCK + torch.arange(CDF_BLOCK)
    inside = columns < vocab
    cdf = torch.cumsum(p.gather(1, columns.clamp(max=vocab - 1)).double() * inside, 1)
    token = torch.minimum(
        torch.searchsorted(cdf, (target - before).clamp(min=0), right=True),
        torch.searchsorted(cdf, cdf[:, -1:].contiguous()),
    ).clamp(max=CDF_BLOCK - 1)
    valid = torch.isfinite(total[:, 0]) & (total[:, 0] > 0)
    return (block * CDF_BLOCK + token)[:, 0], valid


def _inverse_cdf_of_row(row: Any, u: Any) -> tuple[Any, Any]:
    """(tokens [N], valid [N]) at masses u [N] of one row [V] (as
    `_inverse_cdf_by_blocks`, with the row's prefix sums: for many draws)."""
    torch = _torch()
    cdf = torch.cumsum(row.double(), 0)
    total = cdf[-1]
    last = torch.searchsorted(cdf, total[None])
    token = torch.searchsorted(cdf, u * total, right=True).clamp(max=int(last[0]))
    valid = bool(torch.isfinite(total) and total > 0)
    return token, torch.full(u.shape, valid)


def softmax(logits: Any, temperature: Any = None, enable_pdl: bool | None = None) -> Any:
    """float32 softmax of logits [B, V] / temperature (a number or [B]).

    Examples
    --------
    >>> import torch, pagedkv.sampling as s
    >>> s.softmax(torch.tensor([[0.0, 0.0]]))
    tensor([[0.5000, 0.5000]])
    """
    del enable_pdl
    x = _rows(logits, "logits")
    if temperature is not None:
        x = x / _per_row(temperature, x.shape[0], "temperature", _torch().float32)
    return _torch().softmax(x, dim=-1)


def sampling_from_probs(
    probs, indices=None, deterministic=True, generator=None, check_nan=False, seed=None,
    offset=None, return_valid=False,
):  # fmt: skip
    """A token a row of probs [B, V] (or a row a entry of indices).

    Examples
    --------
    >>> import torch, pagedkv.sampling as s
    >>> s.sampling_from_probs(torch.tensor([[0.0, 1.0, 0.0]]))
    tensor([1], dtype=torch.int32)
    """
    p = _probs(probs, check_nan)
    return _draw(p, indices, generator, seed, offset, return_valid)


def sampling_from_logits(
    logits, indices=None, deterministic=True, generator=None, check_nan=False, seed=None,
    offset=None,
):  # fmt: skip
    """`sampling_from_probs` of softmax(logits)."""
    return _draw(softmax(logits), indices, generator, seed, offset, False)


def top_p_sampling_from_probs(
    probs, top_p, indices=None, deterministic=True, generator=None, check_nan=False,
    seed=None, offset=None, return_valid=False,
):  # fmt: skip
    """A token a row from the tokens top-p keeps."""
    p = _probs(probs, check_nan)
    return _draw(p * top_p_mask(p, top_p), indices, generator, seed, offset, return_valid)


def top_k_sampling_from_probs(
    probs, top_k, indices=None, deterministic=True, generator=None, check_nan=False,
    seed=None, offset=None, return_valid=False,
):  # fmt: skip
    """A token a row from the tokens top-k keeps."""
    p = _probs(probs, check_nan)
    return _draw(p * top_k_mask(p, top_k), indices, generator, seed, offset, return_valid)


def min_p_sampling_from_probs(
    probs, min_p, indices=None, deterministic=True, generator=None, check_nan=False,
    seed=None, offset=None, return_valid=False,
):  # fmt: skip
    """A token a row from the tokens min-p keeps."""
    p = _probs(probs, check_nan)
    return _draw(p * min_p_mask(p, min_p), indices, generator, seed, offset, return_valid)


def _top_k_top_p(probs: Any, top_k: Any, top_p: Any, order: str) -> Any:
    if order == "top_k_first":
        renormed = _renormalized(probs, top_k_mask(probs, top_k))
        return renormed * top_p_mask(renormed, top_p)
    if order == "joint":
        return probs * (top_k_mask(probs, top_k) & top_p_mask(probs, top_p))
    raise ValueError(f"filter_apply_order must be 'top_k_first' or 'joint', got {order!r}")


def top_k_top_p_sampling_from_probs(
    probs, top_k, top_p, indices=None, filter_apply_order="top_k_first", deterministic=True,
    generator=None, check_nan=False, seed=None, offset=None, return_valid=False,
):  # fmt: skip
    """A token a row after top-k and top-p (module docstring)."""
    p = _probs(probs, check_nan)
    kept = _top_k_top_p(p, top_k, top_p, filter_apply_order)
    return _draw(kept, indices, generator, seed, offset, return_valid)


def top_k_top_p_sampling_from_logits(
    logits, top_k, top_p, indices=None, filter_apply_order="top_k_first", deterministic=True,
    generator=None, check_nan=False, seed=None, offset=None,
):  # fmt: skip
    """`top_k_top_p_sampling_from_probs` of softmax(logits)."""
    kept = _top_k_top_p(softmax(logits), top_k, top_p, filter_apply_order)
    return _draw(kept, indices, generator, seed, offset, False)


def top_p_renorm_probs(probs: Any, top_p: Any, is_deterministic: bool = False) -> Any:
    """probs [B, V] with what top-p drops zeroed, renormalized (float32)."""
    p = _rows(probs, "probs")
    return _renormalized(p, top_p_mask(p, top_p))


def top_k_renorm_probs(probs: Any, top_k: Any, is_deterministic: bool = False) -> Any:
    """probs [B, V] with what top-k drops zeroed, renormalized (float32)."""
    p = _rows(probs, "probs")
    return _renormalized(p, top_k_mask(p, top_k)).to(probs.dtype)


def top_k_mask_logits(logits: Any, top_k: Any) -> Any:
    """logits [B, V] with what top-k drops set to -inf (logits' dtype)."""
    x = _rows(logits, "logits")
    return x.masked_fill(~top_k_mask(x, top_k), float("-inf")).to(logits.dtype)


def chain_speculative_sampling(
    draft_probs, draft_token_ids, target_probs, maybe_output_accepted_token_num=None,
    maybe_output_emitted_draft_token_num=None, deterministic=True, generator=None, seed=None,
    offset=None,
):  # fmt: skip
    """Speculative sampling (Leviathan et al.; Chen et al.) of a chain of n
    draft tokens a request: draft_probs [B, n, V], draft_token_ids [B, n],
    target_probs [B, n + 1, V].

    Draft token i is kept with probability min(1, target / draft); the
    first one refused is replaced by a draw from the normalized
    max(0, target - draft) and the rest are -1; when all n are kept a bonus
    token is drawn from target_probs[:, n]. Returns (output_token_ids
    [B, n + 1] int32, accepted [B]: draft tokens whose test passed, counted
    independently, emitted [B]: draft tokens kept before the first
    refusal), the counts added into the maybe_output_* tensors when given.
    """
    torch = _torch()
    if draft_probs.dim() != 3 or target_probs.dim() != 3:
        raise ValueError("draft_probs must be [B, n, V] and target_probs [B, n + 1, V]")
    batch, n, vocab = draft_probs.shape
    if tuple(draft_token_ids.shape) != (batch, n) or tuple(target_probs.shape) != (
        batch,
        n + 1,
        vocab,
    ):
        raise ValueError("draft_token_ids must be [B, n] and target_probs [B, n + 1, V]")
    if draft_token_ids.is_floating_point() or draft_token_ids.dtype == torch.bool:
        raise TypeError(f"draft_token_ids must be integers, got {draft_token_ids.dtype}")
    if draft_token_ids.numel() and (
        int(draft_token_ids.min()) < 0 or int(draft_token_ids.max()) >= vocab
    ):
        raise ValueError(f"draft_token_ids must be token ids in [0, {vocab})")
    u = _uniforms(batch * (n + 1), generator, seed, offset).reshape(batch, n + 1)
    out = torch.full((batch, n + 1), -1, dtype=torch.int32)
    accepted = torch.zeros(batch, dtype=torch.int32)
    emitted = torch.zeros(batch, dtype=torch.int32)
    draft, target = draft_probs.double().cpu(), target_probs.double().cpu()
    tokens = draft_token_ids.long().cpu()
    for b in range(batch):
        stopped = False
        for i in range(n):
            t = int(tokens[b, i])
            passed = bool(u[b, i] * draft[b, i, t] < target[b, i, t])
            accepted[b] += int(passed)
            if stopped:
                continue
            if passed:
                out[b, i] = t
                emitted[b] += 1
                continue
            residual = (target[b, i] - draft[b, i]).clamp(min=0)
            out[b, i] = _inverse_cdf(residual, float(u[b, n]))
            stopped = True
        if not stopped:
            out[b, n] = _inverse_cdf(target[b, n], float(u[b, n]))
    for given, counts in (
        (maybe_output_accepted_token_num, accepted),
        (maybe_output_emitted_draft_token_num, emitted),
    ):
        if given is not None:
            given += counts.to(given.device, given.dtype)
    device = draft_probs.device
    accepted_out = accepted.to(device) if maybe_output_accepted_token_num is None else (
        maybe_output_accepted_token_num)  # fmt: skip
    emitted_out = emitted.to(device) if maybe_output_emitted_draft_token_num is None else (
        maybe_output_emitted_draft_token_num)  # fmt: skip
    return out.to(device), accepted_out, emitted_out


def _inverse_cdf(weights: Any, u: float) -> int:
    """The token at mass u of the normalized weights [V] (the last nonzero
    one when rounding leaves u past the end)."""
    torch = _torch()
    cdf = torch.cumsum(weights, dim=0)
    total = float(cdf[-1])
    if not total > 0:
        return 0
    hit = int(torch.searchsorted(cdf, torch.tensor([u * total], dtype=cdf.dtype), right=True))
    return min(hit, int(torch.nonzero(weights).max()))
