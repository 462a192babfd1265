"""Model families as descriptions: a small random model with Gemma 3's
block (QK-norm, sandwich norms, GELU-tanh, scaled embeddings, sliding-window
layers with their own RoPE base beside global ones) through the step graphs
and the page manager's layer groups, against the float64 NumPy reference;
the GGUF reader's refusals.

The model and its engine: gemma3_shaped.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from conftest import (
    assert_exact_and_released,
    assert_greedy_steps_match,
    shared_prompt_requests,
)
from gemma3_shaped import CONFIG, PAGE, WEIGHTS_SEED, WINDOW, engine
from pagedkv.graphs.model import DecoderConfig, init_weights
from pagedkv.graphs.numpy_reference import DenseDecoder
from pagedkv.graphs.scheduler import Scheduler

WARM_GRAPHS = ("gemma3-shaped", "gemma3-shaped-q8_0-int8", "gemma3-shaped-q8_0")
"""Compiled ahead beside the suite's first tests (warm_graphs.py)."""


@pytest.fixture(scope="module")
def gemma_weights():
    return init_weights(CONFIG, seed=WEIGHTS_SEED)


def test_layer_groups_come_from_the_windows():
    assert CONFIG.layer_groups == [((1,), None), ((0, 2), WINDOW)]
    assert DecoderConfig().layer_groups is None  # Llama: one plain group
    assert CONFIG.rope_theta_of(WINDOW) == 1e4 and CONFIG.rope_theta_of(None) == 1e6
    with pytest.raises(ValueError, match="windows has 2 entries"):
        DecoderConfig(num_layers=4, windows=(8, None))
    with pytest.raises(ValueError, match="activation"):
        DecoderConfig(activation="relu")


