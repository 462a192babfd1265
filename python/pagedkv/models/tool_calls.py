"""Tool calls in a chat (OpenAI's `tools` and `tool_choice`): the tools in
the prompt, the grammar a call follows, and the calls read back out of the
answer's text.

Three formats, chosen by the model's chat template:

- **hermes**, where the template writes `<tool_call>` itself (Qwen 2.5 and
  3, Hermes, and the many fine-tunes that copy them): the template gets the
  tools, and a call is `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`
  anywhere in the answer. Under tool_choice "auto" the text before a call
  is free and the grammar binds from the tag on (a lazy trigger); under
  "required" or a named tool the answer is calls only.
- **llama3**, where the template is Llama 3.1, 3.2 or 3.3's (it writes
  "Environment: ipython" where tools are given): the template gets the
  tools, and a call is the whole answer, {"name": ..., "parameters":
  {...}}, one a turn. Under "auto" an answer that does not open with `{`
  is free text.
- **generic**, for every other template (SmolLM2's, Gemma's): llama.cpp's
  generic format. A system message describes the tools and asks for JSON,
  and the whole answer is one JSON object: {"tool_calls": [{"name": ...,
  "arguments": {...}}]} ({"tool_call": {...}} where parallel calls are off)
  or, under "auto", {"response": "..."}.

In every format a call's arguments follow the tool's `parameters` schema,
so a call read back always parses; a sample cut by max_tokens mid-call
keeps its text as content. A `response_format` beside the tools binds the
content of an answer that calls none (under "auto"): in the hermes and
Llama 3 formats the answer is then either calls alone or the content in
its format; in the generic one the reply's "response" holds the content,
a JSON value of the format's schema (llama.cpp's way), and the content
read back is that value's text. The two JSON call formats (generic,
Llama 3) take JSON content formats only (json_object, json_schema). A
required or named call's answer is calls only, whatever the format. Under
tool_choice "none" the prompt leaves the tools out and the answer is free
text. A streamed answer is read by
`tool_call_stream.ToolCallStream`.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pagedkv.graphs.structured import (
    JSON_LAYOUT,
    grammar_given,
    one_of,
    response_format_grammar,
)

from .errors import ChatRequestError

TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
"""OpenAI's rule for a function's name."""
EMPTY_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}
"""A tool that declares no `parameters` takes none (an object schema
allows any property it does not name)."""
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
LLAMA3_MARKER = "Environment: ipython"
"""What Llama 3.1, 3.2 and 3.3's templates write where tools are given."""
LLAMA3_PYTHON_TAG = "<|python_tag|>"
"""What Llama 3.1 may write before a call."""
HERMES_CALL = re.compile(rf"{HERMES_OPEN}\s*(\{{.*?\}})\s*{HERMES_CLOSE}", re.S)
"""One call in the hermes format (the tags hold no regular-expression
characters)."""
GENERIC_INSTRUCTION = (
    "Respond in JSON format, either with `tool_call` (a request to call tools) or with "
    "`response` reply to the user's request"
)
"""llama.cpp's words for the generic format, so that a model sees the same
prompt from either engine."""


@dataclass(frozen=True)
class Tool:
    """One function the model may call: its name, description and the JSON
    schema of its arguments (an object)."""

    name: str
    description: str
    parameters: dict

    def as_openai(self) -> dict:
        """The tool as OpenAI's request lists it (what chat templates take)."""
        function = {"name": self.name}
        if self.description:
            function["description"] = self.description
        function["parameters"] = self.parameters
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolCall:
    """One call in an answer: OpenAI's id, the function's name, and its
    arguments as a JSON string."""

    id: str
    name: str
    arguments: str

    def as_openai(self, index: int | None = None) -> dict:
        """The call as a response's `tool_calls` entry (a streamed delta's
        when `index` is given)."""
        call = {"id": self.id, "type": "function"}
        call["function"] = {"name": self.name, "arguments": self.arguments}
        return call if index is None else {"index": index, **call}


