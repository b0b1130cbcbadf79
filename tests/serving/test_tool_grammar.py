"""The llguidance grammars: random tokens sampled under the M3 tool-call mask always parse
(``parse_tool_calls``) to calls of the listed functions whose arguments validate against their
schemas; recorded outputs are accepted or rejected as the schema says; bad specs name their
field; response_format / structured_outputs compile to working grammars."""
import json

import llguidance as llg
import numpy as np
import pytest

from jax_msa_runner.serving.m3_output import NS, parse_tool_calls, resolve_ref
from jax_msa_runner.serving.tool_grammar import (GrammarSpecError, structured_output_grammar,
                                                 tool_call_grammar)


def t(s: str) -> str:
    return NS + s


# ---- a byte-level tokenizer with a few multi-byte tokens, and a random sampler ---------------

_MULTI = [NS, NS[:-1], "<tool_call>", "</tool_call>", '<invoke name="', '">', "</invoke>", "\n",
          "<item>", "</item>", "get_weather", "create_order", "true", "false", "null", "señor",
          '{"', '":']
_TOKENS = [bytes([i]) for i in range(256)] + [m.encode() for m in _MULTI] + [b"\xff<eos>"]
EOS = len(_TOKENS) - 1
NS_ID = 256


class _ByteTokenizer:
    eos_token_id, bos_token_id, tokens, special_token_ids = EOS, None, _TOKENS, [EOS]

    def __call__(self, s):
        return list(s.encode() if isinstance(s, str) else s)


TOK = llg.LLTokenizer(llg.TokenizerWrapper(_ByteTokenizer()))


def allowed(m: llg.LLMatcher) -> np.ndarray:
    bits = np.unpackbits(np.frombuffer(m.compute_bitmask(), np.uint8), bitorder="little")
    return np.flatnonzero(bits[:TOK.vocab_size])


def sample(grammar: str, rng: np.random.Generator, budget: int = 100) -> str:
    """Random allowed tokens until EOS: uniform, or a multi-byte token, early on; after
    ``budget`` tokens the ones that close things (EOS, the tag prefix, quotes, brackets)."""
    m = llg.LLMatcher(TOK, grammar)
    assert not m.is_error(), m.get_error()
    out = []
    for step in range(5000):
        ids = allowed(m)
        assert len(ids), m.get_error()
        late = step > budget
        if EOS in ids and (late or rng.random() < 0.15):
            assert m.consume_token(EOS)
            break
        closing = [i for i in (NS_ID, ord('"'), ord("}"), ord("]")) if i in ids]
        multi = ids[(ids >= 256) & (ids < EOS)]
        if late and closing:
            tok = closing[0]
        elif not late and len(multi) and rng.random() < 0.4:
            tok = int(rng.choice(multi))
        else:
            tok = int(rng.choice(ids))
        assert m.consume_token(tok), m.get_error()
        if tok == EOS:
            break
        out.append(tok)
    else:
        raise AssertionError("the sample did not end")
    assert m.is_accepting() and m.stop_reason() in ("EndOfSentence", "NoExtension")
    return TOK.decode_bytes(out).decode("utf-8")


def accepts(grammar: str, text: str) -> bool:
    m = llg.LLMatcher(TOK, grammar)
    assert not m.is_error(), m.get_error()
    return m.consume_tokens(TOK.tokenize_str(text)) and m.is_accepting()


# ---- a JSON-schema check for what the grammar supports (no jsonschema dependency) -----------

def _is_type(v, name: str) -> bool:
    if name == "integer":
        return (isinstance(v, int) and not isinstance(v, bool)) or (
            isinstance(v, float) and v.is_integer())
    if name == "number":
        return isinstance(v, (int, float)) and not isinstance(v, bool)
    return {"null": v is None, "boolean": isinstance(v, bool), "string": isinstance(v, str),
            "array": isinstance(v, list), "object": isinstance(v, dict)}[name]


