"""A tool-using answer read as it streams: the content that can go out, and
each call as OpenAI streams one, its id and name once the call has begun,
then its arguments piece by piece as the model writes them.

The grammars lay a call out as {"name": NAME, KEY: ARGUMENTS} on one line
(KEY "arguments", or "parameters" in Llama 3's format), so a call begins
where that head stands complete with the `{` of its arguments after it,
and ends where the arguments' object closes. The arguments streamed are
the model's own text of that object, the same string `ToolUse.read` returns
for the whole answer.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, replace

from pagedkv.graphs.stop_strings import partial_suffix

from .tool_calls import (
    GENERIC_REPLY,
    HERMES_OPEN,
    ToolCall,
    ToolUse,
    arguments_key,
    call_head,
    partial_response,
)


class ToolCallStream:
    """A streamed answer's text, split as it grows into content and calls.

    `push` returns the content that can go out now and the calls' deltas
    (OpenAI's `delta.tool_calls` entries: index, id, type and name when a
    call begins, then `function.arguments` pieces); `finish` the rest once
    the answer is whole. The hermes format streams the text before its first
    call (text after the calls comes at the end), the generic one the reply
    string of {"response": "..."} as it grows, Llama 3's an answer that does
    not open with `{`. `calls` holds the answer's calls once it is whole.

    Examples
    --------
    >>> from pagedkv.models.tool_calls import ToolUse, read_tools
    >>> use = ToolUse(read_tools([{"type": "function", "function": {"name": "now"}}]),
    ...               "auto", True, "hermes")
    >>> stream = ToolCallStream(use)
    >>> stream.push('Sure.<tool_call>\\n{"name": "now", "arguments": {')[0]
    'Sure.'
    >>> stream.push('}}\\n</tool_call>')[1]
    [{'index': 0, 'function': {'arguments': '}'}}]
    >>> stream.finish()
    ('', [])
    >>> [(c.name, c.arguments) for c in stream.calls]
    [('now', '{}')]
    """

    def __init__(self, use: ToolUse) -> None:
        self.use = use
        self.text: list[str] = []
        self.sent = 0
        """Characters of the content already sent."""
        self.settled = False
        """Whether no more content can stream before the end (a call has
        begun, or the answer is not a reply)."""
        self.calls: list[ToolCall] = []
        self.scanner = _CallScanner(arguments_key(use.format), use.parallel)

    def push(self, piece: str) -> tuple[str, list[dict]]:
        """Takes the next text; returns (content to send now, call deltas)."""
        self.text.append(piece)
        if not self.use.active:
            self.sent += len(piece)
            return piece, []
        text = "".join(self.text)
        content = "" if self.settled else self._content(text)
        out = content[self.sent :]
        self.sent = max(self.sent, len(content))
        start = self._calls_start(text)
        deltas = [] if start is None else self.scanner.feed(text, start)
        return out, deltas

    def finish(self) -> tuple[str, list[dict]]:
        """(the content not yet sent, call deltas not yet sent) once the
        answer is whole, which is read as `ToolUse.read` reads it: `calls`
        become its calls (under the ids the stream gave them), the content
        is its content (none where a call began but the answer holds none:
        a call cut short), and a call the stream did not see begin comes in
        one delta."""
        if not self.use.active:
            return "", []
        content, calls = self.use.read("".join(self.text))
        began = self.scanner.calls + ([self.scanner.open] if self.scanner.open else [])
        ids = [call.call_id if isinstance(call, _OpenCall) else call.id for call in began]
        self.calls = [replace(c, id=i) for c, i in zip(calls, ids, strict=False)]
        self.calls += calls[len(ids) :]
        deltas = [call.as_openai(i) for i, call in enumerate(self.calls) if i >= len(ids)]
        if self.scanner.began and not calls:
            content = None
        return (content or "")[self.sent :], deltas

    def _content(self, text: str) -> str:
        """The content so far that can be sent; sets `settled` where no more
        can come before the end."""
        if self.use.format == "generic":
            # Text that cannot open a reply is a call: nothing streams.
            self.settled = not GENERIC_REPLY.startswith(text[: len(GENERIC_REPLY)])
            return partial_response(text) or ""
        if self.use.format == "llama3":
            # A call is the whole answer: it opens with `{`.
            opening = text.lstrip()[:1]
            self.settled = opening == "{"
            return text if opening and not self.settled else ""
        start = text.find(HERMES_OPEN)
        self.settled = start >= 0
        if self.settled:
            return text[:start]
        return text[: len(text) - partial_suffix(text, [HERMES_OPEN])]

    def _calls_start(self, text: str) -> int | None:
        """Where calls may begin in text, or None while none can: after the
        first tag (hermes), at an answer that opens with `{` (Llama 3),
        anywhere (generic: a reply's string escapes its quotes, so no call's
        head can stand in it)."""
        if self.use.format == "hermes":
            start = text.find(HERMES_OPEN)
            return None if start < 0 else start
        if self.use.format == "llama3":
            stripped = text.lstrip()
            return len(text) - len(stripped) if stripped.startswith("{") else None
        return 0


@dataclass
class _OpenCall:
    """A call whose head has been read: where its arguments start, how far
    they have been scanned and sent, and the scan's state."""

    index: int
    call_id: str
    name: str
    start: int
    scanned: int
    sent: int
    depth: int = 0
    in_string: bool = False
    escaped: bool = False