def read_tools(tools: object) -> tuple[Tool, ...]:
    """OpenAI's `tools` ([{"type": "function", "function": {"name", ...}}])
    as `Tool`s. Raises ValueError for anything else (a name outside
    [A-Za-z0-9_-]{1,64}, one named twice, parameters that are not an
    object schema).

    Examples
    --------
    >>> read_tools([{"type": "function", "function": {"name": "now"}}])[0].parameters
    {'type': 'object', 'properties': {}, 'additionalProperties': False}
    """
    if not isinstance(tools, Sequence) or isinstance(tools, str) or not tools:
        raise ValueError("tools must be a non-empty list of functions")
    out: dict[str, Tool] = {}
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(function, Mapping) or tool.get("type", "function") != "function":
            raise ValueError(f'tools[{i}] must be {{"type": "function", "function": {{...}}}}')
        name = function.get("name")
        if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
            raise ValueError(f"tools[{i}]'s name must match [A-Za-z0-9_-]{{1,64}}, got {name!r}")
        if name in out:
            raise ValueError(f"tools name {name!r} twice")
        parameters = function.get("parameters") or EMPTY_PARAMETERS
        if not isinstance(parameters, Mapping) or parameters.get("type", "object") != "object":
            raise ValueError(f"tools[{i}]'s parameters must be a JSON schema of an object")
        description = function.get("description") or ""
        if not isinstance(description, str):
            raise ValueError(f"tools[{i}]'s description must be a string")
        out[name] = Tool(name, description, dict(parameters))
    return tuple(out.values())


def read_tool_choice(choice: object, tools: Sequence[Tool]) -> str | Tool:
    """OpenAI's `tool_choice`: "none", "auto" (default), "required", or
    {"type": "function", "function": {"name": ...}} naming one of `tools`
    (returned as that `Tool`). Raises ValueError for anything else."""
    if choice is None:
        return "auto"
    if choice in ("none", "auto", "required"):
        return choice
    function = choice.get("function") if isinstance(choice, Mapping) else None
    name = function.get("name") if isinstance(function, Mapping) else None
    for tool in tools:
        if tool.name == name:
            return tool
    raise ValueError(
        'tool_choice must be "none", "auto", "required" or {"type": "function", '
        '"function": {"name": ...}} naming one of the tools'
    )


def tool_use(
    tools: object,
    tool_choice: object = None,
    parallel_tool_calls: bool = True,
    chat_template: str | None = None,
) -> ToolUse:
    """What a chat request asks of tools, from OpenAI's fields (`tools`
    None: no tools; tool_choice None: "auto" where tools are given) and the
    model's chat template (which picks the format). Raises ChatRequestError
    naming the field that is malformed, or `tool_choice` given without tools.

    Examples
    --------
    >>> use = tool_use([{"type": "function", "function": {"name": "now"}}], "required")
    >>> use.choice, use.format
    ('required', 'generic')
    """
    try:
        offered = read_tools(tools) if tools is not None else ()
    except ValueError as e:
        raise ChatRequestError("tools", str(e)) from None
    if tool_choice not in (None, "none") and not offered:
        raise ChatRequestError("tool_choice", "tool_choice needs tools")
    try:
        choice = read_tool_choice(tool_choice, offered) if offered else "none"
    except ValueError as e:
        raise ChatRequestError("tool_choice", str(e)) from None
    fmt = template_format(chat_template)
    # Llama 3.x's templates render one call a turn.
    parallel = bool(parallel_tool_calls) and fmt != "llama3"
    return ToolUse(offered, choice, parallel, fmt)


def template_format(chat_template: str | None) -> str:
    """ "hermes" where the chat template writes `<tool_call>` tags itself,
    "llama3" where it is Llama 3.x's (its tools' JSON calls), else
    "generic"."""
    if chat_template and HERMES_OPEN in chat_template:
        return "hermes"
    if chat_template and LLAMA3_MARKER in chat_template:
        return "llama3"
    return "generic"