def errors(v, schema, root, path="$") -> list[str]:
    schema = resolve_ref(schema, root)
    if schema is None or schema is True or schema == {}:
        return []
    errs = []
    if "anyOf" in schema or "oneOf" in schema:
        subs = schema.get("anyOf") or schema.get("oneOf")
        ok = [not errors(v, s, root, path) for s in subs]
        if not any(ok):
            errs.append(f"{path}: matches no member")
    if "allOf" in schema:
        for s in schema["allOf"]:
            errs += errors(v, s, root, path)
    if "type" in schema:
        names = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
        if not any(_is_type(v, n) for n in names):
            return errs + [f"{path}: {v!r} is not {names}"]
    if "enum" in schema and not any(v == e and type(v) is type(e) for e in schema["enum"]):
        errs.append(f"{path}: {v!r} not in enum")
    if "const" in schema and v != schema["const"]:
        errs.append(f"{path}: {v!r} is not the const")
    if isinstance(v, str):
        if len(v) < schema.get("minLength", 0) or len(v) > schema.get("maxLength", len(v)):
            errs.append(f"{path}: length {len(v)}")
    if isinstance(v, list):
        if len(v) < schema.get("minItems", 0) or len(v) > schema.get("maxItems", len(v)):
            errs.append(f"{path}: {len(v)} items")
        for i, x in enumerate(v):
            errs += errors(x, schema.get("items"), root, f"{path}[{i}]")
    if isinstance(v, dict):
        props = schema.get("properties", {})
        errs += [f"{path}: missing {r}" for r in schema.get("required", []) if r not in v]
        for k, x in v.items():
            if k in props:
                errs += errors(x, props[k], root, f"{path}.{k}")
            elif schema.get("additionalProperties") is False:
                errs.append(f"{path}: extra {k}")
            else:
                errs += errors(x, schema.get("additionalProperties"), root, f"{path}.{k}")
    return errs


def test_schema_check_itself():
    s = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
         "additionalProperties": False}
    assert errors({"a": 1}, s, s) == []
    assert errors({"a": True}, s, s) and errors({}, s, s) and errors({"a": 1, "b": 2}, s, s)


# ---- tools ------------------------------------------------------------------------------------

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {
        "location": {"type": "string", "minLength": 1, "maxLength": 40},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer"}}, "required": ["location", "unit"]}}}
ORDER = {"type": "function", "function": {"name": "create_order", "parameters": {
    "type": "object",
    "$defs": {"Addr": {"type": "object", "properties": {"street": {"type": "string"},
                                                        "zip": {"type": "integer"}},
                       "required": ["street"]}},
    "properties": {
        "user_id": {"type": "integer"},
        "items": {"type": "array", "minItems": 1, "maxItems": 4, "items": {
            "type": "object", "properties": {"sku": {"type": "string"},
                                             "qty": {"type": "integer"},
                                             "note": {"type": ["string", "null"]}},
            "required": ["sku", "qty"]}},
        "gift": {"type": "boolean"}, "priority": {"type": "number"},
        "meta": {"type": "object"},
        "counts": {"type": "object", "additionalProperties": {"type": "integer"}},
        "ship": {"anyOf": [{"$ref": "#/$defs/Addr"}, {"type": "null"}]},
        "value": {"type": ["integer", "string"]},
        "flag": {"type": ["boolean", "string"]},
        "matrix": {"type": "array", "items": {"type": "array", "items": {"type": "number"}}},
        "level": {"enum": [1, 2.5, "high", None, True]},
        "title": {"const": "señor"},
        "any": {}},
    "required": ["user_id", "items"]}}}
NOARGS = {"type": "function", "function": {"name": "ping"}}
EDGE = {"type": "function", "function": {"name": "edge", "parameters": {
    "type": "object", "$defs": {"X": {"type": "object", "properties": {"x": {"type": "number"}},
                                      "required": ["x"]}},
    "properties": {
        "u": {"anyOf": [{"type": "integer"}, {"type": "string", "enum": ["auto", "7"]},
                        {"type": "array", "items": {"type": "boolean"}}]},
        "n": {"type": ["number", "null", "string"]},
        "o": {"type": ["object", "string"], "properties": {"k": {"type": "integer"}}},
        "e": {"type": "array", "maxItems": 0},
        "m": {"type": "object", "additionalProperties": {
            "type": "array", "items": {"type": ["string", "integer"]}}},
        "f": {"type": "object", "additionalProperties": False},
        "a": {"allOf": [{"$ref": "#/$defs/X"}]}}}}}
TOOLS = [WEATHER, ORDER, NOARGS, EDGE]
SCHEMAS = {tool["function"]["name"]: tool["function"].get("parameters") or {} for tool in TOOLS}


def check_calls(text: str, names: set[str], *, content_ok: bool) -> list:
    content, calls = parse_tool_calls(text, TOOLS)
    assert calls, text
    if not content_ok:
        assert content.strip() == "", text
    for call in calls:
        assert call.name in names
        arguments = json.loads(call.arguments)
        schema = SCHEMAS[call.name]
        assert errors(arguments, schema, schema) == [], (text, arguments)
    return calls


@pytest.mark.parametrize("mode, name, before", [("required", None, False),
                                                ("required", None, True),
                                                ("named", "create_order", False),
                                                ("named", "edge", True)])
def test_random_samples_parse_to_valid_calls(mode, name, before):
    grammar = tool_call_grammar(TOOLS, mode=mode, name=name, allow_content_before=before)
    assert LLM_OK(grammar)
    rng = np.random.default_rng(len(mode) + before)
    names = {name} if name else set(SCHEMAS)
    seen = set()
    for _ in range(40):
        calls = check_calls(sample(grammar, rng), names, content_ok=before)
        if mode == "named":
            assert len(calls) == 1
        seen.update(k for c in calls for k in json.loads(c.arguments))
    assert len(seen) >= 6  # most parameters got exercised


def LLM_OK(grammar: str) -> bool:
    is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar, TOK)
    assert not is_error, messages
    return True


