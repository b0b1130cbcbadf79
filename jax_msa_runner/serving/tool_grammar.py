"""llguidance grammars: MiniMax-M3 tool calls for a request's tools, and the structured
outputs of ``response_format`` / vLLM's ``structured_outputs``.

``tool_call_grammar`` writes a Lark grammar (llguidance's dialect; ``LLMatcher`` takes it as
it is) that admits only ``<tool_call>`` blocks whose invokes name a listed function and whose
parameters are exactly the schema's properties, each at most once, in any order, the
required ones present, with values that ``m3_output.parse_tool_calls`` reads back as the
schema's types: integers, numbers, booleans, null, strings, enum / const values, objects
(child elements), arrays (``<item>`` children, min/maxItems), anyOf / oneOf members (of
the containers, only the one the parser converts children with), local ``$ref``s. Objects
without properties (free-form, or maps through ``additionalProperties``) are written as
JSON text. No string holds the ``]<]minimax[>[`` tag prefix, and a string never reads as
another type of its union.

Not enforced: string min/maxLength above 128 (llguidance 1.9's lexer, with default limits,
mis-lexes larger bounded repetitions), numeric bounds, ``multipleOf``, ``pattern``,
``format``, ``uniqueItems``, ``min/maxProperties``, oneOf's exclusivity. Unsupported schemas
(``not``, ``if``, ``contains``, tuple items, allOf of several members, recursive or remote
``$ref``s) raise ``GrammarSpecError``.

``structured_output_grammar`` turns the request's ``response_format`` (json_object,
json_schema) or ``structured_outputs`` (json, regex, choice, grammar, json_object) into an
llguidance grammar string through llguidance's own JSON-schema / regex / Lark compilers.
Malformed specs raise ``GrammarSpecError`` (a ValueError) naming the field.
"""
from __future__ import annotations

import json
from typing import Any, Literal, Sequence

import llguidance

from jax_msa_runner.serving.m3_output import (ITEM, MAX_DEPTH, NS, TOOL_END,
                                              TOOL_START, coerce_text, container_schema,
                                              json_type, resolve_ref, schema_types)

_SCALARS = ("null", "integer", "number", "boolean", "string")
_TYPES = _SCALARS + ("object", "array")
_UNSUPPORTED = ("not", "if", "then", "else", "contains", "prefixItems", "dependentSchemas")
_NSRE = r"\]<\]minimax\[>\["
_MAX_BOUND = 128  # the largest string length bound enforced
_WS = r"[ \t\r\n]*"
# What coerce_text reads as each non-string type (after stripping spaces, tabs, newlines).
_READS_AS = {
    "null": rf"/{_WS}(?i:null){_WS}/",
    "integer": rf"/{_WS}[+-]?[0-9]+{_WS}/",
    "number": rf"/{_WS}[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?{_WS}/",
    "boolean": rf"/{_WS}((?i:true|false)|1|0){_WS}/",
    "object": rf"/{_WS}[\[{{](?s:.*)/",
    "array": rf"/{_WS}[\[{{](?s:.*)/",
}
_NO_NS = rf"~/(?s:.*){_NSRE}(?s:.*)/"
# Shared terminals and rules: jv / jo / ja are any JSON value / object / array, without
# the tag prefix in their strings; numbers stay finite as floats.
_BASE = "\n".join([
    f"WS: /{_WS}/",
    f"NOTNS: /(?s:.*)/ & {_NO_NS}",
    r"INT: /-?(0|[1-9][0-9]*)/",
    r"NUM: /-?(0|[1-9][0-9]{0,15})(\.[0-9]{1,16})?([eE][+-]?[0-9]{1,2})?/",
    r'BOOL: "true" | "false"',
    r'J_STRING: /"(\\([\"\\\/bfnrt]|u([0-9a-cA-CefEF][0-9a-fA-F]{3}|[dD][0-7][0-9a-fA-F]{2}))'
    r'|[^"\\\x00-\x1f])*"/ & ' + _NO_NS,
    r'jv: jo | ja | J_STRING | NUM | "true" | "false" | "null"',
    r'jo: "{" (J_STRING ":" jv ("," J_STRING ":" jv)*)? "}"',
    r'ja: "[" (jv ("," jv)*)? "]"',
])


