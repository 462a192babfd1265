"""The compiled prefill and decode step graphs of a model.

Both graphs, and the page manager's page-copy op (copy-on-write of forked
requests), are compiled as one MAX module: a module pays MAX's fixed compile
cost and the code generation of the kernels it shares once, where two modules
would pay them twice (docs/performance.md, "Cold
start"). The module is kept in pagedkv's compile cache, so a later process
loads it in milliseconds.
"""

from __future__ import annotations

import time
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field

import numpy as np
from max.dtype import DType
from max.graph import Module

from pagedkv._ops.kernels import prepare
from pagedkv._ops.tensors import Device
from pagedkv.page import COPY_PAGES

from .decoder import (
    DECODE,
    PREFILL,
    build_step_graph,
    quantized_formats,
    step_graph_name,
    weights_registry,
)
from .model import DecoderConfig


@dataclass(frozen=True)
class StepModels:
    """The loaded step graphs of one model on one device.

    Attributes:
        prefill: runs a prefill step (any number of new tokens per request).
        decode: runs a decode step (one new token per request).
        seconds: what compiling (cold) or loading (warm) them took.
        weights: the arrays the models were loaded with; MAX reads them in
            place without holding a reference, so they live as long as the
            models do.
    """

    prefill: object
    decode: object
    seconds: float
    weights: dict = field(repr=False)


_compiled: dict[Hashable, StepModels] = {}


def compile_step_graphs(
    config: DecoderConfig,
    weights: Mapping[str, np.ndarray],
    page_size: int,
    dtype: DType,
    device: Device,
    quantized: dict | None = None,
) -> StepModels:
    """The model's step graphs for `device`, compiled (or loaded from the
    compile cache) once per process and kept. With `quantized` (packed
    matrices by name) the graphs multiply them in their GGUF formats and
    dtype is the pools' alone (decoder.py)."""
    formats = quantized_formats(quantized, config.num_layers) if quantized is not None else None
    key = (config, page_size, dtype, device, id(weights), id(quantized))
    if key not in _compiled:
        t0 = time.perf_counter()

        def graphs(module: Module) -> None:
            for kind in (PREFILL, DECODE):
                build_step_graph(
                    kind, config, page_size, dtype, device.graph_ref(), module, formats
                )

        registry = weights_registry(config, weights, dtype, device.graph_ref(), quantized)
        models = prepare(
            [COPY_PAGES],
            device,
            graphs=graphs,
            key=("decoder step graphs", config, page_size, dtype, str(device), formats),
            weights_registry=registry,
        )
        _compiled[key] = StepModels(
            models[step_graph_name(PREFILL)],
            models[step_graph_name(DECODE)],
            time.perf_counter() - t0,
            registry,
        )
    return _compiled[key]