def test_recorded_calls_accepted():
    grammar = tool_call_grammar(TOOLS, mode="required", allow_content_before=True)
    weather = (f"{t('<tool_call>')}\n{t('<invoke name=\"get_weather\">')}\n"
               f"{t('<unit>')}celsius{t('</unit>')}\n{t('<location>')}Paris{t('</location>')}\n"
               f"{t('</invoke>')}\n{t('</tool_call>')}")
    order = (f"{t('<tool_call>')}{t('<invoke name=\"create_order\">')}"
             f"{t('<user_id>')}42{t('</user_id>')}{t('<items>')}\n{t('<item>')}"
             f"{t('<sku>')}book-001{t('</sku>')}{t('<qty>')}2{t('</qty>')}{t('<note>')}null"
             f"{t('</note>')}{t('</item>')}\n{t('</items>')}{t('<meta>')}{{\"a\":[1,\"x\"]}}"
             f"{t('</meta>')}{t('<ship>')}{t('<street>')}Main St{t('</street>')}{t('</ship>')}"
             f"{t('<matrix>')}{t('<item>')}{t('<item>')}1.5{t('</item>')}{t('</item>')}"
             f"{t('</matrix>')}{t('<level>')}high{t('</level>')}{t('<title>')}señor{t('</title>')}"
             f"{t('</invoke>')}{t('<invoke name=\"ping\">')}{t('</invoke>')}{t('</tool_call>')}")
    for text in ("Let me look that up.\n" + weather, weather + "\n" + order):
        assert accepts(grammar, text)
        check_calls(text, set(SCHEMAS), content_ok=True)
    assert not accepts(tool_call_grammar(TOOLS, mode="required", allow_content_before=False),
                       "Let me look that up.\n" + weather)


def _weather(body: str) -> str:
    return (f"{t('<tool_call>')}{t('<invoke name=\"get_weather\">')}{body}{t('</invoke>')}"
            f"{t('</tool_call>')}")


LOC, UNIT = f"{t('<location>')}Oslo{t('</location>')}", f"{t('<unit>')}celsius{t('</unit>')}"