class GrammarSpecError(ValueError):
    """A spec no grammar can be built for; ``field`` names the request field."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


def _lit(text: str) -> str:
    return json.dumps(text)


def _same(a: Any, b: Any) -> bool:
    numbers = (int, float)
    if isinstance(a, numbers) and isinstance(b, numbers) and not isinstance(a, bool) \
            and not isinstance(b, bool):
        return a == b
    return json_type(a) == json_type(b) and a == b


def _render(value: Any) -> str:
    """The element text of a JSON value (strings as they are)."""
    return value if isinstance(value, str) else json.dumps(value, separators=(",", ":"))


class _Builder:
    """Collects Lark rules and terminals; ``value`` and ``params`` write an element's
    grammar for a schema whose local refs resolve against ``root``."""

    def __init__(self):
        self.lines: list[str] = []
        self._terms: dict[str, str] = {}
        self._memo: dict[tuple, str] = {}
        self._active: set[int] = set()
        self._n = 0

    def _name(self, prefix: str) -> str:
        self._n += 1
        return f"{prefix}{self._n}"

    def term(self, body: str) -> str:
        if body not in self._terms:
            self._terms[body] = name = self._name("T")
            self.lines.append(f"{name}: {body}")
        return self._terms[body]

    def rule(self, body: str) -> str:
        name = self._name("r")
        self.lines.append(f"{name}: {body}")
        return name

    def open(self, tag: str) -> str:
        return self.term(f"WS {_lit(f'{NS}<{tag}>')}")

    def close(self, tag: str) -> str:
        return self.term(f"WS {_lit(f'{NS}</{tag}>')}")

    # ---- schemas ----

    def _resolve(self, schema: Any, root: Any, path: str) -> dict | None:
        """The schema as a dict, None for "anything"; raises for what is not supported."""
        if schema is None or schema is True:
            return None
        resolved = resolve_ref(schema, root)
        if resolved is None:
            raise GrammarSpecError(path, f"cannot resolve $ref {json.dumps(schema.get('$ref'))} "
                                         "(only local refs are supported)")
        if resolved is True:
            return None
        if resolved is False:
            raise GrammarSpecError(path, "the schema false admits no value")
        if not isinstance(resolved, dict):
            raise GrammarSpecError(path, "must be a JSON schema object")
        for key in _UNSUPPORTED:
            if key in resolved:
                raise GrammarSpecError(path, f"the schema keyword {key!r} is not supported")
        if isinstance(resolved.get("items"), list):
            raise GrammarSpecError(path, "tuple items are not supported")
        all_of = resolved.get("allOf")
        if all_of is not None:
            if not isinstance(all_of, list) or len(all_of) != 1:
                raise GrammarSpecError(path, "allOf is supported with one member only")
            rest = {k: v for k, v in resolved.items() if k not in ("allOf", "title",
                                                                   "description", "default")}
            if rest:
                raise GrammarSpecError(path, "allOf is supported without sibling keywords only")
            return self._resolve(all_of[0], root, f"{path}.allOf[0]")
        for name in (resolved.get("type") if isinstance(resolved.get("type"), list)
                     else [resolved.get("type")]):
            if name is not None and name not in _TYPES:
                raise GrammarSpecError(path, f"unknown type {json.dumps(name)}")
        return resolved

    def _members(self, schema: dict, root: Any, path: str, depth: int) -> list[dict | None]:
        """The alternatives of a schema: its anyOf / oneOf members (flattened), or itself."""
        self._guard(None, path, depth)
        for key in ("anyOf", "oneOf"):
            if key in schema:
                if any(k in schema for k in ("type", "enum", "const")):
                    raise GrammarSpecError(path, f"{key} beside type / enum / const is not "
                                                 "supported")
                if not isinstance(schema[key], list) or not schema[key]:
                    raise GrammarSpecError(f"{path}.{key}", "must be a non-empty list")
                out: list[dict | None] = []
                for i, sub in enumerate(schema[key]):
                    sub_path = f"{path}.{key}[{i}]"
                    sub = self._resolve(sub, root, sub_path)
                    out += [None] if sub is None else self._members(sub, root, sub_path,
                                                                    depth + 1)
                return out
        return [schema]

    def _guard(self, schema: dict | None, path: str, depth: int) -> None:
        if depth > MAX_DEPTH - 2:
            raise GrammarSpecError(path, f"nests deeper than {MAX_DEPTH - 2} levels")
        if schema is not None and id(schema) in self._active:
            raise GrammarSpecError(path, "recursive schemas are not supported")

    def value(self, schema: Any, tag: str, root: Any, path: str, depth: int) -> str:
        """A symbol for the text and children of an element ``tag`` whose value has
        ``schema``, its closing tag included."""
        resolved = self._resolve(schema, root, path)
        key = (id(resolved), id(root), tag)
        if key in self._memo:
            return self._memo[key]
        self._guard(resolved, path, depth)
        if resolved is not None:
            self._active.add(id(resolved))
        try:
            if resolved is None:
                alts = [self._string({}, frozenset({"string"}), tag)]
            else:
                types = schema_types(resolved, root)
                alts = []
                for sub in self._members(resolved, root, path, depth):
                    alts += self._scalars(sub, types, tag, path)
                container = container_schema(resolved, root)
                if container is not None:
                    # with string among the types, a blank element reads as a string
                    alts.append(self._container(container, tag, root, path, depth,
                                                nonempty="string" in types))
            alts = [a for a in alts if a is not None]
            alts = list(dict.fromkeys(alts))
            if not alts:
                raise GrammarSpecError(path, "no element text satisfies this schema")
            sym = alts[0] if len(alts) == 1 else self.rule(" | ".join(alts))
        finally:
            self._active.discard(id(resolved))
        self._memo[key] = sym
        return sym

    def _scalars(self, sub: dict | None, types: frozenset[str], tag: str, path: str
                 ) -> list[str]:
        """Terminals (value + closing tag) of a member's scalar values, as the parser reads
        them under the element's coercion ``types``."""
        close = _lit(f"{NS}</{tag}>")
        if sub is None:
            return [self._string({}, types, tag)]
        if "enum" in sub or "const" in sub:
            values = list(sub.get("enum") or []) + ([sub["const"]] if "const" in sub else [])
            out = []
            for v in values:
                text = _render(v)
                if NS not in text and _same(coerce_text(text, types), v):
                    out.append(self.term(f"{_lit(text)} {close}"))
            return out
        names = sub.get("type")
        names = [names] if isinstance(names, str) else list(names or [])
        if not names and not any(k in sub for k in ("properties", "additionalProperties",
                                                    "items")):
            names = ["string"]  # an unconstrained member: any text
        out = []
        for t in names:
            if t == "string":
                out.append(self._string(sub, types, tag))
            elif t in _SCALARS:
                regex = {"null": '"null"', "integer": "INT", "number": "NUM",
                         "boolean": "BOOL"}[t]
                out.append(self.term(f"{regex} {close}"))
        return out

    def _string(self, sub: dict, types: frozenset[str], tag: str) -> str:
        parts = ["NOTNS"]
        lo, hi = (v if isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= _MAX_BOUND
                  else None for v in (sub.get("minLength"), sub.get("maxLength")))
        if lo or hi is not None:
            parts.append(f"/(?s:.{{{lo or 0},{'' if hi is None else hi}}})/")
        parts += [f"~{_READS_AS[t]}" for t in sorted(types) if t in _READS_AS]
        body = self.term(" & ".join(parts))
        return self.term(f"{body} {_lit(f'{NS}</{tag}>')}")

    def _container(self, container: tuple[str, dict], tag: str, root: Any, path: str,
                   depth: int, *, nonempty: bool) -> str | None:
        """The children of an array or object element and its closing tag (``nonempty``: at
        least one child); None where no such children fit the schema."""
        kind, schema = container
        if kind == "array":
            lo, hi = schema.get("minItems"), schema.get("maxItems")
            lo = lo if isinstance(lo, int) and lo > 0 else 0
            hi = hi if isinstance(hi, int) and hi >= 0 else None
            lo = max(lo, int(nonempty))
            if hi is not None and hi < lo:
                return None
            if hi == 0:
                return self.close(tag)
            value = self.value(schema.get("items"), ITEM, root, f"{path}.items", depth + 1)
            item = self.rule(f"{self.open(ITEM)} {value}")
            rep = f"{item}*" if not lo and hi is None else \
                f"{item}{{{lo},{'' if hi is None else hi}}}"
            return self.rule(f"{rep} {self.close(tag)}")
        props = schema.get("properties")
        if props or schema.get("required"):
            return self.params(schema, self.close(tag), root, path, depth, nonempty=nonempty)
        additional = schema.get("additionalProperties")
        if additional is False:
            return None if nonempty else self.close(tag)  # only the empty object
        return self.rule(f"{self._json_map(additional, root, path, depth)} {self.close(tag)}")

    def params(self, schema: dict | None, close: str, root: Any, path: str, depth: int, *,
               nonempty: bool = False) -> str | None:
        """The child elements of an object (its properties, each at most once, in any order,
        the required ones present; ``nonempty``: at least one) and then ``close``."""
        props = (schema or {}).get("properties") or {}
        if not isinstance(props, dict):
            raise GrammarSpecError(f"{path}.properties", "must be an object")
        required = (schema or {}).get("required") or []
        if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
            raise GrammarSpecError(f"{path}.required", "must be a list of names")
        names = list(dict.fromkeys(required)) + [n for n in props if n not in required]
        if not names:
            return None if nonempty else close
        elements = []
        for name in names:
            if not name.strip() or name.startswith("/") or "<" in name or ">" in name \
                    or name == "invoke":
                raise GrammarSpecError(f"{path}.properties",
                                       f"the name {json.dumps(name)} cannot be an element name")
            child = self.value(props.get(name), name, root, f"{path}.properties.{name}",
                               depth + 1)
            elements.append(self.rule(f"{self.open(name)} {child}"))
        n_req = max(len(dict.fromkeys(required)), int(nonempty and len(names) > 64))
        if len(names) > 64:  # beyond a parametric rule's bits: the schema's order
            seq = " ".join(e if i < n_req else f"{e}?" for i, e in enumerate(elements))
            return self.rule(f"{seq} {close}")
        perm = self._name("perm")
        end = (f" %if is_ones([0:{n_req}])" if n_req else
               " %if bit_count_ge(_, 1)" if nonempty else "")
        alts = ['""' + end]
        alts += [f"{e} {perm}::set_bit({i}) %if bit_clear({i})" for i, e in enumerate(elements)]
        self.lines.append(f"{perm}::_ : " + "\n    | ".join(alts))
        return self.rule(f"{perm}::0x0 {close}")

    # ---- JSON text (objects without properties) ----

    def _json_map(self, values: Any, root: Any, path: str, depth: int) -> str:
        if values is None or values is True:
            return "jo"
        v = self._json(values, root, f"{path}.additionalProperties", depth + 1)
        return self.rule(f'"{{" (J_STRING ":" {v} ("," J_STRING ":" {v})*)? "}}"')

    def _json(self, schema: Any, root: Any, path: str, depth: int) -> str:
        """A symbol for JSON text of a value with ``schema``."""
        resolved = self._resolve(schema, root, path)
        if resolved is None:
            return "jv"
        key = ("json", id(resolved), id(root))
        if key in self._memo:
            return self._memo[key]
        self._guard(resolved, path, depth)
        self._active.add(id(resolved))
        try:
            alts = []
            for sub in self._members(resolved, root, path, depth):
                alts += self._json_alts(sub, root, path, depth)
            alts = list(dict.fromkeys(alts))
            if not alts:
                raise GrammarSpecError(path, "no JSON value satisfies this schema")
            sym = alts[0] if len(alts) == 1 else self.rule(" | ".join(alts))
        finally:
            self._active.discard(id(resolved))
        self._memo[key] = sym
        return sym

    def _json_alts(self, sub: dict | None, root: Any, path: str, depth: int) -> list[str]:
        if sub is None:
            return ["jv"]
        if "enum" in sub or "const" in sub:
            values = list(sub.get("enum") or []) + ([sub["const"]] if "const" in sub else [])
            texts = [json.dumps(v, separators=(",", ":")) for v in values]
            return [self.term(_lit(t)) for t in texts if NS not in t]
        names = sub.get("type")
        names = [names] if isinstance(names, str) else list(names or [])
        if not names:
            names = ["array"] if "items" in sub else ["object"] if (
                "properties" in sub or "additionalProperties" in sub) else []
            if not names:
                return ["jv"]
        out = []
        for t in names:
            if t == "object":
                if sub.get("properties") or sub.get("required"):
                    raise GrammarSpecError(path, "objects with properties inside JSON text "
                                                 "(under a free-form object) are not supported")
                additional = sub.get("additionalProperties")
                out.append('"{" "}"' if additional is False else
                           self._json_map(additional, root, path, depth))
            elif t == "array":
                item = self._json(sub.get("items"), root, f"{path}.items", depth + 1)
                out.append(self.rule(f'"[" ({item} ("," {item})*)? "]"'))
            else:
                out.append({"null": '"null"', "integer": "INT", "number": "NUM",
                            "boolean": "BOOL", "string": "J_STRING"}[t])
        return out


