"""The command line shared by the CPU benchmark scripts that take dtypes:
pin MAX's workers, parse --dtypes and --reps (and --shapes where the script
picks from a table of shapes), run, print the table."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from typing import Any

from .threads import pin_max_workers


def bench_arguments(
    description: str, reps: int, default_dtypes: str, shapes: Sequence[Any] | None = None
) -> argparse.Namespace:
    """Pins MAX's CPU workers (threads.py), then parses the command line:
    --dtypes (comma-separated) and --reps, and with `shapes` --shapes
    (comma-separated indices into it, default all). Returns the arguments
    with `dtypes` a list of names and, with `shapes`, `shapes` the chosen
    shapes."""
    pin_max_workers()
    parser = argparse.ArgumentParser(description=description)
    if shapes is not None:
        parser.add_argument("--shapes", default=",".join(str(i) for i in range(len(shapes))))
    parser.add_argument("--dtypes", default=default_dtypes)
    parser.add_argument("--reps", type=int, default=reps)
    args = parser.parse_args()
    args.dtypes = args.dtypes.split(",")
    if shapes is not None:
        args.shapes = [shapes[int(i)] for i in args.shapes.split(",")]
    return args


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
    args = bench_arguments(description, reps, default_dtypes)
    rows = run(dtypes=args.dtypes, reps=args.reps)
    print()
    print(table(rows))
