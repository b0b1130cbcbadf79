"""MiniMax-M3 output parsing: the reasoning block and the native tool-call syntax, whole or
streamed (``../shared/spec/M3_CHAT_FORMAT.md``; behaviour follows vLLM's M3 parsers).

Reasoning is ``<mm:think>reasoning</mm:think>content``. With thinking mode on, the chat
template opens the block, so the output starts inside it. One block is recognised: once it
has closed, later markers are content text. A response that starts with a stray
``</mm:think>`` (not in thinking mode) drops it; a thinking-mode response that repeats the
opener drops that.

Tool calls are ``<tool_call>`` blocks of ``<invoke name="...">`` elements, every tag prefixed
with ``]<]minimax[>[``. One invoke is one call; its parameters are elements named after the
arguments, coerced to the function's JSON schema (``schema_types``, ``coerce_text``):
element text to the schema's scalar types, child elements to an object, or to an array where
the schema says so (items as ``<item>``), text mixed with children under ``$text``, repeated
names collected into a list. The first malformed or unterminated element ends an invoke's
parameters, keeping those before it; an output that ends inside an invoke still yields it.

Choices where vLLM gives no answer or where this module differs:
- An unknown function name still yields a call (vLLM's M3 parser does not validate names),
  its arguments unconverted: element text stays a string, child elements an object.
- The content is all text outside the ``<tool_call>`` blocks, the text after a block
  included (vLLM drops it); text inside a block but outside its invokes is dropped. The
  content is returned verbatim: whether whitespace-only content next to calls is null is
  the server's choice.
- Local ``$ref``s (``#/...``) in the schemas are followed (vLLM treats them as strings);
  integers, numbers and booleans are recognised in their JSON spellings only (plus ``1`` /
  ``0`` for booleans), surrounding spaces, tabs and newlines ignored.
"""
from __future__ import annotations

import dataclasses
import json
import math
import re
import secrets
from typing import Any, Iterable, Sequence

THINK_START = "<mm:think>"
THINK_END = "</mm:think>"
NS = "]<]minimax[>["
TOOL_START = NS + "<tool_call>"
TOOL_END = NS + "</tool_call>"
INVOKE_START = NS + "<invoke name="
INVOKE_END = NS + "</invoke>"
ELEMENT_OPEN = NS + "<"
ELEMENT_CLOSE = NS + "</"
ITEM = "item"
MIXED_TEXT_FIELD = "$text"
MAX_DEPTH = 128  # element nesting (vLLM's bound)
WHITESPACE = " \t\r\n"  # what coercion strips around a scalar

_TYPE_ALIASES = {"str": "string", "int": "integer", "float": "number", "bool": "boolean",
                 "dict": "object", "list": "array"}
_PRIORITY = ("null", "integer", "number", "boolean", "object", "array", "string")
_INT = re.compile(r"[+-]?[0-9]+")
_NUM = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?")