class _CallScanner:
    """Finds the calls in a growing answer's text, one after another, and
    returns their deltas: a call's head when its arguments' `{` has come,
    then the arguments' text as it grows, to the `}` that closes them."""

    def __init__(self, key: str, parallel: bool) -> None:
        self.head = call_head(key)
        self.parallel = parallel
        self.at: int | None = None
        """Where the next call's head is looked for (None: not yet known)."""
        self.open: _OpenCall | None = None
        self.calls: list[ToolCall] = []
        self.began = False

    def feed(self, text: str, start: int) -> list[dict]:
        """The deltas of what text (grown since the last feed) adds, calls
        being looked for from `start` on."""
        if self.at is None:
            self.at = start
        deltas: list[dict] = []
        while True:
            if self.open is None and not self._begin(text, deltas):
                return deltas
            call = self.open
            end = self._scan(text, call)
            upto = len(text) if end is None else end
            if upto > call.sent:
                deltas.append({"index": call.index,
                               "function": {"arguments": text[call.sent : upto]}})  # fmt: skip
                call.sent = upto
            if end is None:
                return deltas
            self.calls.append(ToolCall(call.call_id, call.name, text[call.start : end]))
            self.open, self.at = None, end

    def _begin(self, text: str, deltas: list[dict]) -> bool:
        """Opens the next call where its head and `{` have come."""
        if self.calls and not self.parallel:
            return False
        match = self.head.search(text, self.at)
        if match is None:
            # A head still being written starts at the last `{` (a head
            # holds no other): look again from there, not from the start.
            last = text.rfind("{", self.at)
            self.at = len(text) if last < 0 else last
            return False
        if match.end() >= len(text):
            self.at = match.start()
            return False
        if text[match.end()] != "{":  # not a call's layout: look past it
            self.at = match.end()
            return self._begin(text, deltas)
        index = len(self.calls)
        call_id, name = f"call_{uuid.uuid4().hex[:24]}", json.loads(match.group(1))
        self.open = _OpenCall(index, call_id, name, match.end(), match.end(), match.end())
        self.began = True
        deltas.append({"index": index, "id": call_id, "type": "function",
                       "function": {"name": name, "arguments": ""}})  # fmt: skip
        return True

    @staticmethod
    def _scan(text: str, call: _OpenCall) -> int | None:
        """Scans call's arguments on through text; returns the end of their
        object, or None while it is open."""
        for i in range(call.scanned, len(text)):
            ch = text[i]
            if call.in_string:
                if call.escaped:
                    call.escaped = False
                elif ch == "\\":
                    call.escaped = True
                elif ch == '"':
                    call.in_string = False
            elif ch == '"':
                call.in_string = True
            elif ch in "{[":
                call.depth += 1
            elif ch in "}]":
                call.depth -= 1
                if call.depth == 0:
                    call.scanned = i + 1
                    return i + 1
        call.scanned = len(text)
        return None
