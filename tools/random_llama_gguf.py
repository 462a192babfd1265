"""Writes a Llama, Qwen or Gemma 2 GGUF of random weights in any shape, with the
tokenizer of another GGUF: a stand-in for models this host cannot download,
for comparing pagedkv with llama.cpp on the same file (their logits and
token ids with `tools/llamacpp_logits.py --gguf`, their speed with
`benchmarks/serve_vs_llamacpp.py --gguf`).

    python tools/random_llama_gguf.py OUT.gguf [--arch llama|qwen2|qwen3|gemma2]
        [--hidden 2048 --layers 16 --heads 32 --kv-heads 8 --ffn 8192]
        [--head-dim 128] [--type F16|F32|Q8_0]
        [--rope-freqs llama3|random] [--rope-scaling linear:F|yarn:F[:ORIGINAL]]
        [--tokenizer-from PATH] [--tokenizer-pre NAME]
        [--window 4096] [--soft-caps 50,30]

The tokenizer (every `tokenizer.*` key) comes from `--tokenizer-from`
(default: SmolLM2-135M-Instruct's GGUF, as pagedkv fetches it), so the
vocabulary is its size; `--tokenizer-pre` replaces its pre-tokenizer name
(`tokenizer.ggml.pre`, e.g. llama-bpe or qwen2: the same merges, text split
another way) and leaves out `add_bos_token` (Llama 3's files then start
prompts with BOS, as its name's default). Matrices are stored as llama.cpp's converter stores a
Hugging Face model: a Llama's Q and K rows permuted for its adjacent-pair
RoPE, a Qwen's or a Gemma's as they are, beside Qwen 2's Q, K and V biases,
Qwen 3's per-head query and key norms or Gemma 2's norms after the
attention and the MLP (its window and soft caps from `--window` and
`--soft-caps`);
requantize the file with `llama-quantize` for K-quant mixes such as
Q4_K_M. `--rope-freqs llama3` writes the `rope_freqs` tensor of Llama 3.1's
scaling (factor 8, low 1, high 4, 8192 original positions); `random` writes
factors drawn from [0.25, 4], which move every rotary pair's angle, so that
a reader ignoring them disagrees at once. `--rope-scaling linear:F` writes
linear position scaling by F, `yarn:F:ORIGINAL` YaRN by F over ORIGINAL
positions (the file's context if left out).
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import numpy as np
from gguf import (
    GGMLQuantizationType,
    GGUFReader,
    GGUFValueType,
    GGUFWriter,
    RopeScalingType,
    quants,
)


def llama3_rope_factors(head_dim: int, theta: float) -> np.ndarray:
    """The divisors of each rotary pair's frequency under Llama 3.1's RoPE
    scaling (factor 8, low_freq_factor 1, high_freq_factor 4, 8192 original
    positions), as llama.cpp's converter computes them."""
    factor, low, high, original = 8.0, 1.0, 4.0, 8192
    inv_freq = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / inv_freq
    smooth = (original / wavelen - low) / (high - low)
    mid = 1 / ((1 - smooth) / factor + smooth)
    out = np.where(wavelen < original / high, 1.0, mid)
    return np.where(wavelen > original / low, factor, out).astype(np.float32)


