"""MiniMax-M3 output parsing on recorded-style outputs: the reasoning split (whole and
streamed), tool calls with schema coercion, malformed and unterminated input, and streams that
give the whole-output result however the text is chunked."""
import json
import re

import pytest
from hypothesis import given, settings, strategies as st

from jax_msa_runner.serving.m3_output import (NS, ReasoningStream, ToolCallStream, coerce_text,
                                              parse_tool_calls, split_reasoning)


def t(s: str) -> str:
    """A structural tag with the M3 prefix."""
    return NS + s


def invoke(name: str, quote: str = '"') -> str:
    return t(f"<invoke name={quote}{name}{quote}>")


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather",
    "parameters": {"type": "object", "properties": {
        "location": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]},
        "days": {"type": "integer"}}, "required": ["location"]}}}
ORDER = {"type": "function", "function": {"name": "create_order", "parameters": {
    "type": "object",
    "$defs": {"Addr": {"type": "object", "properties": {"street": {"type": "string"},
                                                        "zip": {"type": "integer"}}}},
    "properties": {
        "user_id": {"type": "integer"},
        "items": {"type": "array", "items": {"type": "object", "properties": {
            "sku": {"type": "string"}, "qty": {"type": "integer"},
            "price": {"type": "number"}}}},
        "gift": {"type": "boolean"}, "note": {"type": ["string", "null"]},
        "tags": {"type": "array", "items": {"type": "string"}},
        "meta": {"type": "object"}, "ship": {"anyOf": [{"$ref": "#/$defs/Addr"},
                                                       {"type": "null"}]},
        "code": {"type": "string"}, "level": {"enum": [1, 2, 3]}}}}}
TOOLS = [WEATHER, ORDER]

ONE_CALL = (f"I'll check the weather.\n{t('<tool_call>')}\n{invoke('get_weather')}\n"
            f"{t('<location>')}San Francisco, CA{t('</location>')}\n{t('<unit>')}c{t('</unit>')}\n"
            f"{t('<days>')}3{t('</days>')}\n{t('</invoke>')}\n{t('</tool_call>')}")
ORDER_CALL = (f"{t('<tool_call>')}\n{invoke('create_order')}\n"
              f"{t('<user_id>')}42{t('</user_id>')}\n{t('<items>')}\n"
              f"{t('<item>')}{t('<sku>')}book-001{t('</sku>')}{t('<qty>')}2{t('</qty>')}"
              f"{t('<price>')}12.50{t('</price>')}{t('</item>')}\n"
              f"{t('<item>')}{t('<sku>')}pen-7{t('</sku>')}{t('<qty>')}10{t('</qty>')}"
              f"{t('</item>')}\n"
              f"{t('</items>')}\n{t('<gift>')}true{t('</gift>')}\n{t('<note>')}null{t('</note>')}\n"
              f"{t('<tags>')}{t('<item>')}urgent{t('</item>')}{t('</tags>')}\n"
              f"{t('<ship>')}{t('<street>')}1 Main St{t('</street>')}{t('<zip>')}94105{t('</zip>')}"
              f"{t('</ship>')}\n{t('<code>')}007{t('</code>')}\n{t('<level>')}2{t('</level>')}\n"
              f"{t('</invoke>')}\n{t('</tool_call>')}")
ORDER_ARGS = {"user_id": 42, "items": [{"sku": "book-001", "qty": 2, "price": 12.5},
                                       {"sku": "pen-7", "qty": 10}],
              "gift": True, "note": None, "tags": ["urgent"],
              "ship": {"street": "1 Main St", "zip": 94105}, "code": "007", "level": 2}
SEVERAL = (f"Checking both cities.{t('<tool_call>')}\n"
           f"{invoke('get_weather')}{t('<location>')}Paris{t('</location>')}"
           f"{t('</invoke>')}\n"
           f"{invoke('get_weather')}{t('<location>')}Rome{t('</location>')}"
           f"{t('<days>')}1{t('</days>')}{t('</invoke>')}\n{t('</tool_call>')}"
           f"\nand then{t('<tool_call>')}{invoke('create_order')}"
           f"{t('<user_id>')}7{t('</user_id>')}{t('</invoke>')}{t('</tool_call>')} done.")


