"""FlashInfer's ``flashinfer.rope``, served by `pagedkv.rope`: every name of its `__all__`."""

from pagedkv import rope as _rope
from pagedkv.rope import *  # noqa: F403

__all__ = list(_rope.__all__)