def _function_tools(tools: Any) -> list[tuple[str, dict]]:
    """(name, parameters) of each tool; raises naming the field of a malformed one."""
    if not isinstance(tools, list) or not tools:
        raise GrammarSpecError("tools", "must be a non-empty list of function tools")
    out = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or tool.get("type", "function") != "function":
            raise GrammarSpecError(f"tools[{i}]", 'must be {"type": "function", "function": '
                                                  '{"name", "parameters"}}')
        name = fn.get("name")
        if not isinstance(name, str) or not name.strip() or any(c in name for c in "<>\"'") \
                or NS in name:
            raise GrammarSpecError(f"tools[{i}].function.name",
                                   f"{json.dumps(name)} cannot be a function name here")
        params = fn.get("parameters")
        if params is None:
            params = {}
        if not isinstance(params, dict):
            raise GrammarSpecError(f"tools[{i}].function.parameters", "must be an object")
        out.append((name, params))
    return out


def tool_call_grammar(tools: Sequence[dict], *, mode: Literal["required", "named"],
                      name: str | None = None, allow_content_before: bool) -> str:
    """str: a Lark grammar (llguidance) for MiniMax-M3 tool calls of ``tools`` (an OpenAI
    tools list). ``mode`` "required": one or more ``<tool_call>`` blocks of one or more
    invokes of listed functions; "named": one block of one invoke of function ``name``.
    ``allow_content_before``: any text without the tag prefix may come first (else only
    whitespace). Nothing may follow the last block. Raises GrammarSpecError."""
    functions = [(i, n, p) for i, (n, p) in enumerate(_function_tools(tools))]
    if mode == "named":
        functions = [f for f in functions if f[1] == name]
        if not functions:
            raise GrammarSpecError("tool_choice.function.name",
                                   f"{json.dumps(name)} is not one of the tools")
        functions = functions[:1]
    elif mode != "required":
        raise GrammarSpecError("tool_choice", f'must be "required" or named, got {mode!r}')
    b = _Builder()
    invokes = []
    for i, fname, params in functions:
        path = f"tools[{i}].function.parameters"
        schema = b._resolve(params, params, path)
        if schema is not None and schema.get("type", "object") != "object":
            raise GrammarSpecError(path, "must be an object schema")
        body = b.params(schema, b.close("invoke"), params, path, 0)
        head = b.term(f"WS {_lit(f'{NS}<invoke name=\"{fname}\">')}")
        invokes.append(b.rule(f"{head} {body}"))
    first = b.term(("NOTNS " if allow_content_before else "WS ") + _lit(TOOL_START))
    end = b.term(f"WS {_lit(TOOL_END)}")
    if mode == "named":
        start = f"start: {first} {invokes[0]} {end}"
    else:
        any_invoke = b.rule(" | ".join(invokes))
        nxt = b.term(f"WS {_lit(TOOL_START)}")
        start = f"start: {first} {any_invoke}+ {end} ({nxt} {any_invoke}+ {end})*"
    return "\n".join([start, _BASE, *b.lines]) + "\n"


