"""The `pagedkv` command: main.py parses and dispatches (demo, generate,
serve, bench, check-gpu), generate.py answers prompts with a real model;
`pagedkv serve`'s flags live beside the server (serve/cli.py)."""

from .main import main

__all__ = ["main"]
