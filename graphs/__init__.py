"""Decode-step graphs that serve a Llama-style model from pagedkv's cache.

Shipped inside the package as ``pagedkv.graphs``: the model and its NumPy
reference (model.py, numpy_reference.py), the max.graph step graphs
(decoder.py), the engine that runs them on a paged cache (engine.py) and the
one continuous-batching scheduler (scheduler.py) behind ``LLM.generate``,
``pagedkv demo`` and ``pagedkv serve``.
"""