# ---- structured outputs -----------------------------------------------------------------------

def _checked(grammar: str, field: str) -> str:
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise GrammarSpecError(field, f"invalid: {messages[0] if messages else 'unknown error'}")
    return grammar


def _json_schema_grammar(schema: Any, field: str, options: dict | None = None) -> str:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise GrammarSpecError(field, f"is not valid JSON: {e}") from None
    if not isinstance(schema, (dict, bool)):
        raise GrammarSpecError(field, "must be a JSON schema (an object)")
    return _checked(llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=options
                                                                   or None), field)


def _no_additional_properties(schema: Any) -> Any:
    """vLLM's disable_additional_properties: objects with properties and no
    additionalProperties get ``false``."""
    if isinstance(schema, list):
        return [_no_additional_properties(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _no_additional_properties(v) for k, v in schema.items()}
    if "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def _response_format(rf: Any) -> str | None:
    if not isinstance(rf, dict):
        raise GrammarSpecError("response_format", "must be an object")
    kind = rf.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return _json_schema_grammar({"type": "object"}, "response_format")
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict):
            raise GrammarSpecError("response_format.json_schema", "must be an object")
        schema = js.get("schema", {"type": "object"})
        return _json_schema_grammar(schema, "response_format.json_schema.schema")
    raise GrammarSpecError("response_format.type", 'must be "text", "json_object" or '
                                                   f'"json_schema", got {json.dumps(kind)}')