def permute_for_gguf(w: np.ndarray, heads: int) -> np.ndarray:
    """Q or K rows [heads * D, K] from rotate-half order to llama.cpp's
    adjacent pairs (its converter's `permute`)."""
    d = w.shape[0] // heads
    return w.reshape(heads, 2, d // 2, -1).swapaxes(1, 2).reshape(w.shape)


def copy_tokenizer(writer: GGUFWriter, source: Path, pre: str | None = None) -> int:
    """Copies every `tokenizer.*` key of source (`tokenizer.ggml.pre` as
    `pre` where given, and then without `tokenizer.ggml.add_bos_token`,
    so that the name's own default decides); returns its vocabulary size."""
    reader = GGUFReader(source)
    vocab = 0
    for name, field in reader.fields.items():
        if not name.startswith("tokenizer.") or (pre and name == "tokenizer.ggml.add_bos_token"):
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == GGUFValueType.ARRAY else None
        value = pre if name == "tokenizer.ggml.pre" and pre else field.contents()
        writer.add_key_value(name, value, kind, sub)
        if name == "tokenizer.ggml.tokens":
            vocab = len(value)
    return vocab


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--arch", default="llama", choices=("llama", "qwen2", "qwen3", "gemma2"))
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--ffn", type=int, default=512)
    parser.add_argument("--head-dim", type=int, help="default: hidden / heads")
    parser.add_argument("--theta", type=float, default=5e5)
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--type", default="F32", choices=("F32", "F16", "Q8_0"))
    parser.add_argument("--rope-freqs", choices=("llama3", "random"))
    parser.add_argument("--rope-scaling", help="linear:FACTOR or yarn:FACTOR[:ORIGINAL]")
    parser.add_argument("--tokenizer-from", type=Path)
    parser.add_argument("--tokenizer-pre")
    parser.add_argument("--window", type=int, default=4096, help="Gemma 2's sliding window")
    parser.add_argument("--soft-caps", default="50,30", help="Gemma 2's ATTENTION,FINAL caps")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def add_hyperparameters(writer: GGUFWriter, args: argparse.Namespace, head_dim: int) -> None:
    """The architecture's keys: shape, RoPE, and Gemma 2's window and caps."""
    writer.add_name(f"random {args.arch} {args.hidden}x{args.layers}")
    writer.add_block_count(args.layers)
    writer.add_context_length(args.context)
    writer.add_embedding_length(args.hidden)
    writer.add_feed_forward_length(args.ffn)
    writer.add_head_count(args.heads)
    writer.add_head_count_kv(args.kv_heads)
    writer.add_rope_dimension_count(head_dim)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(args.theta)
    writer.add_layer_norm_rms_eps(1e-5)
    if args.rope_scaling:
        kind, factor, *original = args.rope_scaling.split(":")
        writer.add_rope_scaling_type(RopeScalingType(kind))
        writer.add_rope_scaling_factor(float(factor))
        if original:
            writer.add_rope_scaling_orig_ctx_len(int(original[0]))
    if args.arch == "gemma2":
        attention_cap, final_cap = (float(c) for c in args.soft_caps.split(","))
        writer.add_sliding_window(args.window)
        writer.add_attn_logit_softcapping(attention_cap)
        writer.add_final_logit_softcapping(final_cap)


def main() -> None:
    args = parse_args()
    source = args.tokenizer_from
    if source is None:
        from pagedkv.models.fetch import fetch_gguf

        source = fetch_gguf("smollm2-135m-instruct")
    rng = np.random.default_rng(args.seed)
    hidden, head_dim = args.hidden, args.head_dim or args.hidden // args.heads
    writer = GGUFWriter(str(args.out), args.arch)
    add_hyperparameters(writer, args, head_dim)
    vocab = copy_tokenizer(writer, source, args.tokenizer_pre)
    kind = GGMLQuantizationType[args.type]

    def matrix(name: str, rows: int, cols: int, scale: float | None = None) -> None:
        w = rng.standard_normal((rows, cols), np.float32) * (scale or 1 / math.sqrt(cols))
        if args.arch == "llama" and name.endswith(("attn_q.weight", "attn_k.weight")):
            heads = args.heads if name.endswith("attn_q.weight") else args.kv_heads
            w = permute_for_gguf(w, heads)
        if kind == GGMLQuantizationType.F16:
            w = w.astype(np.float16)
        elif kind != GGMLQuantizationType.F32:
            w = quants.quantize(w, kind)
        writer.add_tensor(name, w, raw_dtype=kind)

    def norm(name: str, size: int = hidden) -> None:
        writer.add_tensor(name, (1 + 0.1 * rng.standard_normal(size)).astype(np.float32))

    # Logits of about 3 standard deviations through the tied head.
    matrix("token_embd.weight", vocab, hidden, scale=3 / math.sqrt(hidden))
    norm("output_norm.weight")
    if args.rope_freqs == "llama3":
        factors = llama3_rope_factors(head_dim, args.theta)
    elif args.rope_freqs == "random":
        factors = np.exp(rng.uniform(np.log(0.25), np.log(4), head_dim // 2)).astype(np.float32)
    if args.rope_freqs:
        writer.add_tensor("rope_freqs.weight", factors)
    q, kv = args.heads * head_dim, args.kv_heads * head_dim
    for i in range(args.layers):
        norm(f"blk.{i}.attn_norm.weight")
        matrix(f"blk.{i}.attn_q.weight", q, hidden)
        matrix(f"blk.{i}.attn_k.weight", kv, hidden)
        matrix(f"blk.{i}.attn_v.weight", kv, hidden)
        if args.arch == "qwen3":
            norm(f"blk.{i}.attn_q_norm.weight", head_dim)
            norm(f"blk.{i}.attn_k_norm.weight", head_dim)
        if args.arch == "qwen2":
            for part, size in (("q", q), ("k", kv), ("v", kv)):
                bias = 0.5 * rng.standard_normal(size).astype(np.float32)
                writer.add_tensor(f"blk.{i}.attn_{part}.bias", bias)
        matrix(f"blk.{i}.attn_output.weight", hidden, q)
        norm(f"blk.{i}.ffn_norm.weight")
        matrix(f"blk.{i}.ffn_gate.weight", args.ffn, hidden)
        matrix(f"blk.{i}.ffn_up.weight", args.ffn, hidden)
        matrix(f"blk.{i}.ffn_down.weight", hidden, args.ffn)
        if args.arch == "gemma2":
            norm(f"blk.{i}.post_attention_norm.weight")
            norm(f"blk.{i}.post_ffw_norm.weight")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    print(
        f"{args.out}: {args.arch}, {args.layers} layers of {hidden}, vocabulary {vocab}, "
        f"{args.type}"
    )


if __name__ == "__main__":
    main()
