"""pagedkv.sampling (FlashInfer's flashinfer.sampling) against rules written
here from FlashInfer's definitions, and draw frequencies against the
distributions they come from (fixed generators: the draws are the same on
every run)."""

from __future__ import annotations

import numpy as np
import pytest

import pagedkv.sampling as sampling

torch = pytest.importorskip("torch")


def probs_rows(seed: int, batch: int, vocab: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    p = torch.rand(batch, vocab, generator=g) ** 3
    return p / p.sum(-1, keepdim=True)


def keeps(probs: torch.Tensor, rule) -> np.ndarray:
    """bool [B, V] by a per-row rule over float64 values."""
    return np.stack([rule(row) for row in probs.double().numpy()])


def top_p_rule(p):
    def rule(row):
        # Most likely first; a token stays while the mass before it is < p.
        order = np.argsort(-row, kind="stable")
        before = np.concatenate([[0.0], np.cumsum(row[order])[:-1]])
        keep = np.zeros(row.shape, bool)
        keep[order[before < p]] = True
        return keep

    return rule


def test_filters_keep_what_the_rules_keep():
    probs = probs_rows(1, 6, 50)
    probs[0, :4] = probs[0, 4]  # ties at the k-th value stay
    probs = probs / probs.sum(-1, keepdim=True)
    k = torch.tensor([1, 3, 5, 7, 50, 200])
    want_k = keeps(probs, lambda row: row >= np.sort(row)[::-1][min(5, len(row)) - 1])
    np.testing.assert_array_equal(sampling.top_k_mask(probs, 5).numpy(), want_k)
    got_k = sampling.top_k_mask(probs, k).numpy()
    for b in range(6):
        kth = np.sort(probs[b].double().numpy())[::-1][min(int(k[b]), 50) - 1]
        np.testing.assert_array_equal(got_k[b], probs[b].double().numpy() >= kth)
    for p in (0.1, 0.5, 0.9, 1.0):
        np.testing.assert_array_equal(
            sampling.top_p_mask(probs, p).numpy(), keeps(probs, top_p_rule(p))
        )
    want_min = keeps(probs, lambda row: row >= 0.3 * row.max())
    np.testing.assert_array_equal(sampling.min_p_mask(probs, 0.3).numpy(), want_min)


def test_renorm_and_mask_logits():
    probs = probs_rows(2, 4, 40)
    renormed = sampling.top_k_renorm_probs(probs, 7)
    keep = sampling.top_k_mask(probs, 7)
    torch.testing.assert_close(renormed.sum(-1), torch.ones(4))
    torch.testing.assert_close(renormed[~keep], torch.zeros(int((~keep).sum())))
    torch.testing.assert_close(renormed[keep] / probs[keep], (1 / (probs * keep).sum(-1))
                               .repeat_interleave(keep.sum(-1)))  # fmt: skip
    logits = torch.log(probs)
    masked = sampling.top_k_mask_logits(logits, 7)
    assert torch.equal(torch.isinf(masked), ~keep)
    torch.testing.assert_close(torch.softmax(masked, -1), renormed)
    top_p = sampling.top_p_renorm_probs(probs, 0.6)
    torch.testing.assert_close(top_p.sum(-1), torch.ones(4))


@pytest.mark.parametrize(
    ("draw", "keep"),
    [
        (lambda p, i, g: sampling.sampling_from_probs(p, i, generator=g), None),
        (lambda p, i, g: sampling.top_p_sampling_from_probs(p, 0.7, i, generator=g), "top_p"),
        (lambda p, i, g: sampling.top_k_sampling_from_probs(p, 9, i, generator=g), "top_k"),
        (lambda p, i, g: sampling.min_p_sampling_from_probs(p, 0.2, i, generator=g), "min_p"),
        (
            lambda p, i, g: sampling.top_k_top_p_sampling_from_logits(
                torch.log(p), 9, 0.7, i, generator=g
            ),
            "top_k_top_p",
        ),  # fmt: skip
    ],
)
def test_draw_frequencies_follow_the_kept_distribution(draw, keep):
    probs = probs_rows(3, 2, 30)
    masks = {
        None: torch.ones_like(probs, dtype=torch.bool),
        "top_p": sampling.top_p_mask(probs, 0.7),
        "top_k": sampling.top_k_mask(probs, 9),
        "min_p": sampling.min_p_mask(probs, 0.2),
    }
    if keep == "top_k_top_p":
        renormed = sampling.top_k_renorm_probs(probs, 9)
        mask = sampling.top_p_mask(renormed, 0.7) & masks["top_k"]
        want = renormed * mask
    else:
        mask = masks[keep]
        want = probs * mask
    want = want / want.sum(-1, keepdim=True)
    trials = 40_000
    indices = torch.tensor([0, 1]).repeat_interleave(trials)
    samples = draw(probs, indices, torch.Generator().manual_seed(7))
    assert samples.dtype == indices.dtype and samples.shape == (2 * trials,)
    for b in range(2):
        got = torch.bincount(samples[b * trials : (b + 1) * trials], minlength=30).double()
        assert bool(mask[b][got > 0].all())  # nothing dropped is ever drawn
        assert float((got / trials - want[b].double()).abs().max()) < 0.01


def test_seed_offset_reproduce_and_invalid_rows_report():
    probs = probs_rows(4, 3, 100)
    a = sampling.sampling_from_probs(probs, seed=5, offset=2)
    assert torch.equal(a, sampling.sampling_from_probs(probs, seed=5, offset=2))
    many = [sampling.sampling_from_probs(probs, seed=5, offset=o) for o in range(8)]
    assert len({tuple(m.tolist()) for m in many}) > 1
    probs[1] = 0
    samples, valid = sampling.sampling_from_probs(probs, return_valid=True)
    assert valid.tolist() == [True, False, True] and samples.dtype == torch.int32
    with pytest.raises(ValueError, match="NaN"):
        sampling.sampling_from_probs(torch.full((1, 4), float("nan")), check_nan=True)
    with pytest.raises(ValueError, match="indices"):
        sampling.sampling_from_probs(probs, torch.tensor([3]))


def test_softmax_temperature():
    logits = torch.tensor([[1.0, 2.0, 3.0], [0.0, 0.0, 4.0]])
    got = sampling.softmax(logits, torch.tensor([2.0, 0.5]))
    want = torch.softmax(logits / torch.tensor([[2.0], [0.5]]), -1)
    torch.testing.assert_close(got, want)


def test_chain_speculative_sampling_keeps_the_target_distribution():
    """The first emitted token of speculative sampling is distributed as the
    target's first row, whatever the draft (the method's invariant)."""
    vocab, n, batch = 6, 2, 30_000
    g = torch.Generator().manual_seed(9)
    target = torch.softmax(torch.randn(1, n + 1, vocab, generator=g) * 2, -1)
    draft = torch.softmax(torch.randn(1, n, vocab, generator=g) * 2, -1)
    tokens = torch.multinomial(draft[0, 0].expand(batch, vocab), 1, True, generator=g)
    tokens = torch.cat([tokens, torch.zeros(batch, n - 1, dtype=torch.int64)], 1)
    counted = torch.zeros(batch, dtype=torch.int32)
    out, accepted, emitted = sampling.chain_speculative_sampling(
        draft.expand(batch, n, vocab), tokens, target.expand(batch, n + 1, vocab),
        maybe_output_emitted_draft_token_num=counted, generator=g,
    )  # fmt: skip
    assert emitted is counted and out.shape == (batch, n + 1)
    first = torch.bincount(out[:, 0].long(), minlength=vocab).double() / batch
    assert float((first - target[0, 0].double()).abs().max()) < 0.012
    # After the first refusal every slot is -1; emitted counts the kept prefix.
    for row, e in zip(out[:200], emitted[:200], strict=True):
        assert bool((row[int(e) + 1 :] == -1).all()) and bool((row[: int(e) + 1] >= 0).all())
    assert bool((accepted >= emitted).all())


@pytest.mark.parametrize(
    ("given", "message"),
    [
        (lambda t: t.full((3, 2), 0.5), "got a 2D tensor"),
        (lambda t: t.tensor(0.5), "got a 0-dimensional tensor"),
        (lambda t: t.tensor([0.5]), "batch size mismatch"),
    ],
)
def test_parameter_tensors_have_one_value_a_row(given, message):
    """FlashInfer's rule and messages: a number, or a tensor [batch]."""
    probs = torch.softmax(torch.randn(3, 40), -1)
    with pytest.raises(ValueError, match=message):
        sampling.top_p_sampling_from_probs(probs, given(torch))
    with pytest.raises(ValueError, match=message):
        sampling.softmax(probs, given(torch))
    kept = sampling.top_k_renorm_probs(probs, torch.tensor([1, 2, 40]))
    assert (kept > 0).sum(-1).tolist() == [1, 2, 40]


def test_speculative_sampling_refuses_ids_outside_the_vocabulary():
    """Draft token ids index the vocabulary: a negative one (which torch
    would read from the end), one past it, float ids or a target of another
    vocabulary raise before any count is added."""
    torch = pytest.importorskip("torch")
    draft = torch.full((1, 2, 4), 0.25)
    target = torch.full((1, 3, 4), 0.25)
    accepted = torch.zeros(1, dtype=torch.int32)
    cases = [
        (torch.tensor([[-1, 2]]), target, ValueError, r"token ids in \[0, 4\)"),
        (torch.tensor([[1, 4]]), target, ValueError, r"token ids in \[0, 4\)"),
        (torch.tensor([[1.0, 2.0]]), target, TypeError, "integers"),
        (torch.tensor([[1, 2]]), torch.full((1, 3, 5), 0.2), ValueError, "target_probs"),
    ]
    for ids, tgt, error, message in cases:
        with pytest.raises(error, match=message):
            sampling.chain_speculative_sampling(draft, ids, tgt, accepted)
        assert int(accepted[0]) == 0
    with pytest.raises(TypeError, match="indices"):
        sampling.sampling_from_probs(torch.full((2, 4), 0.25), torch.tensor([0.0, 1.0]))