def _held_back(text: str, marker: str) -> int:
    """int: the length of the longest suffix of ``text`` that is a proper prefix of
    ``marker`` (what a stream must hold back until it knows whether the marker follows)."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


# ---- reasoning --------------------------------------------------------------------------------

class ReasoningStream:
    """Splits streamed output text into reasoning and content.

    ``feed(delta: str) -> (reasoning: str, content: str)``: the text of each kind that is
    certain so far ("" for none); a possible marker prefix at the end is held back.
    ``finish() -> (reasoning, content)``: what was held back. ``starts_in_reasoning``: the
    chat template opened the block (thinking mode).
    """

    def __init__(self, *, starts_in_reasoning: bool):
        self._starts_in_reasoning = starts_in_reasoning
        self._state = "lead"  # lead -> content | reasoning -> after
        self._buf = ""

    @property
    def reasoning_ended(self) -> bool:
        """bool: the reasoning block has closed (everything from here on is content)."""
        return self._state == "after"

    def feed(self, text: str) -> tuple[str, str]:
        self._buf += text
        return self._drain(final=False)

    def finish(self) -> tuple[str, str]:
        return self._drain(final=True)

    def _drain(self, final: bool) -> tuple[str, str]:
        reasoning: list[str] = []
        content: list[str] = []
        while True:
            buf = self._buf
            if self._state == "lead":  # a redundant opener / stray closer at the very start
                lead = THINK_START if self._starts_in_reasoning else THINK_END
                if not buf.startswith(lead) and lead.startswith(buf) and not final:
                    break
                if buf.startswith(lead):
                    self._buf = buf[len(lead):]
                self._state = "reasoning" if self._starts_in_reasoning else "content"
            elif self._state == "after":
                content.append(buf)
                self._buf = ""
                break
            else:
                marker, out, nxt = ((THINK_START, content, "reasoning") if self._state == "content"
                                    else (THINK_END, reasoning, "after"))
                at = buf.find(marker)
                if at >= 0:
                    out.append(buf[:at])
                    self._buf = buf[at + len(marker):]
                    self._state = nxt
                    continue
                keep = 0 if final else _held_back(buf, marker)
                out.append(buf[:len(buf) - keep])
                self._buf = buf[len(buf) - keep:]
                break
        return "".join(reasoning), "".join(content)


def split_reasoning(text: str, *, starts_in_reasoning: bool) -> tuple[str | None, str]:
    """A whole output as (reasoning: str, or None when empty or absent; content: str)."""
    stream = ReasoningStream(starts_in_reasoning=starts_in_reasoning)
    r1, c1 = stream.feed(text)
    r2, c2 = stream.finish()
    return (r1 + r2) or None, c1 + c2


# ---- schemas ----------------------------------------------------------------------------------

def _function_schemas(tools: Sequence[dict] | None) -> dict[str, dict]:
    """dict[str, dict]: function name -> parameters schema ({} when absent) of an OpenAI
    ``tools`` list; entries that are not function tools are skipped."""
    out: dict[str, dict] = {}
    for tool in tools or ():
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            continue
        fn = tool.get("function")
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            params = fn.get("parameters")
            out[fn["name"]] = params if isinstance(params, dict) else {}
    return out


def resolve_ref(schema: Any, root: Any) -> Any:
    """``schema`` with its local ``$ref`` (``#`` + a JSON pointer into ``root``) followed,
    repeatedly; None for a ref that does not resolve (or a chain of more than 64)."""
    for _ in range(64):
        if not (isinstance(schema, dict) and "$ref" in schema):
            return schema
        ref = schema["$ref"]
        if not isinstance(ref, str) or not ref.startswith("#"):
            return None
        node = root
        for part in ref[1:].split("/")[1:]:
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                return None
        schema = node
    return None


def _type_names(schema: dict) -> list[str]:
    t = schema.get("type")
    names = [t] if isinstance(t, str) else [x for x in t if isinstance(x, str)] \
        if isinstance(t, list) else []
    return [_TYPE_ALIASES.get(n.strip().lower(), n.strip().lower()) for n in names]


def json_type(value: Any) -> str:
    """str: the JSON-schema type name of a JSON value."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    return {int: "integer", float: "number", str: "string", list: "array",
            dict: "object"}.get(type(value), "string")


def _declared_types(schema: Any, root: Any, depth: int = 0) -> set[str]:
    schema = resolve_ref(schema, root)
    if not isinstance(schema, dict) or depth > MAX_DEPTH:
        return set()
    types = set(_type_names(schema))
    values = list(schema["enum"]) if isinstance(schema.get("enum"), list) else []
    if "const" in schema:
        values.append(schema["const"])
    types.update(json_type(v) for v in values)
    for key in ("anyOf", "oneOf", "allOf"):
        for sub in schema.get(key) or ():
            types |= _declared_types(sub, root, depth + 1)
    if not types:
        if "properties" in schema or "additionalProperties" in schema:
            types.add("object")
        elif "items" in schema:
            types.add("array")
    return types


def schema_types(schema: Any, root: Any = None) -> frozenset[str]:
    """frozenset[str]: the JSON types an element's text may be coerced to under ``schema``:
    its ``type`` (string or list), the types of its ``enum`` / ``const`` values and those of
    its anyOf / oneOf / allOf members; with none of these, object where it has properties,
    array where it has items, else string."""
    return frozenset(_declared_types(schema, root) or {"string"})


def container_schema(schema: Any, root: Any = None, depth: int = 0
                     ) -> tuple[str, dict] | None:
    """("array" | "object", the schema) that child elements are converted with: the first
    array-or-object type of ``schema`` (array before object), else of its anyOf / oneOf /
    allOf members in order; None where there is none."""
    schema = resolve_ref(schema, root)
    if not isinstance(schema, dict) or depth > MAX_DEPTH:
        return None
    names = _type_names(schema)
    for kind in ("array", "object"):
        if kind in names:
            return kind, schema
    if not names:
        if "items" in schema:
            return "array", schema
        if "properties" in schema or "additionalProperties" in schema:
            return "object", schema
    for key in ("anyOf", "oneOf", "allOf"):
        for sub in schema.get(key) or ():
            found = container_schema(sub, root, depth + 1)
            if found is not None:
                return found
    return None


def _finite(value: Any) -> bool:
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, list):
        return all(_finite(v) for v in value)
    if isinstance(value, dict):
        return all(_finite(v) for v in value.values())
    return True


