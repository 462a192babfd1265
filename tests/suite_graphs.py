"""Graphs the suite's tests build themselves, compiled in the suite's one MAX
module (conftest's `compiled_ops`) rather than in a module each: every
module pays MAX's fixed compile cost again, and a graph loaded with
`InferenceSession.load` is compiled afresh in every run.

A test module registers a builder with `@suite_graph(name)` when it is
imported, which pytest's collection does before any fixture runs; its tests
take the loaded model from `suite_model(name)`. Only the graphs of collected
modules are compiled.
"""

from __future__ import annotations

import hashlib
import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any

from max.graph import Graph, Module

GraphBuilder = Callable[[Module], None]

_builders: dict[str, GraphBuilder] = {}
_models: dict[str, Any] = {}


def suite_graph(name: str) -> Callable[[GraphBuilder], GraphBuilder]:
    """Registers `builder(module)`, which must add one graph called `name`."""

    def register(builder: GraphBuilder) -> GraphBuilder:
        if name in _builders:
            raise ValueError(f"suite graph {name!r} registered twice")
        _builders[name] = builder
        return builder

    return register


def ops_graph(module: Module, name: str, input_types) -> Graph:
    """A graph called `name` in the suite's `module` that can call pagedkv's
    custom ops: a builder's `with ops_graph(module, name, types) as g:`."""
    from pagedkv import graph_ops

    return Graph(
        name,
        input_types=input_types,
        custom_extensions=graph_ops.custom_extensions(),
        module=module,
    )


def registered() -> bool:
    return bool(_builders)


def build_all(module: Module) -> None:
    """Adds every registered graph to `module`."""
    for builder in _builders.values():
        builder(module)


def compile_key() -> tuple:
    """What the registered graphs are, for the compile cache: each name with
    a digest of the file that builds it, and this file's, whose `ops_graph`
    every builder calls (an edited graph compiles afresh)."""
    return tuple(
        (name, _digest(inspect.getsourcefile(b))) for name, b in sorted(_builders.items())
    ) + (("suite_graphs", _digest(__file__)),)


def _digest(path: str) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def keep(models: dict[str, Any]) -> None:
    """Keeps the loaded models of the suite's module (by graph name)."""
    _models.update(models)


def suite_model(name: str) -> Any:
    """The loaded model of the registered graph `name`."""
    if name not in _models:
        raise LookupError(
            f"suite graph {name!r} was not compiled: is it registered with "
            "@suite_graph in a collected test module?"
        )
    return _models[name]