@pytest.mark.parametrize("text, why", [
    (_weather(LOC), "a required parameter is missing"),
    (_weather(LOC + UNIT + LOC), "a parameter is repeated"),
    (_weather(LOC + UNIT + f"{t('<days>')}three{t('</days>')}"), "not an integer"),
    (_weather(LOC + f"{t('<unit>')}kelvin{t('</unit>')}"), "not in the enum"),
    (_weather(LOC + UNIT + f"{t('<wind>')}3{t('</wind>')}"), "not a property"),
    (_weather(f"{t('<location>')}{t('</location>')}" + UNIT), "shorter than minLength"),
    (_weather(f"{t('<location>')}a{NS}b{t('</location>')}" + UNIT), "the tag prefix in a string"),
    (_weather(LOC + UNIT).replace("get_weather", "get_time"), "not a listed function"),
    (_weather(LOC + UNIT) + " thanks", "text after the last block"),
    (_weather(LOC + UNIT).replace(t("</tool_call>"), ""), "an unterminated block"),
])
def test_recorded_outputs_rejected(text, why):
    grammar = tool_call_grammar(TOOLS, mode="required", allow_content_before=True)
    assert accepts(grammar, _weather(LOC + UNIT))
    assert not accepts(grammar, text), why


def test_named_mode_allows_only_one_invoke_of_that_function():
    grammar = tool_call_grammar(TOOLS, mode="named", name="get_weather",
                                allow_content_before=False)
    one = _weather(LOC + UNIT)
    assert accepts(grammar, one)
    two = one.replace(t("</tool_call>"), t('<invoke name="get_weather">') + LOC + UNIT
                      + t("</invoke>") + t("</tool_call>"))
    assert accepts(tool_call_grammar(TOOLS, mode="required", allow_content_before=False), two)
    assert not accepts(grammar, two)
    assert not accepts(grammar, one + one)
    ping = f"{t('<tool_call>')}{t('<invoke name=\"ping\">')}{t('</invoke>')}{t('</tool_call>')}"
    assert not accepts(grammar, ping)


def test_union_strings_never_read_as_other_types():
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"v": {"type": ["integer", "boolean", "null", "string"]},
                                         "s": {"type": "string"}}, "required": ["v"]}}}
    grammar = tool_call_grammar([tool], mode="required", allow_content_before=False)
    rng = np.random.default_rng(7)
    for _ in range(30):
        _, (call, *_) = parse_tool_calls(sample(grammar, rng), [tool])
        arguments = json.loads(call.arguments)
        assert isinstance(arguments["s"], str) if "s" in arguments else True
        assert arguments["v"] is None or isinstance(arguments["v"], (int, bool, str))

    def f(v):
        return (f"{t('<tool_call>')}{t('<invoke name=\"f\">')}{t('<v>')}{v}{t('</v>')}"
                f"{t('</invoke>')}{t('</tool_call>')}")
    assert accepts(grammar, f("12")) and accepts(grammar, f("true")) and accepts(grammar, f("x1"))
    assert not accepts(grammar, f(" 12")) and not accepts(grammar, f("TRUE"))
    assert not accepts(grammar, f("Null")) and not accepts(grammar, f("0 "))


def test_string_length_bounds_and_many_properties():
    def call(body):
        return (f"{t('<tool_call>')}{t('<invoke name=\"f\">')}{body}{t('</invoke>')}"
                f"{t('</tool_call>')}")

    def s(n):
        return f"{t('<s>')}{'x' * n}{t('</s>')}"
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object",
            "properties": {"s": {"type": "string", "minLength": 2, "maxLength": 128}}}}}
    grammar = tool_call_grammar([tool], mode="required", allow_content_before=False)
    assert [accepts(grammar, call(s(n))) for n in (1, 2, 128, 129)] == [False, True, True, False]
    tool["function"]["parameters"]["properties"]["s"]["maxLength"] = 129  # beyond 128: ignored
    grammar = tool_call_grammar([tool], mode="required", allow_content_before=False)
    assert accepts(grammar, call(s(300))) and not accepts(grammar, call(s(1)))
    props = {f"p{i}": {"type": "integer"} for i in range(70)}  # beyond 64: in schema order
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": props, "required": ["p5"]}}}
    grammar = tool_call_grammar([tool], mode="required", allow_content_before=False)

    def p(i):
        return f"{t(f'<p{i}>')}{i}{t(f'</p{i}>')}"
    assert accepts(grammar, call(p(5) + p(1) + p(69)))  # the required ones come first
    assert not accepts(grammar, call(p(1) + p(69)))  # p5 is required
    assert not accepts(grammar, call(p(5) + p(9) + p(1)))  # out of order