def args(call) -> dict:
    return json.loads(call.arguments)


def summary(calls) -> list:
    return [(c.name, args(c)) for c in calls]


# ---- reasoning --------------------------------------------------------------------------------

@pytest.mark.parametrize("text, thinking, want", [
    ("The capital of France is Paris.", False, (None, "The capital of France is Paris.")),
    ("<mm:think>The user asks 2+2. That is 4.</mm:think>\n\n2 + 2 = 4.", False,
     ("The user asks 2+2. That is 4.", "\n\n2 + 2 = 4.")),
    ("The user greets me; reply politely.</mm:think>\nHello! How can I help?", True,
     ("The user greets me; reply politely.", "\nHello! How can I help?")),
    ("Still thinking about the proof, step 3 of", True,
     ("Still thinking about the proof, step 3 of", "")),
    ("<mm:think>repeated opener</mm:think>answer", True, ("repeated opener", "answer")),
    ("</mm:think>Stray closer at the start is dropped.", False,
     (None, "Stray closer at the start is dropped.")),
    ("<mm:think>a</mm:think>b <mm:think>c</mm:think>", False, ("a", "b <mm:think>c</mm:think>")),
    ("Before <mm:think>thoughts</mm:think> after", False, ("thoughts", "Before  after")),
    ("x<mm:think>cut off mid-reasoning", False, ("cut off mid-reasoning", "x")),
    ("<mm:think></mm:think>only content", False, (None, "only content")),
    ("content with </mm:think> later", False, (None, "content with </mm:think> later")),
])
def test_split_reasoning(text, thinking, want):
    assert split_reasoning(text, starts_in_reasoning=thinking) == want


def test_reasoning_stream_holds_back_only_a_marker_prefix():
    s = ReasoningStream(starts_in_reasoning=False)
    assert s.feed("Hi <mm:th") == ("", "Hi ")
    assert s.feed("ink>plan") == ("plan", "")
    assert s.feed(" more</mm") == (" more", "")
    assert not s.reasoning_ended
    assert s.feed(":think>Answer <") == ("", "Answer <")  # after the block nothing is held
    assert s.reasoning_ended
    s = ReasoningStream(starts_in_reasoning=False)
    assert s.feed("a <mm:x") == ("", "a <mm:x")  # not a marker prefix any more
    s = ReasoningStream(starts_in_reasoning=True)
    assert s.feed("<mm:") == ("", "")  # could be a repeated opener
    assert s.finish() == ("<mm:", "")


_REASONING_PIECES = st.sampled_from(["<mm:think>", "</mm:think>", "<mm:", "</mm", "think>", "<",
                                     ">", "a", "bc", " ", "\n", "é", "<tool"])


@settings(max_examples=150, deadline=None)
@given(pieces=st.lists(_REASONING_PIECES, max_size=14), thinking=st.booleans(),
       cuts=st.lists(st.integers(0, 200), max_size=8))
def test_reasoning_stream_matches_split_for_any_chunking(pieces, thinking, cuts):
    text = "".join(pieces)
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    s = ReasoningStream(starts_in_reasoning=thinking)
    out = [s.feed(text[a:b]) for a, b in zip(bounds, bounds[1:])] + [s.finish()]
    reasoning, content = "".join(r for r, _ in out), "".join(c for _, c in out)
    assert ((reasoning or None), content) == split_reasoning(text, starts_in_reasoning=thinking)


# ---- tool calls -------------------------------------------------------------------------------

def test_plain_content_has_no_calls():
    text = "No tool is needed: the answer is 42. <b>bold</b> ]<] not a tag"
    assert parse_tool_calls(text, TOOLS) == (text, [])
    assert parse_tool_calls("", TOOLS) == ("", [])


def test_one_call():
    content, calls = parse_tool_calls(ONE_CALL, TOOLS)
    assert content == "I'll check the weather.\n"
    assert len(calls) == 1
    assert calls[0].name == "get_weather"
    assert args(calls[0]) == {"location": "San Francisco, CA", "unit": "c", "days": 3}
    assert re.fullmatch(r"call_[0-9a-f]{24}", calls[0].id)
    assert calls[0].to_openai() == {"id": calls[0].id, "type": "function", "function": {
        "name": "get_weather", "arguments": calls[0].arguments}}