def coerce_text(text: str, types: Iterable[str]) -> Any:
    """An element's text as the first of ``types`` it reads as, in the order null, integer,
    number, boolean, object, array, string (``text`` unchanged); with none of them, the
    text's JSON value if it is finite JSON, else the text."""
    types = set(types)
    s = text.strip(WHITESPACE)
    for t in _PRIORITY:
        if t not in types:
            continue
        if t == "null" and s.lower() == "null":
            return None
        if t == "integer" and _INT.fullmatch(s):
            return int(s)
        if t == "number" and _NUM.fullmatch(s):
            if _INT.fullmatch(s):
                return int(s)
            v = float(s)
            if math.isfinite(v):
                return int(v) if v.is_integer() else v
        if t == "boolean" and s.lower() in ("true", "1", "false", "0"):
            return s.lower() in ("true", "1")
        if t in ("object", "array"):
            try:
                v = json.loads(s)
            except ValueError:
                continue
            if isinstance(v, dict if t == "object" else list) and _finite(v):
                return v
        if t == "string":
            return text
    try:
        v = json.loads(s)
    except ValueError:
        return text
    return v if _finite(v) else text


# ---- tool-call parameters ---------------------------------------------------------------------

# An element's value: its text, or its (name, value) children in order.
Element = str | list[tuple[str, "Element"]]


def _parse_element(text: str, pos: int, depth: int) -> tuple[str, Element, int] | None:
    """(name, value, end) of the element whose opening tag starts at ``pos``; None where it
    is malformed or unterminated."""
    if depth > MAX_DEPTH:
        return None
    start = pos + len(ELEMENT_OPEN)
    end = text.find(">", start)
    if end < 0:
        return None
    name = text[start:end]
    if not name.strip() or name.startswith("/") or "<" in name:
        return None
    close = f"{ELEMENT_CLOSE}{name}>"
    pos = end + 1
    parts: list[str] = []
    children: list[tuple[str, Element]] = []
    while True:
        at = text.find(NS, pos)
        if at < 0:
            return None
        parts.append(text[pos:at])
        if text.startswith(close, at):
            pos = at + len(close)
            break
        if not text.startswith(ELEMENT_OPEN, at):
            return None
        child = _parse_element(text, at, depth + 1)
        if child is None:
            return None
        children.append(child[:2])
        pos = child[2]
    body = "".join(parts)
    if not children:
        return name, body, pos
    if body.strip():
        field = MIXED_TEXT_FIELD
        while any(n == field for n, _ in children):
            field = "$" + field
        children.append((field, body))
    return name, children, pos


def _parse_parameters(body: str) -> list[tuple[str, Element]]:
    """The parameter elements of an invoke body, up to the first malformed or unterminated
    one."""
    params: list[tuple[str, Element]] = []
    pos = 0
    while True:
        while pos < len(body) and body[pos].isspace():
            pos += 1
        if not body.startswith(ELEMENT_OPEN, pos):
            return params
        element = _parse_element(body, pos, 1)
        if element is None:
            return params
        params.append(element[:2])
        pos = element[2]


def _convert_element(value: Element, schema: Any, root: Any) -> Any:
    """An element's value as JSON under ``schema`` (None or not a schema: unconverted)."""
    schema = resolve_ref(schema, root)
    if not isinstance(schema, dict):
        return value if isinstance(value, str) else _convert_object(value, None, root)
    container = container_schema(schema, root)
    if isinstance(value, str):
        types = schema_types(schema, root)
        if container is not None and "string" not in types and not value.strip():
            return [] if container[0] == "array" else {}  # an empty list or dict
        return coerce_text(value, types)
    if container is not None and container[0] == "array":
        items = container[1].get("items")
        return [_convert_element(child, items, root) for _, child in value]
    return _convert_object(value, container[1] if container is not None else None, root)


def _convert_object(elements: list[tuple[str, Element]], schema: dict | None, root: Any) -> dict:
    """Named elements as an object under an object ``schema`` (its properties, else its
    additionalProperties); a repeated name collects its values into a list."""
    props = (schema or {}).get("properties")
    props = props if isinstance(props, dict) else {}
    additional = (schema or {}).get("additionalProperties")
    result: dict[str, Any] = {}
    repeated: set[str] = set()
    for name, element in elements:
        value = _convert_element(element, props.get(name, additional), root)
        if name not in result:
            result[name] = value
        elif name in repeated:
            result[name].append(value)
        else:
            result[name] = [result[name], value]
            repeated.add(name)
    return result