def _structured_outputs(so: Any) -> str:
    if not isinstance(so, dict):
        raise GrammarSpecError("structured_outputs", "must be an object")
    kinds = [k for k in ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
             if so.get(k) not in (None, False)]
    if len(kinds) != 1:
        raise GrammarSpecError("structured_outputs", "must set exactly one of json, regex, "
                                                     f"choice, grammar, json_object (got {kinds})")
    kind = kinds[0]
    field = f"structured_outputs.{kind}"
    value = so[kind]
    options = {}
    if so.get("disable_any_whitespace"):
        options["whitespace_flexible"] = False
    if so.get("whitespace_pattern") is not None:
        if not isinstance(so["whitespace_pattern"], str):
            raise GrammarSpecError("structured_outputs.whitespace_pattern", "must be a string")
        options["whitespace_pattern"] = so["whitespace_pattern"]
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as e:
                raise GrammarSpecError(field, f"is not valid JSON: {e}") from None
        if so.get("disable_additional_properties"):
            value = _no_additional_properties(value)
        return _json_schema_grammar(value, field, options)
    if kind == "json_object":
        if value is not True:
            raise GrammarSpecError(field, "must be true")
        return _json_schema_grammar({"type": "object"}, field, options)
    if kind == "regex":
        if not isinstance(value, str):
            raise GrammarSpecError(field, "must be a string")
        return _checked(llguidance.LLMatcher.grammar_from_regex(value), field)
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
            raise GrammarSpecError(field, "must be a non-empty list of strings")
        lark = "start: " + " | ".join(_lit(c) for c in value)
        return _checked(llguidance.LLMatcher.grammar_from_lark(lark), field)
    if kind == "grammar":
        if not isinstance(value, str) or not value.strip():
            raise GrammarSpecError(field, "must be a non-empty Lark or GBNF grammar")
        try:
            grammar = llguidance.grammar_from("grammar", value)
        except ValueError as e:
            raise GrammarSpecError(field, str(e)) from None
        return _checked(grammar, field)
    raise GrammarSpecError(field, "is not supported by this server")


def structured_output_grammar(spec: dict) -> str | None:
    """str: the llguidance grammar of a request's ``response_format`` or
    ``structured_outputs`` (``spec``: the request body, or a dict with those keys); None
    when neither constrains the output (absent, or response_format type "text"). Raises
    GrammarSpecError naming the field."""
    rf, so = spec.get("response_format"), spec.get("structured_outputs")
    from_rf = _response_format(rf) if rf is not None else None
    if so is None:
        return from_rf
    if from_rf is not None:
        raise GrammarSpecError("structured_outputs", "cannot be combined with response_format")
    return _structured_outputs(so)