def test_nested_objects_arrays_and_coercion():
    content, calls = parse_tool_calls(ORDER_CALL, TOOLS)
    assert content == ""
    assert summary(calls) == [("create_order", ORDER_ARGS)]
    assert isinstance(args(calls[0])["items"][0]["price"], float)


def test_several_invokes_and_blocks_with_text_around():
    content, calls = parse_tool_calls(SEVERAL, TOOLS)
    assert content == "Checking both cities.\nand then done."
    assert summary(calls) == [("get_weather", {"location": "Paris"}),
                              ("get_weather", {"location": "Rome", "days": 1}),
                              ("create_order", {"user_id": 7})]
    assert len({c.id for c in calls}) == 3


@pytest.mark.parametrize("schema, text, want", [
    ({"type": "integer"}, " -12\n", -12),
    ({"type": "integer"}, "twelve", "twelve"),  # unreadable: kept as text
    ({"type": "number"}, "2.5", 2.5),
    ({"type": "number"}, "2.0", 2),
    ({"type": "number"}, "1e3", 1000),
    ({"type": "number"}, "1e999", "1e999"),  # not finite: kept as text
    ({"type": "boolean"}, "True", True),
    ({"type": "boolean"}, "0", False),
    ({"type": "null"}, "null", None),
    ({"type": ["integer", "null"]}, "NULL", None),
    ({"type": ["integer", "string"]}, "12", 12),
    ({"type": ["integer", "string"]}, "12a", "12a"),
    ({"type": "string"}, " 42 ", " 42 "),  # strings are verbatim
    ({"type": "object"}, '{"a": [1, 2]}', {"a": [1, 2]}),
    ({"type": "array"}, "[1, 2]", [1, 2]),
    ({"type": "array"}, "", []),  # an empty list renders as an empty element
    ({"type": "object"}, "  ", {}),
    ({"enum": [1, 2]}, "2", 2),
    ({}, "free text", "free text"),
])
def test_scalar_coercion(schema, text, want):
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": schema}}}}
    _, calls = parse_tool_calls(f"{t('<tool_call>')}{invoke('f')}"
                                f"{t('<x>')}{text}{t('</x>')}{t('</invoke>')}{t('</tool_call>')}",
                                [tool])
    got = args(calls[0])["x"]
    assert got == want and type(got) is type(want)


def test_coerce_text_priority():
    assert coerce_text("1", {"boolean", "integer"}) == 1
    assert coerce_text("true", {"boolean", "integer"}) is True
    assert coerce_text("null", {"string", "null"}) is None
    assert coerce_text("[1]", {"object"}) == [1]  # not an object: the JSON fallback


def test_element_shapes():
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"o": {"type": "object", "properties": {
            "n": {"type": "integer"}}}, "list": {"type": "array", "items": {"type": "integer"}}}}}}
    body = (f"{t('<o>')}lead {t('<n>')}1{t('</n>')} tail{t('</o>')}"  # text mixed with children
            f"{t('<r>')}a{t('</r>')}{t('<r>')}b{t('</r>')}{t('<r>')}c{t('</r>')}"  # repeated names
            f"{t('<list>')}{t('<item>')}1{t('</item>')}{t('<item>')}2{t('</item>')}{t('</list>')}"
            f"{t('<m>')}{t('<$text>')}x{t('</$text>')}y{t('</m>')}")  # the field name is taken
    _, calls = parse_tool_calls(f"{t('<tool_call>')}{invoke('f')}{body}"
                                f"{t('</invoke>')}{t('</tool_call>')}", [tool])
    assert args(calls[0]) == {"o": {"n": 1, "$text": "lead  tail"}, "r": ["a", "b", "c"],
                              "list": [1, 2], "m": {"$text": "x", "$$text": "y"}}


