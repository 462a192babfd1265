"""The forms a model's weights and KV cache take when `load` serves it.

- "gguf": the GGUF's own quantized blocks, multiplied in place with float32
  activations quantized per block (CPU only): a decode step reads 4 to 8
  bits per weight. The fastest form on the CPU, and the default there.
- "f32": dequantized to float32, activations in float32: the exact form,
  which matches transformers token for token, and the default on a GPU
  (where the quantized products do not run).
- "bf16": dequantized to bfloat16, activations in bfloat16: half the
  weights' bytes, departing from float32's answers only where its top two
  logits nearly tie. On a GPU its products are taken in float32 (MAX's
  16-bit matmul is wrong there at some shapes: graph_ops.linear).

The cache's dtype is free beside GGUF weights and the weights' own dtype
beside float ones (the float step graphs keep one dtype throughout). An
int8 cache keeps each (token, head) row as int8 codes and a float32 scale:
53% of float16's bytes at head_dim 64.
"""

from __future__ import annotations

import json
from pathlib import Path

from .errors import ModelError

WEIGHTS = ("gguf", "f32", "bf16")
"""How `load` keeps a model's weights: "gguf", the GGUF's own quantized
blocks multiplied in place with float32 activations (CPU); "f32" and
"bf16", dequantized to float32 or bfloat16, activations in the same dtype
(the float32 form matches transformers token for token)."""
KV_DTYPES = ("float32", "float16", "bfloat16", "float8_e4m3fn", "int8")
DEFAULT_KV_DTYPE = {"gguf": "int8", "f32": "float32", "bf16": "bfloat16"}
"""The cache's dtype unless told otherwise: int8 beside GGUF weights (the
fastest on the CPU, half of float16's bytes, and as close to llama.cpp's
float16 cache as float16 is in greedy agreement: docs/performance.md), the
weights' own dtype beside float ones."""


def default_weights(device: str) -> str:
    """The default form on a device: the GGUF's own blocks on the CPU (the
    fastest there), float32 on a GPU (the quantized products run on the CPU,
    and float32 is the form held token for token to transformers there)."""
    return "gguf" if device == "cpu" else "f32"


def add_weights_arguments(parser) -> None:
    """Adds --weights and --kv-dtype (for `load`) to an argparse parser."""
    parser.add_argument(
        "--weights",
        default=None,
        help="gguf (the GGUF's own quantized blocks: the default on the cpu), f32 (exact "
        "against transformers: the default on a gpu) or bf16",
    )
    parser.add_argument(
        "--kv-dtype",
        default=None,
        help="KV cache dtype with --weights gguf: int8 (the default: a byte per element and "
        "a scale per token and head), float16 (llama.cpp's default), bfloat16, float32 or "
        "float8_e4m3fn (a byte per element)",
    )


def add_gguf_argument(parser) -> None:
    """Adds --gguf, --chat-template and --default-chat-template-kwargs (for
    `load`) to an argparse parser."""
    parser.add_argument(
        "--gguf",
        default=None,
        metavar="PATH",
        help="serve this GGUF file (a Llama, Qwen 2/3 or Gemma 2/3 architecture, any of its block "
        "formats) instead of the catalogue's download; --model then only names it",
    )
    parser.add_argument(
        "--chat-template",
        default=None,
        metavar="PATH",
        help="a Jinja chat template file in place of the GGUF's own (e.g. one that renders tools)",
    )
    parser.add_argument(
        "--default-chat-template-kwargs",
        default=None,
        metavar="JSON",
        help="variables the chat template gets unless a request gives its own, e.g. "
        "'{\"enable_thinking\": false}' for Qwen 3 (vLLM's flag)",
    )


def load_from_arguments(
    args,
    progress,
    kv_memory: int | None = None,
    batch_invariant: bool = False,
    reasoning_format: str = "auto",
):
    """`load` of the model a command line names: its --model, --gguf and
    --device, and the --weights and --kv-dtype that add_weights_arguments
    adds; progress lines go to `progress`, kv_memory None is load's
    default. Raises ModelError as load does, where --chat-template cannot
    be read, and where --default-chat-template-kwargs is not a JSON object."""
    from .llm import DEFAULT_KV_MEMORY, load

    template = None
    if args.chat_template is not None:
        try:
            template = Path(args.chat_template).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ModelError(f"--chat-template: {e}") from None
    kwargs = None
    if args.default_chat_template_kwargs is not None:
        try:
            kwargs = json.loads(args.default_chat_template_kwargs)
        except json.JSONDecodeError as e:
            raise ModelError(f"--default-chat-template-kwargs: not JSON ({e})") from None
        if not isinstance(kwargs, dict):
            raise ModelError("--default-chat-template-kwargs must be a JSON object")
    return load(
        args.model,
        weights=args.weights,
        kv_dtype=args.kv_dtype,
        device=args.device,
        gguf=args.gguf,
        kv_memory=kv_memory or DEFAULT_KV_MEMORY,
        progress=progress,
        batch_invariant=batch_invariant,
        chat_template=template,
        chat_template_kwargs=kwargs,
        reasoning_format=reasoning_format,
    )


def check_forms(weights: str, kv_dtype: str | None, device: str) -> str:
    """The cache dtype for these weights (kv_dtype or the default); raises
    ModelError for a combination `load` cannot serve."""
    if weights not in WEIGHTS:
        raise ModelError(f"weights must be one of {', '.join(WEIGHTS)}, got {weights!r}")
    if weights == "gguf" and device != "cpu":
        raise ModelError("weights='gguf' runs on the CPU; use weights='f32' on a GPU")
    kv_dtype = kv_dtype or DEFAULT_KV_DTYPE[weights]
    if kv_dtype not in KV_DTYPES:
        raise ModelError(f"kv_dtype must be one of {', '.join(KV_DTYPES)}, got {kv_dtype!r}")
    float_dtype = {"f32": "float32", "bf16": "bfloat16"}.get(weights)
    if float_dtype is not None and kv_dtype != float_dtype:
        raise ModelError(
            f"weights={weights!r} keeps its cache in {float_dtype}; other cache dtypes "
            "need weights='gguf'"
        )
    return kv_dtype
