"""The command line shared by the CPU benchmark scripts that take dtypes:
pin MAX's workers, parse --dtypes and --reps, run, print the table."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from .threads import pin_max_workers


def dtype_table_main(
    description: str,
    run: Callable[..., list[Any]],
    table: Callable[[list[Any]], str],
    reps: int = 20,
    default_dtypes: str = "float32,bfloat16",
) -> None:
    """Runs `run(dtypes=[...], reps=N)` from the command line's --dtypes and
    --reps and prints `table` of its rows; MAX's CPU workers are pinned
    first (threads.py)."""
    pin_max_workers()
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--dtypes", default=default_dtypes)
    parser.add_argument("--reps", type=int, default=reps)
    args = parser.parse_args()
    rows = run(dtypes=args.dtypes.split(","), reps=args.reps)
    print()
    print(table(rows))
