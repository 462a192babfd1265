"""KV bytes one sequence holds in Gemma 3 270M's paged cache: the page
manager's own layer groups (15 sliding-window layers that give back the
pages their 512-token window has passed, 3 global layers) beside a cache
that keeps every layer whole.

    python benchmarks/window_kv_bytes.py [--page-size 16] [--dtype float16]

No model runs: the manager's page tables after a prefill of each length and
one decode step (when the window group gives pages back) are counted.
"""

from __future__ import annotations

import argparse

import numpy as np

from pagedkv.cache.manager import PagedKVCacheManager
from pagedkv.graphs.engine import page_manager_for
from pagedkv.models import fetch_gguf
from pagedkv.models.unpacked import read_unpacked

LENGTHS = (4096, 32768)


def held_pages(manager: PagedKVCacheManager, tokens: int) -> list[int]:
    """Pages the sequence holds in each layer group after prefilling
    `tokens` - 1 tokens and decoding one."""
    manager.add("s")
    manager.reserve(["s"], tokens - 1)
    manager.reserve(["s"], 1)
    held = [
        int((manager.pages("s", g) != manager.null_pages[g]).sum())
        for g in range(len(manager.layer_groups))
    ]
    manager.release("s")
    return held


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--dtype", default="float16", choices=["float16", "float32"])
    args = parser.parse_args()
    c = read_unpacked(fetch_gguf("gemma3-270m")).config
    itemsize = np.dtype(args.dtype).itemsize
    page_bytes = 2 * args.page_size * c.num_kv_heads * c.head_dim * itemsize  # one layer
    pages = max(LENGTHS) // args.page_size + 1
    manager = page_manager_for(c, pages, args.page_size, args.dtype)
    print(
        f"Gemma 3 270M: {c.num_layers} layers, {c.num_kv_heads} KV head of {c.head_dim}, "
        f"{args.dtype} cache, pages of {args.page_size} tokens; groups "
        + ", ".join(f"{len(layers)} layers window {w}" for layers, w in c.layer_groups)
    )
    print("| tokens | layer groups (pages held per layer) | KV bytes | every layer whole | ratio |")
    print("| --- | --- | --- | --- | --- |")
    for tokens in LENGTHS:
        held = held_pages(manager, tokens)
        grouped = sum(
            n * len(layers) * page_bytes
            for n, (layers, _) in zip(held, c.layer_groups, strict=True)
        )
        whole = -(-tokens // args.page_size) * c.num_layers * page_bytes
        print(
            f"| {tokens} | {' / '.join(map(str, held))} | {grouped / 2**20:.1f} MiB | "
            f"{whole / 2**20:.1f} MiB | {whole / grouped:.1f}x |"
        )
    manager.validate()


if __name__ == "__main__":
    main()