def test_prefill_and_decode_past_the_window_equal_numpy(gemma_weights):
    """A ragged prefill (one prompt shorter than the window, two longer) and
    decode steps that carry every request past it: the logits of every step
    equal the dense reference's, while the window group gives pages back."""
    e = engine(gemma_weights, 64)
    rng = np.random.default_rng(11)
    prompts = [rng.integers(0, CONFIG.vocab_size, n).tolist() for n in (5, 19, 33)]
    ids = ["a", "b", "c"]
    assert_greedy_steps_match(e, CONFIG, gemma_weights, ids, prompts, 14)
    window_group, null = 1, e.manager.null_pages[1]
    for i in ids:
        pages = e.manager.pages(i, window_group)
        live = pages[pages != null]
        # The window's keys span at most ceil(WINDOW / PAGE) + 1 pages.
        assert len(live) <= -(-WINDOW // PAGE) + 1 < len(pages)
        assert (e.manager.pages(i, 0) != null).all()
    e.manager.validate()


def test_scheduler_shares_prefixes_and_forks_across_layer_groups(gemma_weights):
    """Requests sharing a system prompt longer than the window and ending
    mid-page, one of them sampled twice (a fork), in a pool too small for
    all at once: the prompt's last page is copied in part in both layer
    groups, every generated token agrees with the reference and every page
    comes back."""
    e = engine(gemma_weights, 40)
    rng = np.random.default_rng(5)
    requests = shared_prompt_requests(
        rng, CONFIG.vocab_size, 6 * PAGE + 2, [3, 4, 5, 6], [10, 14, 18, 22], forked=1
    )
    sequences, _ = Scheduler(e, keep_logits=True).run(requests)
    assert [len(s.tokens) for s in sequences] == [10, 14, 14, 18, 22]
    assert e.manager.stats.prefix_hits > 0 and e.manager.stats.partial_hit_tokens > 0
    assert_exact_and_released(e, CONFIG, gemma_weights, sequences)


OWN_TOKENS = [3, 6, 4, 5, 1, 2, 9, 7]
"""Tokens of their own after a shared prompt, per request, out of order:
their windows start in three pages, and the rows of one shared item are
not at consecutive positions."""


def prefill_on_one_prompt(e, rng):
    """Requests r0, r1, .. on one 10-page prompt with OWN_TOKENS of their
    own: r0 prefilled first, the rest on its cached pages. Returns (ids,
    prompts, the prefills' logits)."""
    system = rng.integers(0, CONFIG.vocab_size, 10 * PAGE).tolist()
    prompts = [system + rng.integers(0, CONFIG.vocab_size, n).tolist() for n in OWN_TOKENS]
    ids = [f"r{i}" for i in range(len(OWN_TOKENS))]
    e.manager.add(ids[0])
    first = e.prefill(ids[:1], prompts[:1])
    hits = [e.manager.add(i, p) for i, p in zip(ids[1:], prompts[1:], strict=True)]
    assert hits == [10 * PAGE] * (len(ids) - 1)
    rest = e.prefill(ids[1:], [p[h:] for h, p in zip(hits, prompts[1:], strict=True)])
    return ids, prompts, np.concatenate([first, rest])


def test_decode_shares_a_prompt_inside_the_window_too(gemma_weights):
    """Decode reads a shared prompt's pages once for neighbours whose
    windows start in the same page, in the window group too, each row
    masked at its own position, until the windows have passed the prompt;
    every step's logits equal the NumPy model's."""
    e = engine(gemma_weights, 128)
    ids, prompts, logits = prefill_on_one_prompt(e, np.random.default_rng(13))
    refs = [DenseDecoder(CONFIG, gemma_weights) for _ in prompts]
    want = np.stack([r.feed(p) for r, p in zip(refs, prompts, strict=True)])
    np.testing.assert_allclose(logits, want, rtol=1e-4, atol=1e-4)
    plans = []
    work = e._work
    e._work = lambda kind, meta: plans.append((meta.window_left, work(kind, meta))) or plans[-1][1]
    most_shared = []
    for _ in range(12):
        plans.clear()
        nxt = want.argmax(-1)
        logits = e.decode(ids, nxt)
        want = np.stack([r.feed([int(t)]) for r, t in zip(refs, nxt, strict=True)])
        np.testing.assert_allclose(logits, want, rtol=1e-4, atol=1e-4)
        most_shared.append(max(items[:, 2].max() for w, (items, _) in plans if w >= 0))
    # Four requests (16 rows: matrix products) share at first; none once
    # every window starts past the prompt.
    assert most_shared[0] == 4 and most_shared[-1] == 1, most_shared


def test_int8_pages_shared_inside_the_window_equal_them_read_alone(gemma_weights):
    """The same requests over an int8 pool (as served: the GGUF form's
    products), whose shared items multiply codes: every step's logits as
    with each request reading its own keys (sharing off), within what the
    codes' rounding costs where it moves an activation of the next Q8_0
    product to a neighbouring code (observed: under 6e-3 relative, against
    4e-2 or more with rows masked at their neighbours' positions)."""
    from pagedkv.graphs.model import quantize_weights

    dense, packed = quantize_weights(CONFIG, gemma_weights, "Q8_0")
    steps = []
    for share in (True, False):
        e = engine(dense, 128, packed, kv_dtype="int8")
        e.share_prefixes = share
        ids, _, logits = prefill_on_one_prompt(e, np.random.default_rng(13))
        tokens = np.random.default_rng(14).integers(0, CONFIG.vocab_size, (12, len(ids)))
        steps.append(np.stack([logits, *(e.decode(ids, t.tolist()) for t in tokens)]))
    err = np.linalg.norm(steps[0] - steps[1], axis=-1) / np.linalg.norm(steps[1], axis=-1)
    assert (err < 2e-2).all(), err.max(axis=1)


def test_fused_quantized_layers_equal_numpy(gemma_weights):
    """The GGUF form with every product in Q8_0 blocks: each layer is one
    fused op (QK-norm, sandwich norms and GeGLU as its phases, the window
    layers' attention through their window), through a prefill and decode
    past the window, sharing a prompt between two requests. Each step's
    logits equal those of the reference that quantizes every product's
    activations, within what an activation a rounding away from a code
    boundary costs when it lands one code apart (float32 against float64;
    the op-by-op graph does the same): observed 2e-7 relative, 5e-3 with
    such a code, against 0.3 or more for a wrong norm or activation."""
    from pagedkv.graphs.model import quantize_weights

    dense, packed = quantize_weights(CONFIG, gemma_weights, "Q8_0")
    e = engine(dense, 64, packed)
    rng = np.random.default_rng(13)
    shared = rng.integers(0, CONFIG.vocab_size, 16).tolist()
    prompts = [shared + rng.integers(0, CONFIG.vocab_size, n).tolist() for n in (3, 9)]
    ids = ["a", "b"]
    refs = [DenseDecoder(CONFIG, dense, quantized=set(packed)) for _ in ids]
    e.manager.add("a")
    logits = [e.prefill(["a"], [prompts[0]])[0]]
    cached = e.manager.add("b", prompts[1][:-1])
    assert cached > 0
    logits.append(e.prefill(["b"], [prompts[1][cached:]])[0])
    want = np.stack([r.feed(p) for r, p in zip(refs, prompts, strict=True)])

    def close(got) -> bool:
        err = np.linalg.norm(np.stack(got) - want, axis=-1) / np.linalg.norm(want, axis=-1)
        return bool((err < 2e-2).all())

    for _ in range(16):
        assert close(logits)
        nxt = want.argmax(-1)
        logits = list(e.decode(ids, nxt))
        want = np.stack([r.feed([int(t)]) for r, t in zip(refs, nxt, strict=True)])
    assert close(logits)
    e.manager.validate()


def assert_steps_match(e, dense, quantized: set[str], seed: int) -> None:
    """Two random prompts (7 and 30 tokens) prefilled in one step and ten
    greedy decode steps on engine e: every step's logits are within 5e-3 of
    the reference's over `dense` that quantizes the activations of the
    products named in `quantized`."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, CONFIG.vocab_size, n).tolist() for n in (7, 30)]
    ids = ["a", "b"]
    for i in ids:
        e.manager.add(i)
    refs = [DenseDecoder(CONFIG, dense, quantized=quantized) for _ in ids]
    logits = e.prefill(ids, prompts)
    want = np.stack([r.feed(p) for r, p in zip(refs, prompts, strict=True)])
    for _ in range(10):
        assert np.abs(logits - want).max() < 5e-3
        nxt = want.argmax(-1)
        logits = e.decode(ids, nxt)
        want = np.stack([r.feed([int(t)]) for r, t in zip(refs, nxt, strict=True)])
    assert np.abs(logits - want).max() < 5e-3


@pytest.mark.slow
def test_quantized_and_float_products_in_one_graph_equal_numpy(gemma_weights):
    """The GGUF form of a model whose output projection is in a format the
    quantized product does not take, and whose down projection is in such a
    format in every other layer only (as Gemma's Q4_K_M file mixes Q4_K and
    Q6_K): those stay float32 products while the others multiply Q8_0
    blocks with quantized activations, through one layer subgraph per
    window and set of formats. Each step's logits equal the reference's
    that quantizes the same products' activations, within the rounding of a
    code that lands one step apart (observed: 1e-6; a reference that
    quantizes every product's activations, or none, is 0.07 to 0.09 off)."""
    from pagedkv.graphs.model import quantize_weights

    dense, packed = quantize_weights(CONFIG, gemma_weights, "Q8_0")
    for i in range(CONFIG.num_layers):
        del packed[f"layers.{i}.wo"]
        if i % 2:
            del packed[f"layers.{i}.w_down"]
    e = engine(dense, 64, packed)
    quantized = {"wqkv", "w_gate_up", "lm_head"}
    quantized |= {f"layers.{i}.w_down" for i in range(0, CONFIG.num_layers, 2)}
    assert_steps_match(e, dense, quantized, seed=12)


@pytest.mark.slow
def test_a_qkv_product_in_two_formats_equals_numpy(gemma_weights):
    """Q and K in one format and V in another, in every other layer (as
    llama.cpp's Q4_K_M stores V in Q6_K in half the layers): those layers
    multiply two quantized products side by side ("wqk" in Q8_0, "wv" in
    Q4_1), the first inside its fused layer op, the last op by op (its
    output projection stays float), the others one fused op each with one
    Q|K|V product. Each step's logits equal the reference's that quantizes
    the same products' activations, within the rounding of a code that
    lands one step apart (V's products shifted by 0.05 are 0.08 off; their
    scale alone is invisible behind Gemma's post-attention norm)."""
    from gguf import GGMLQuantizationType, quants

    from pagedkv._ops.quantized_panels import pack_quantized_weight
    from pagedkv.graphs.model import quantize_weights

    dense, packed = quantize_weights(CONFIG, gemma_weights, "Q8_0")
    nqk = (CONFIG.num_qo_heads + CONFIG.num_kv_heads) * CONFIG.head_dim
    for i in range(0, CONFIG.num_layers, 2):
        name = f"layers.{i}.wqkv"
        del packed[name]
        w, dense[name] = gemma_weights[name], dense[name].copy()  # [K, N]
        for part, cols, fmt in (("wqk", slice(0, nqk), "Q8_0"), ("wv", slice(nqk, None), "Q4_1")):
            kind = GGMLQuantizationType[fmt]
            raw = quants.quantize(np.ascontiguousarray(w[:, cols].T), kind)
            n, k = w[:, cols].shape[1], w.shape[0]
            packed[f"layers.{i}.{part}"] = pack_quantized_weight(raw, fmt, n, k)
            dense[name][:, cols] = quants.dequantize(raw, kind).T
    last = CONFIG.num_layers - 1
    del packed[f"layers.{last}.wo"]
    e = engine(dense, 64, packed)
    quantized = {"wqkv", "w_gate_up", "w_down", "lm_head"}
    quantized |= {f"layers.{i}.wo" for i in range(last)}
    assert_steps_match(e, dense, quantized, seed=14)


def _tiny_gguf(path, arch: str, tensor_type: str = "F32") -> None:
    """A GGUF holding one tensor and the few keys the reader looks at first."""
    from gguf import GGMLQuantizationType, GGUFWriter, quants

    w = GGUFWriter(str(path), arch)
    w.add_block_count(1)
    data = np.zeros((32, 64), np.float32)
    kind = GGMLQuantizationType[tensor_type]
    if tensor_type != "F32":
        data = quants.quantize(data, kind)
    w.add_tensor("token_embd.weight", data, raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_unsupported_ggufs_fail_at_load_naming_what_is_missing(tmp_path):
    from pagedkv.models.errors import ModelError
    from pagedkv.models.gguf_model import read_gguf

    _tiny_gguf(tmp_path / "mamba.gguf", "mamba")
    with pytest.raises(ModelError, match="'mamba' model; pagedkv serves the architectures"):
        read_gguf(tmp_path / "mamba.gguf")
    _tiny_gguf(tmp_path / "gemma.gguf", "gemma3")
    with pytest.raises(ModelError, match="gemma3.attention.head_count"):
        read_gguf(tmp_path / "gemma.gguf")
