"""Stop strings over streamed text: text is released as it arrives, except a
trailing piece that could still grow into a stop string.

Invariant: the text released so far never contains a stop string and never
ends inside one; when a stop string appears, the text before it is released
and nothing after it ever is (OpenAI's `stop`: the stop string itself is left
out of the answer).
"""

from __future__ import annotations

from collections.abc import Sequence


class StopMatcher:
    """Holds back streamed text that may be the start of a stop string.

    Parameters
    ----------
    stops : sequence of str
        Non-empty stop strings (none: every push releases its text at once).

    Examples
    --------
    >>> m = StopMatcher(["\\n\\n"])
    >>> m.push("Hello\\n"), m.stopped
    ('Hello', False)
    >>> m.push("\\nWorld"), m.stopped
    ('', True)
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(s for s in stops if s)
        self.stopped = False
        self._held = ""

    def push(self, text: str) -> str:
        """Appends `text`; returns what can be released now ("" after a stop)."""
        if self.stopped:
            return ""
        pending = self._held + text
        hits = [i for i in (pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped = True
            self._held = ""
            return pending[: min(hits)]
        keep = partial_suffix(pending, self.stops)
        self._held = pending[len(pending) - keep :] if keep else ""
        return pending[: len(pending) - keep]

    def flush(self) -> str:
        """Releases the held-back text (the stream ended without a stop)."""
        held, self._held = self._held, ""
        return held


def partial_suffix(text: str, strings: Sequence[str]) -> int:
    """Length of the longest suffix of `text` that one of `strings` starts
    with (shorter than that string): what a stream holds back.

    >>> partial_suffix("a <too", ["<tool_call>"])
    4
    """
    longest = 0
    for s in strings:
        for n in range(min(len(s) - 1, len(text)), longest, -1):
            if s.startswith(text[len(text) - n :]):
                longest = n
                break
    return longest
