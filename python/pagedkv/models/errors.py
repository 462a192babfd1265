"""The one exception a user sees when a model cannot be fetched, read or served."""

from __future__ import annotations


class ModelError(RuntimeError):
    """A model that cannot be loaded: unknown name, failed fetch, unreadable
    GGUF. The message is one line and says what to do; the CLI prints it
    and exits with status 2."""
