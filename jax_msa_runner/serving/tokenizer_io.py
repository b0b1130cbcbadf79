"""Text in and out of the engine: the tokenizer interface, the byte tokenizer of the tiny
model, and the incremental text of a generated token stream (with stop strings).

``Tokenizer`` is what the server needs of a tokenizer: ``encode(str) -> ids``,
``decode(ids) -> str`` (for every id below ``vocab_size``, which equals the model's),
``token_str(id)`` (a printable piece, distinct for every id: the keys of top logprobs),
``apply_chat_template(messages) -> str`` (raises ``ValueError`` where there is
none), ``vocab_size`` and ``eos_token_ids`` (ids that end a generation; may be empty). A
checkpoint's own tokenizer plugs into the same interface.

``ByteTokenizer`` (the tiny model's): ids 0..255 are the bytes of the UTF-8 text; ids
256..vocab_size-1 never come out of ``encode`` and decode to the placeholder ``<|id|>``.
Runs of byte ids decode as UTF-8 with invalid or incomplete sequences replaced by U+FFFD.
``token_str``: printable ASCII and tab / newline / carriage return as themselves, other
bytes as ``<0xNN>``, higher ids as ``<|id|>``. Its chat template: every message as
``<|role|>\\n{content}\\n``, then ``<|assistant|>\\n`` (the generation prompt).

``TextStream`` turns generated ids into text as they arrive: a token's text is released once
the text decoded so far does not end in U+FFFD (an unfinished multi-byte character may
still complete), so the concatenated deltas equal ``decode`` of all ids; with stop strings
it holds back the last ``len(longest stop) - 1`` characters, and the first stop string found
cuts the text where it begins (the stop string itself is not part of the output).
"""
from __future__ import annotations

import json
from typing import Mapping, Protocol, Sequence

NUM_BYTES = 256
REPLACEMENT = "\ufffd"
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


class Tokenizer(Protocol):
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    special_tokens: tuple[tuple[str, str], ...]  # (name, text), e.g. ("eos_token", "</s>")

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def token_str(self, token_id: int) -> str: ...

    def apply_chat_template(self, messages: Sequence[Mapping], tools=None, **kwargs) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255; ids up to ``vocab_size - 1`` decode to ``<|id|>``."""

    eos_token_ids = ()  # no end-of-sequence token: generations end at max_tokens or a stop
    special_tokens = ()

    def __init__(self, vocab_size: int):
        if vocab_size < NUM_BYTES:
            raise ValueError(f"vocab_size: must be >= {NUM_BYTES} for the byte tokenizer, "
                             f"got {vocab_size}")
        self.vocab_size = int(vocab_size)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode("utf-8"))  # no special tokens to add

    def _check(self, token_id: int) -> int:
        if not 0 <= token_id < self.vocab_size:
            raise ValueError(f"token id {token_id}: must be in [0, vocab_size={self.vocab_size})")
        return int(token_id)

    def decode(self, ids: Sequence[int]) -> str:
        parts, run = [], bytearray()
        for t in ids:
            t = self._check(t)
            if t < NUM_BYTES:
                run.append(t)
                continue
            if run:
                parts.append(run.decode("utf-8", errors="replace"))
                run = bytearray()
            parts.append(f"<|{t}|>")
        if run:
            parts.append(run.decode("utf-8", errors="replace"))
        return "".join(parts)

    def token_str(self, token_id: int) -> str:
        t = self._check(token_id)
        if t >= NUM_BYTES:
            return f"<|{t}|>"
        if 0x20 <= t < 0x7F or t in (0x09, 0x0A, 0x0D):
            return chr(t)
        return f"<0x{t:02X}>"

    def apply_chat_template(self, messages: Sequence[Mapping], tools=None, **kwargs) -> str:
        """``<|tools|>\\n{tools as JSON}\\n`` when there are tools, ``<|role|>\\n{content}\\n``
        per message (an assistant's tool calls as JSON after its content), then
        ``<|assistant|>\\n``; ``kwargs`` are ignored."""
        head = f"<|tools|>\n{json.dumps(tools)}\n" if tools else ""
        body = "".join(f"<|{m['role']}|>\n{m.get('content') or ''}"
                       f"{json.dumps(m['tool_calls']) if m.get('tool_calls') else ''}\n"
                       for m in messages)
        return head + body + "<|assistant|>\n"


class TextStream:
    """The output text of one request, built token by token.

    ``push(id, visible)`` adds a generated token (``visible=False``: it counts but adds no
    text, e.g. a stop token); it returns True when a stop string completed. ``take(final)``
    returns the text released since the last call (everything when ``final``).
    ``text`` is the output so far (cut at the stop string once one matched).
    """

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] = ()):
        if any(not s for s in stop):
            raise ValueError("stop: stop strings must not be empty")
        self._tok = tokenizer
        self._stop = tuple(stop)
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self._ids: list[int] = []
        self._prefix = 0  # ids[_prefix:_read] decode to the last released window
        self._read = 0
        self._text = ""  # decoded and stable
        self._sent = 0  # characters handed out by take()
        self.stopped = False

    @property
    def text(self) -> str:
        return self._text

    def push(self, token_id: int, visible: bool = True) -> bool:
        if self.stopped:
            raise RuntimeError("TextStream.push after a stop string matched")
        if not visible:
            return False
        self._ids.append(int(token_id))
        window = self._tok.decode(self._ids[self._prefix:self._read])
        full = self._tok.decode(self._ids[self._prefix:])
        if len(full) <= len(window) or full.endswith(REPLACEMENT):
            return False  # wait: an unfinished character may still complete
        start = max(0, len(self._text) - self._hold)
        self._text += full[len(window):]
        self._prefix, self._read = self._read, len(self._ids)
        return self._find_stop(start)

    def _find_stop(self, start: int) -> bool:
        hits = [i for i in (self._text.find(s, start) for s in self._stop) if i >= 0]
        if hits:
            self._text = self._text[:min(hits)]
            self.stopped = True
        return self.stopped

    def finish(self) -> None:
        """End of generation: releases what waited for more bytes (may still hit a stop)."""
        if self.stopped:
            return
        rest = self._tok.decode(self._ids[self._prefix:])
        window = self._tok.decode(self._ids[self._prefix:self._read])
        start = max(0, len(self._text) - self._hold)
        self._text += rest[len(window):]
        self._prefix = self._read = len(self._ids)
        self._find_stop(start)

    def take(self, final: bool = False) -> str:
        end = len(self._text) if final or self.stopped else max(self._sent,
                                                                len(self._text) - self._hold)
        delta = self._text[self._sent:end]
        self._sent = end
        return delta