@dataclass(frozen=True)
class ToolUse:
    """What one chat request asks of tools: the prompt's messages, the
    grammar of the answer and how to read calls back.

    Args:
        tools: the functions offered.
        choice: "none", "auto", "required" or the one `Tool` to call.
        parallel: whether an answer may hold more than one call.
        format: "hermes", "llama3" or "generic" (`template_format`).
    """

    tools: tuple[Tool, ...]
    choice: str | Tool = "auto"
    parallel: bool = True
    format: str = "generic"

    @property
    def active(self) -> bool:
        """Whether the answer may call a tool (tool_choice is not "none")."""
        return self.choice != "none"

    @property
    def offered(self) -> tuple[Tool, ...]:
        """The tools a call may name."""
        return (self.choice,) if isinstance(self.choice, Tool) else self.tools

    def template_tools(self) -> list[dict] | None:
        """The `tools` the chat template renders (where it renders them)."""
        if not self.active or self.format == "generic":
            return None
        return [tool.as_openai() for tool in self.tools]

    def prompt_messages(self, messages: Sequence[Mapping]) -> list[dict]:
        """OpenAI's messages (roles system, user, assistant, tool; an
        assistant's `tool_calls`, a tool's `tool_call_id`) as the chat
        template takes them. Hermes and Llama 3 templates render calls and
        results themselves (arguments as objects); for the generic format an
        earlier call is the JSON the model writes and a result a user turn
        {"tool_response": ...}, after a system message describing the
        tools. Raises ValueError for a malformed call or result."""
        generic = self.format == "generic"
        names = {}
        out = []
        for m in messages:
            message = {**m, "content": m.get("content") or ""}
            calls = m.get("tool_calls")
            if calls and m["role"] == "assistant":
                calls = [_earlier_call(c) for c in calls]
                names.update((c["id"], c["function"]["name"]) for c in calls)
                if generic:
                    del message["tool_calls"]
                    message["content"] = json.dumps(self._generic_answer(calls))
                else:
                    message["tool_calls"] = calls
            elif m["role"] == "tool":
                call_id = m.get("tool_call_id")
                if generic:
                    name = names.get(call_id, call_id)
                    response = {"tool": name, "content": message["content"]}
                    message = {"role": "user", "content": json.dumps({"tool_response": response})}
                else:
                    message["tool_call_id"] = call_id
            out.append(message)
        if generic and self.active:
            out = _with_system(out, self._generic_instructions())
        return out

    def _generic_answer(self, calls: list[dict]) -> dict:
        plain = [
            {"name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in calls
        ]
        if self.parallel or len(plain) > 1:
            return {"tool_calls": plain}
        return {"tool_call": plain[0]}

    def _generic_instructions(self) -> str:
        tools = json.dumps([tool.as_openai() for tool in self.offered], indent=2)
        example = self._generic_answer(
            [{"function": {"name": "tool_name", "arguments": {"arg1": "some_value"}}}]
        )
        return (
            f"{GENERIC_INSTRUCTION}\n\nYou can call any of the following tools to satisfy the "
            f"user's requests: {tools}\n\nExample tool call syntax:\n\n"
            f"{json.dumps(example, indent=2)}"
        )

    def grammar(self, content_format: Mapping | None = None) -> str | None:
        """The llguidance grammar of the answer (None under "none"):
        content_format, a `response_format`, binds the content of an answer
        that calls no tool (see the module's docstring). Raises
        ChatRequestError (param "response_format") where a JSON call format
        (generic, Llama 3) is given a format that is not JSON, and
        ValueError for a format `response_format_grammar` does not take."""
        from llguidance import LLMatcher

        if not self.active:
            return None
        bound = self.choice == "auto" and grammar_given(content_format)
        if self.format == "generic":
            reply = _reply_schema(content_format if bound else None)
            return LLMatcher.grammar_from_json_schema(
                self._generic_schema(reply), defaults=JSON_LAYOUT
            )
        if self.format == "llama3" and bound:
            # A call and JSON content both open with `{`: one schema of
            # either, which the grammar engine keeps apart as it goes.
            either = [*self._call_schemas("parameters"), _reply_schema(content_format)]
            return LLMatcher.grammar_from_json_schema({"anyOf": either}, defaults=JSON_LAYOUT)
        free = self.choice == "auto" and not bound
        lark = self._llama3_lark(free) if self.format == "llama3" else self._hermes_lark(free)
        calls = LLMatcher.grammar_from_lark(lark)
        if not bound:
            return calls
        return one_of(calls, response_format_grammar(content_format))

    def _call_schemas(self, arguments_key: str) -> list[dict]:
        """JSON schemas of one call {"name": ..., KEY: {...}}, a tool each."""
        return [
            {
                "type": "object",
                "properties": {"name": {"const": tool.name}, arguments_key: tool.parameters},
                "required": ["name", arguments_key],
                "additionalProperties": False,
            }
            for tool in self.offered
        ]

    def _generic_schema(self, reply: dict) -> dict:
        calls = self._call_schemas("arguments")
        call = calls[0] if len(calls) == 1 else {"anyOf": calls}
        key, value = (
            ("tool_calls", {"type": "array", "items": call, "minItems": 1})
            if self.parallel
            else ("tool_call", call)
        )
        answer = _object({key: value})
        if self.choice == "auto":
            return {"anyOf": [answer, _object({"response": reply})]}
        return answer

    def _call_bodies(self, arguments_key: str) -> str:
        """Lark: one call's JSON {"name": ..., KEY: {...}} for any offered
        tool, laid out as the templates write it."""
        return " | ".join(
            f'"{{\\"name\\": {json.dumps(json.dumps(tool.name))[1:-1]}, '
            f'\\"{arguments_key}\\": " %json {json.dumps(_laid_out(tool.parameters))} "}}"'
            for tool in self.offered
        )

    def _llama3_lark(self, free: bool) -> str:
        """One call as the whole answer: {"name": ..., "parameters": {...}}
        (Llama 3.x's templates render one call a turn); where `free`, an
        answer that does not open with `{` is free text."""
        lines = ["%llguidance {}", "call: " + self._call_bodies("parameters")]
        if free:
            lines += ["start: call | TEXT", r"TEXT: /([^{](.|\n)*)?/"]
        else:
            lines.append("start: call")
        return "\n".join(lines)

    def _hermes_lark(self, free: bool) -> str:
        """Calls in <tool_call> tags: where `free`, after free text (the
        grammar binds from the tag on), else the whole answer."""
        lines = [
            "%llguidance {}",
            "body: " + self._call_bodies("arguments"),
            f'call_end: "\\n" body "\\n{HERMES_CLOSE}"',
        ]
        repeat = "*" if self.parallel else "?"
        if free:
            # Free text, where the tag (matched lazily: at its first
            # appearance) starts a call the grammar binds.
            lines += [
                f'call_start[lazy]: TEXT "{HERMES_OPEN}"',
                "call: call_start call_end",
                f"start: call{repeat} TEXT",
                r"TEXT: /(.|\n)*/",
            ]
        else:
            more = f'("\\n" "{HERMES_OPEN}" call_end)*' if self.parallel else ""
            lines.append(f'start: "{HERMES_OPEN}" call_end {more}')
        return "\n".join(lines)

    def read(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a whole answer: the calls it makes (the
        first only where parallel calls are off) and the text around them
        (None when there is none and there are calls); text that holds no
        whole call is all content."""
        if not self.active:
            return text, []
        if self.format == "generic":
            return _read_generic(text)
        if self.format == "llama3":
            call = _call_of(text.strip().removeprefix(LLAMA3_PYTHON_TAG), "parameters")
            return (text, []) if call is None else (None, [call])
        calls, kept, at = [], [], 0
        for match in HERMES_CALL.finditer(text):
            call = _call_of(match.group(1))
            if call is not None and (self.parallel or not calls):
                kept.append(text[at : match.start()])
                at = match.end()
                calls.append(call)
        if not calls:
            return text, []
        return ("".join(kept) + text[at:]).strip() or None, calls


GENERIC_REPLY = '{"response": "'
"""How a generic reply starts (the grammar lays JSON out as `json.dumps`)."""


def partial_response(text: str) -> str | None:
    """The reply string of a generic answer so far, whole or cut (an escape
    cut in its middle left out), or None where text is not a reply."""
    if not text.startswith(GENERIC_REPLY):
        return None
    body = text[len(GENERIC_REPLY) :]
    # The string ends at its closing quote (then `"}`), or is cut within
    # an escape of at most 6 characters: one of the last 7 cuts decodes.
    for end in range(len(body), max(len(body) - 7, -1), -1):
        try:
            return json.loads(f'"{body[:end]}"')
        except json.JSONDecodeError:
            continue
    return None


def _read_generic(text: str) -> tuple[str | None, list[ToolCall]]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = None
    if not isinstance(value, dict):
        partial = partial_response(text)
        return (text if partial is None else partial), []
    given = value.get("tool_calls") or ([value["tool_call"]] if "tool_call" in value else [])
    given = [c for c in given if isinstance(c, dict)]
    written = raw_arguments(text, "arguments")
    if len(written) != len(given):  # not the grammars' layout: arguments re-serialized
        written = [None] * len(given)
    calls = [_call(c, "arguments", w) for c, w in zip(given, written, strict=True)]
    if calls and all(c is not None for c in calls):
        return None, calls
    if "response" not in value:
        return text, []
    response = value["response"]
    if isinstance(response, str):
        return response, []
    # A content format's JSON value: its text as the grammar laid it out.
    written = text.strip()
    inner = written[len('{"response": ') : -1] if written.startswith('{"response": ') else ""
    return (inner if _parses_to(inner, response) else json.dumps(response)), []


def _parses_to(text: str, value: object) -> bool:
    try:
        return json.loads(text) == value
    except json.JSONDecodeError:
        return False


def _reply_schema(content_format: Mapping | None) -> dict:
    """The schema of a generic answer's "response": a string, or the JSON
    value a content format asks for. Raises ChatRequestError for a format
    that is not JSON."""
    if content_format is None:
        return {"type": "string"}
    kind = content_format.get("type")
    if kind == "json_object":
        return {"type": "object"}
    spec = content_format.get("json_schema") if kind == "json_schema" else None
    schema = spec.get("schema") if isinstance(spec, Mapping) else None
    if not isinstance(schema, Mapping):
        raise ChatRequestError(
            "response_format",
            "beside tools, this model's tool format (its calls are JSON) takes a json_object "
            "or json_schema response_format (with its schema) only",
        )
    return dict(schema)


def _call_of(text: str, key: str = "arguments") -> ToolCall | None:
    """A call from its JSON text {"name": ..., KEY: {...}}, or None."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    written = raw_arguments(text, key)
    return _call(value, key, written[0] if len(written) == 1 else None)


def _call(value: object, key: str, written: tuple[str, str] | None) -> ToolCall | None:
    """A call from its parsed JSON {"name": ..., KEY: {...}}, or None; its
    arguments as `written` (name, the arguments' text) gives them where it
    names the same function, else re-serialized."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get(key, {})
    if not isinstance(arguments, dict):
        return None
    as_written = written is not None and written[0] == value["name"]
    text = written[1] if as_written else json.dumps(arguments)
    return ToolCall(f"call_{uuid.uuid4().hex[:24]}", value["name"], text)


def arguments_key(fmt: str) -> str:
    """The key a format's calls hold their arguments under."""
    return "parameters" if fmt == "llama3" else "arguments"


def call_head(key: str) -> re.Pattern:
    """How a call opens as the grammars lay it out, {"name": NAME, KEY: ,
    NAME (a JSON string) its group 1."""
    return re.compile(r'\{"name": ("(?:[^"\\]|\\.)*"), "' + re.escape(key) + '": ')


def raw_arguments(text: str, key: str) -> list[tuple[str, str]]:
    """(name, the arguments' object as written) of each call in text laid
    out as the grammars lay calls out, in order.

    >>> raw_arguments('{"name": "f", "arguments": {"city": "Paris"}}', "arguments")
    [('f', '{"city": "Paris"}')]
    """
    decoder, head, found, at = json.JSONDecoder(), call_head(key), [], 0
    while (match := head.search(text, at)) is not None:
        at = match.end()
        if text[at : at + 1] != "{":
            continue
        try:
            _, end = decoder.raw_decode(text, at)
        except json.JSONDecodeError:
            continue
        found.append((json.loads(match.group(1)), text[at:end]))
        at = end
    return found


def _earlier_call(call: object) -> dict:
    """An assistant's earlier call as templates take it: arguments parsed
    from OpenAI's JSON string into an object."""
    function = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
        raise ValueError('an assistant\'s tool_calls entries need {"function": {"name": ...}}')
    arguments = function.get("arguments") or "{}"
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            raise ValueError(f"tool call arguments are not JSON: {arguments[:80]!r}") from None
    return {
        "id": call.get("id") or "",
        "type": "function",
        "function": {"name": function["name"], "arguments": arguments},
    }


def _with_system(messages: list[dict], text: str) -> list[dict]:
    """`text` at the end of the first system message, or as one before the rest."""
    if messages and messages[0]["role"] == "system":
        first = {**messages[0], "content": f"{messages[0]['content']}\n\n{text}"}
        return [first, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def _object(properties: dict) -> dict:
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties),
        "additionalProperties": False,
    }


def _laid_out(schema: dict) -> dict:
    """A schema with pagedkv's JSON layout unless it names its own."""
    return schema if "x-guidance" in schema else {**schema, "x-guidance": JSON_LAYOUT}