def test_name_quoting_and_unknown_functions():
    text = (f"{t('<tool_call>')}{invoke('get_weather', "'")}{t('<days>')}2{t('</days>')}"
            f"{t('</invoke>')}{invoke('get_weather', '')}{t('</invoke>')}"
            f"{invoke('search_web')}{t('<limit>')}5{t('</limit>')}"
            f"{t('<opts>')}{t('<deep>')}true{t('</deep>')}{t('</opts>')}{t('</invoke>')}"
            f"{invoke('')}{t('</invoke>')}{t('</tool_call>')}")
    _, calls = parse_tool_calls(text, TOOLS)
    # unknown names are kept (as vLLM does) with unconverted values; empty names are dropped
    assert summary(calls) == [("get_weather", {"days": 2}), ("get_weather", {}),
                              ("search_web", {"limit": "5", "opts": {"deep": "true"}})]


@pytest.mark.parametrize("body, want", [
    (f"{t('<days>')}2{t('</days>')}{t('<location>')}Oslo{t('</loc>')}", {"days": 2}),  # mismatch
    (f"{t('<days>')}2{t('</days>')}{t('<location>')}Oslo", {"days": 2}),  # unterminated
    (f"{t('<days>')}2{t('</days>')}stray text{t('<location>')}Oslo{t('</location>')}",
     {"days": 2}),  # text between parameters ends them
    (f"{t('<location>')}a{t('[x]')}b{t('</location>')}{t('<days>')}1{t('</days>')}", {}),
    (f"{t('</days>')}{t('<days>')}1{t('</days>')}", {}),
])
def test_malformed_parameters_keep_earlier_ones(body, want):
    text = f"{t('<tool_call>')}{invoke('get_weather')}{body}{t('</invoke>')}"
    _, calls = parse_tool_calls(text, TOOLS)
    assert summary(calls) == [("get_weather", want)]


def test_nesting_is_bounded():
    deep = "".join(t(f"<l{i}>") for i in range(130)) + "x" + "".join(
        t(f"</l{i}>") for i in reversed(range(130)))
    ok = t("<o>") + t("<l>") + "x" + t("</l>") + t("</o>")
    _, calls = parse_tool_calls(f"{t('<tool_call>')}{invoke('f')}{ok}{deep}"
                                f"{t('</invoke>')}{t('</tool_call>')}", None)
    assert summary(calls) == [("f", {"o": {"l": "x"}})]
    fits = "".join(t(f"<l{i}>") for i in range(128)) + "x" + "".join(
        t(f"</l{i}>") for i in reversed(range(128)))
    _, calls = parse_tool_calls(f"{t('<tool_call>')}{invoke('f')}{fits}"
                                f"{t('</invoke>')}", None)
    assert len(json.dumps(args(calls[0]))) > 128 * 5


def test_unterminated_outputs():
    cut = ONE_CALL[:ONE_CALL.index(t("<days>")) + len(t("<days>")) + 1]  # max_tokens hit
    content, calls = parse_tool_calls(cut, TOOLS)
    assert content == "I'll check the weather.\n"
    assert summary(calls) == [("get_weather", {"location": "San Francisco, CA", "unit": "c"})]
    no_block_end = ONE_CALL[:ONE_CALL.index(t("</tool_call>"))]
    assert summary(parse_tool_calls(no_block_end, TOOLS)[1]) == [
        ("get_weather", {"location": "San Francisco, CA", "unit": "c", "days": 3})]
    cut_in_name = f"Hi{t('<tool_call>')}{t('<invoke name=\"get_wea')}"
    assert parse_tool_calls(cut_in_name, TOOLS) == ("Hi", [])


def test_text_inside_blocks_and_bare_invokes():
    text = (f"A{t('<tool_call>')} junk {invoke('get_weather')}{t('</invoke>')}"
            f" more junk {t('</tool_call>')}B{invoke('get_weather')}{t('</invoke>')}")
    content, calls = parse_tool_calls(text, TOOLS)
    assert content == "AB" + t('<invoke name="get_weather">') + t("</invoke>")
    assert summary(calls) == [("get_weather", {})]