# ---- tool calls -------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class ToolCall:
    """One call: ``id`` ("call_" + 24 hex digits), the function ``name``, ``arguments`` (a
    JSON object, as a string)."""

    id: str
    name: str
    arguments: str

    def to_openai(self) -> dict:
        """dict: the OpenAI ``tool_calls`` entry of a message."""
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


def new_call_id() -> str:
    """str: a fresh tool-call id, "call_" + 24 random hex digits."""
    return "call_" + secrets.token_hex(12)


def _invoke_call(invoke: str, schemas: dict[str, dict]) -> ToolCall | None:
    """The call of one invoke's text after ``<invoke name=``: the name up to the first ``>``
    (its quotes dropped), then the parameters; None where the name is empty or unterminated."""
    end = invoke.find(">")
    if end < 0:
        return None
    name = invoke[:end].strip()
    if name[:1] in ("'", '"'):
        name = name[1:-1] if name.endswith(name[0]) and len(name) > 1 else name[1:]
    name = name.strip()
    if not name:
        return None
    root = schemas.get(name)
    schema = resolve_ref(root, root)
    args = _convert_object(_parse_parameters(invoke[end + 1:]),
                           schema if isinstance(schema, dict) else None, root)
    return ToolCall(new_call_id(), name, json.dumps(args, ensure_ascii=False))


class ToolCallStream:
    """Parses streamed content text into content and tool calls.

    ``feed(delta: str) -> list[dict]`` and ``finish() -> list[dict]`` return OpenAI chat
    ``delta`` bodies in order: ``{"content": str}`` for text outside the tool-call blocks (a
    possible partial ``<tool_call>`` tag at the end held back), and for each invoke, once
    its ``</invoke>`` has arrived (``finish``: the unterminated last one too),
    ``{"tool_calls": [{"index", "id", "type": "function", "function": {"name",
    "arguments"}}]}`` with the whole arguments. ``calls``: the ToolCalls so far.
    ``tools``: the request's OpenAI tools list (their schemas type the arguments).
    """

    def __init__(self, tools: Sequence[dict] | None):
        self._schemas = _function_schemas(tools)
        self._state = "content"  # content -> block -> invoke -> block ... -> content
        self._buf = ""
        self._scanned = 0  # invoke: INVOKE_END does not start before this offset
        self.calls: list[ToolCall] = []

    def feed(self, text: str) -> list[dict]:
        self._buf += text
        return self._drain(final=False)

    def finish(self) -> list[dict]:
        return self._drain(final=True)

    def _drain(self, final: bool) -> list[dict]:
        events: list[dict] = []

        def content(text: str) -> None:
            if not text:
                return
            if events and "content" in events[-1]:
                events[-1]["content"] += text
            else:
                events.append({"content": text})

        while True:
            buf = self._buf
            if self._state == "content":
                at = buf.find(TOOL_START)
                if at >= 0:
                    content(buf[:at])
                    self._buf, self._state = buf[at + len(TOOL_START):], "block"
                    continue
                keep = 0 if final else _held_back(buf, TOOL_START)
                content(buf[:len(buf) - keep])
                self._buf = buf[len(buf) - keep:]
                return events
            if self._state == "block":  # between invokes: text is dropped
                ends = [(at, tag) for tag in (INVOKE_START, TOOL_END)
                        if (at := buf.find(tag)) >= 0]
                if ends:
                    at, tag = min(ends)
                    self._buf = buf[at + len(tag):]
                    self._state, self._scanned = ("invoke", 0) if tag == INVOKE_START \
                        else ("content", 0)
                    continue
                keep = 0 if final else max(_held_back(buf, INVOKE_START),
                                           _held_back(buf, TOOL_END))
                self._buf = buf[len(buf) - keep:]
                return events
            at = buf.find(INVOKE_END, self._scanned)  # invoke
            if at < 0 and not final:
                self._scanned = max(0, len(buf) - len(INVOKE_END) + 1)
                return events
            invoke = buf if at < 0 else buf[:at]
            self._buf, self._state = ("", "block") if at < 0 else \
                (buf[at + len(INVOKE_END):], "block")
            call = _invoke_call(invoke, self._schemas)
            if call is not None:
                delta = {"index": len(self.calls), **call.to_openai()}
                self.calls.append(call)
                events.append({"tool_calls": [delta]})


def parse_tool_calls(text: str, tools: Sequence[dict] | None) -> tuple[str, list[ToolCall]]:
    """A whole content text as (content: the text outside the tool-call blocks, calls)."""
    stream = ToolCallStream(tools)
    events = stream.feed(text) + stream.finish()
    return "".join(e.get("content", "") for e in events), stream.calls
