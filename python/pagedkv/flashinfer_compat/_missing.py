"""Stand-ins for FlashInfer names that pagedkv does not implement.

Code that imports them loads; calling one raises NotImplementedError with
the reason, so a missing capability is never mistaken for a wrong result.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn


def missing_function(name: str, why: str) -> Callable[..., NoReturn]:
    """A function named `name` that raises NotImplementedError(why)."""

    def stand_in(*args: Any, **kwargs: Any) -> NoReturn:
        raise NotImplementedError(f"flashinfer.{name} is not implemented by pagedkv: {why}")

    stand_in.__name__ = stand_in.__qualname__ = name.rsplit(".", 1)[-1]
    return stand_in


def missing_class(name: str, why: str) -> type:
    """A class named `name` whose construction raises NotImplementedError(why)."""

    def __init__(self: object, *args: Any, **kwargs: Any) -> NoReturn:
        raise NotImplementedError(f"flashinfer.{name} is not implemented by pagedkv: {why}")

    return type(name.rsplit(".", 1)[-1], (), {"__init__": __init__})


def no_op(*args: Any, **kwargs: Any) -> None:
    """FlashInfer's JIT drivers: pagedkv compiles its MAX ops on first use."""