def test_free_form_object_as_json_text_and_refs():
    text = (f"{t('<tool_call>')}{invoke('create_order')}"
            f"{t('<meta>')}{{\"source\": \"web\", \"n\": [1]}}{t('</meta>')}"
            f"{t('<ship>')}null{t('</ship>')}{t('</invoke>')}{t('</tool_call>')}")
    assert summary(parse_tool_calls(text, TOOLS)[1]) == [
        ("create_order", {"meta": {"source": "web", "n": [1]}, "ship": None})]


# ---- streaming --------------------------------------------------------------------------------

def run_stream(text: str, bounds) -> tuple[str, list, list]:
    s = ToolCallStream(TOOLS)
    events = []
    for a, b in zip(bounds, bounds[1:]):
        events += s.feed(text[a:b])
    events += s.finish()
    content = "".join(e.get("content", "") for e in events)
    deltas = [d for e in events for d in e.get("tool_calls", [])]
    return content, deltas, events


def test_stream_events():
    s = ToolCallStream(TOOLS)
    head = ONE_CALL[:ONE_CALL.index(t("</invoke>"))]
    first = "I'll check the weather.\n]<]mini"
    assert head.startswith(first)
    assert s.feed(first) == [{"content": "I'll check the weather.\n"}]  # a tag may follow
    assert s.feed(head[len(first):]) == []
    assert s.feed(t("</invoke")) == []  # the invoke is not complete yet
    (event,) = s.feed(">\n")
    (delta,) = event["tool_calls"]
    assert delta == {"index": 0, "id": s.calls[0].id, "type": "function", "function": {
        "name": "get_weather",
        "arguments": json.dumps({"location": "San Francisco, CA", "unit": "c", "days": 3})}}
    assert s.feed(t("</tool_call>") + "\nAnything else? ]<]") == [{"content": "\nAnything else? "}]
    assert s.finish() == [{"content": "]<]"}]  # not a tag after all


def test_stream_finish_emits_the_unterminated_invoke():
    s = ToolCallStream(TOOLS)
    cut = ORDER_CALL[:ORDER_CALL.index(t("<gift>"))]
    assert s.feed(cut) == []
    (event,) = s.finish()
    assert json.loads(event["tool_calls"][0]["function"]["arguments"]) == {
        "user_id": 42, "items": ORDER_ARGS["items"]}


RECORDED = [ONE_CALL, ORDER_CALL, SEVERAL, "plain answer with ]<]minimax[ and <tool_call> text",
            ONE_CALL[:ONE_CALL.index(t("<days>")) + 9]]


def expected(text):
    content, calls = parse_tool_calls(text, TOOLS)
    return content, [(c.name, c.arguments) for c in calls]


def stream_result(text, bounds):
    content, deltas, _ = run_stream(text, bounds)
    assert [d["index"] for d in deltas] == list(range(len(deltas)))
    return content, [(d["function"]["name"], d["function"]["arguments"]) for d in deltas]


@pytest.mark.parametrize("text", RECORDED)
def test_stream_split_at_every_position(text):
    want = expected(text)
    for cut in range(len(text) + 1):
        assert stream_result(text, [0, cut, len(text)]) == want, cut
    assert stream_result(text, list(range(len(text) + 1))) == want  # one character a chunk


@settings(max_examples=120, deadline=None)
@given(which=st.integers(0, len(RECORDED) - 1), cuts=st.lists(st.integers(0, 1500), max_size=12))
def test_stream_matches_whole_parse_for_random_chunkings(which, cuts):
    text = RECORDED[which]
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    assert stream_result(text, bounds) == expected(text)


def test_reasoning_then_tool_calls_pipeline():
    output = "The user wants weather; call the tool.</mm:think>" + ONE_CALL
    r = ReasoningStream(starts_in_reasoning=True)
    s = ToolCallStream(TOOLS)
    reasoning, events = "", []
    for i in range(0, len(output), 7):
        rd, cd = r.feed(output[i:i + 7])
        reasoning += rd
        events += s.feed(cd)
    rd, cd = r.finish()
    reasoning += rd
    events += s.feed(cd) + s.finish()
    assert reasoning == "The user wants weather; call the tool."
    assert "".join(e.get("content", "") for e in events) == "I'll check the weather.\n"
    assert [d["function"]["name"] for e in events for d in e.get("tool_calls", [])] == [
        "get_weather"]