@pytest.mark.parametrize("tools, kwargs, field", [
    ([], {}, "tools"),
    ([{"type": "function", "function": {"name": "a<b"}}], {}, "tools[0].function.name"),
    ([WEATHER], {"mode": "named", "name": "nope"}, "tool_choice.function.name"),
    ([{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"not": {"type": "string"}}}}}}], {},
     "tools[0].function.parameters.properties.x"),
    ([{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "$defs": {"N": {"type": "object", "properties": {
            "next": {"$ref": "#/$defs/N"}}}}, "properties": {"n": {"$ref": "#/$defs/N"}}}}}],
     {}, "tools[0].function.parameters.properties.n.properties.next"),
    ([{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"invoke": {"type": "string"}}}}}], {},
     "tools[0].function.parameters.properties"),
    ([{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"$ref": "http://x/y"}}}}}], {},
     "tools[0].function.parameters.properties.x"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}], {},
     "tools[0].function.parameters"),
])
def test_bad_tool_specs_name_the_field(tools, kwargs, field):
    kwargs = {"mode": "required", "allow_content_before": False, **kwargs}
    with pytest.raises(GrammarSpecError) as e:
        tool_call_grammar(tools, **kwargs)
    assert e.value.field == field and str(e.value).startswith(field + ": ")


# ---- structured outputs -----------------------------------------------------------------------

PERSON = {"type": "object", "properties": {"name": {"type": "string"},
                                           "age": {"type": "integer"}}, "required": ["name"]}


@pytest.mark.parametrize("spec, good, bad", [
    ({"response_format": {"type": "json_object"}}, '{"a": [1, null]}', "[1]"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}},
     '{"name": "Ada", "age": 36}', '{"age": 36}'),
    ({"structured_outputs": {"json": json.dumps(PERSON)}}, '{"name": "Ada"}', '{"name": 1}'),
    ({"structured_outputs": {"json": PERSON, "disable_additional_properties": True}},
     '{"name": "Ada"}', '{"name": "Ada", "x": 1}'),
    ({"structured_outputs": {"json": PERSON, "disable_any_whitespace": True}},
     '{"name":"Ada"}', '{"name": "Ada"}'),
    ({"structured_outputs": {"regex": r"[0-9]{3}-[a-z]+"}}, "123-abc", "12-abc"),
    ({"structured_outputs": {"choice": ["yes", "no", "señor \"x\""]}}, 'señor "x"', "maybe"),
    ({"structured_outputs": {"grammar": 'start: "a" B+\nB: /[bc]/'}}, "abcb", "ab d"),
    ({"structured_outputs": {"grammar": 'root ::= "x" [0-9]+'}}, "x42", "x"),
    ({"structured_outputs": {"json_object": True}}, "{}", '"s"'),
])
def test_structured_output_grammars(spec, good, bad):
    grammar = structured_output_grammar(spec)
    assert accepts(grammar, good) and not accepts(grammar, bad)


def test_unconstrained_specs_give_none():
    assert structured_output_grammar({}) is None
    assert structured_output_grammar({"response_format": {"type": "text"}}) is None


@pytest.mark.parametrize("spec, field", [
    ({"response_format": "json"}, "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": [1]}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "foo"}}}},
     "response_format.json_schema.schema"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json"),
    ({"structured_outputs": {"regex": "(("}}, "structured_outputs.regex"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"structured_outputs": {"grammar": 'root ::= "a" [b-c'}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"grammar": "start: undefined_rule"}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
     "structured_outputs"),
])
def test_malformed_structured_output_specs_name_the_field(spec, field):
    with pytest.raises(ValueError) as e:
        structured_output_grammar(spec)
    assert e.value.field == field and str(e.value).startswith(field + ": ")
