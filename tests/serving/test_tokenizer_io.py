"""Byte tokenizer and the incremental output text: deltas add up to decode(ids), stop
strings cut at their first occurrence, multi-byte characters are never split."""
import pytest
from hypothesis import given
from hypothesis import strategies as st

from jax_msa_runner.serving.tokenizer_io import ByteTokenizer, TextStream

TOK = ByteTokenizer(512)


def test_byte_tokenizer_roundtrip_placeholders_and_pieces():
    text = "héllo, wörld € 😀\n"
    ids = TOK.encode(text)
    assert all(0 <= i < 256 for i in ids) and TOK.decode(ids) == text
    assert TOK.decode([72, 300, 105, 0xE2, 511]) == "H<|300|>i\ufffd<|511|>"
    pieces = [TOK.token_str(i) for i in range(512)]
    assert len(set(pieces)) == 512  # distinct: usable as top-logprob keys
    assert TOK.token_str(65) == "A" and TOK.token_str(0xE2) == "<0xE2>" and TOK.token_str(10) == "\n"
    with pytest.raises(ValueError, match="token id 512: must be in \\[0, vocab_size=512\\)"):
        TOK.decode([512])
    with pytest.raises(ValueError, match="vocab_size: must be >= 256"):
        ByteTokenizer(100)
    chat = TOK.apply_chat_template([{"role": "system", "content": "be brief"},
                                    {"role": "user", "content": "hi"}])
    assert chat == "<|system|>\nbe brief\n<|user|>\nhi\n<|assistant|>\n"


def _stream(ids, stop=(), take_every=1):
    ts = TextStream(TOK, stop)
    out = []
    for n, t in enumerate(ids):
        if ts.push(t):
            break
        if n % take_every == 0:
            out.append(ts.take())
    ts.finish()
    out.append(ts.take(final=True))
    return "".join(out), ts


ids_strategy = st.lists(st.one_of(st.integers(0, 511), st.integers(0x80, 0xF4),
                                  st.integers(0x20, 0x7E)), max_size=60)


@given(ids=ids_strategy, every=st.integers(1, 4))
def test_deltas_add_up_to_decode(ids, every):
    text, ts = _stream(ids, take_every=every)
    assert text == TOK.decode(ids) == ts.text


@given(ids=ids_strategy, stop_at=st.integers(0, 59), stop_len=st.integers(1, 6))
def test_stop_string_cuts_at_first_occurrence(ids, stop_at, stop_len):
    full = TOK.decode(ids)
    stop = full[stop_at:stop_at + stop_len] or "never-in-output-§"
    text, ts = _stream(ids, stop=(stop,))
    i = full.find(stop)
    assert text == (full[:i] if i >= 0 else full) == ts.text
    assert ts.stopped == (i >= 0)


def test_multibyte_characters_are_released_whole():
    ts = TextStream(TOK)
    euro = TOK.encode("€")  # 3 bytes
    assert [ts.push(t) or ts.take() for t in euro] == ["", "", "€"]
    ts.push(TOK.encode("a")[0])
    assert ts.take() == "a"


def test_stop_text_is_held_back_until_it_cannot_start_a_stop():
    ts = TextStream(TOK, stop=("STOP",))
    deltas = []
    for t in TOK.encode("abcST"):
        ts.push(t)
        deltas.append(ts.take())
    assert "".join(deltas) == "ab"  # "cST" could still become "STOP" ... and "cST" holds 3 chars
    for t in TOK.encode("OPxyz"):
        if ts.push(t):
            break
    assert ts.stopped and ts.take() == "c" and ts.text == "abc"
