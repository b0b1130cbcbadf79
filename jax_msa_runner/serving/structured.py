"""Constrained decoding with llguidance: the engine's tokenizer as an ``LLTokenizer``, one
``LLMatcher`` per constrained request, and the step's token bitmasks.

``llg_tokenizer(tokenizer)`` describes every id of the model's vocabulary by its bytes:
``ByteTokenizer`` ids below 256 are their byte; a ``TextTokenizer``'s byte-level BPE pieces
map back through the GPT-2 byte alphabet, other pieces are their UTF-8; ids past the
tokenizer's own vocabulary, and a tokenizer without an end-of-sequence id, get special
placeholder entries (llguidance needs one end id; the engine ends a request whose matcher
has stopped). ``fill_masks`` writes the bitmask rows (``sampling``'s layout: bit ``v % 32``
of word ``v // 32`` set = allowed) of the rows that sample under a grammar.
"""
from __future__ import annotations

import functools
from typing import Sequence

import llguidance
import llguidance.numpy as llg_numpy
import numpy as np

from jax_msa_runner.serving.sampling import mask_words


@functools.lru_cache(maxsize=1)
def _gpt2_byte_decoder() -> dict[str, int]:
    """The inverse of GPT-2's bytes -> printable unicode map (byte-level BPE vocabularies)."""
    keep = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
            + list(range(ord("®"), ord("ÿ") + 1)))
    chars, n = list(keep), 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(keep, chars)}


def _piece_bytes(piece: str) -> bytes:
    table = _gpt2_byte_decoder()
    if all(ch in table for ch in piece):
        return bytes(table[ch] for ch in piece)
    return piece.encode("utf-8")


class _Vocabulary:
    """What ``llguidance.TokenizerWrapper`` reads: tokens (bytes per id), eos / bos ids,
    special ids, and ``__call__(text) -> ids``."""

    def __init__(self, tokenizer):
        v = tokenizer.vocab_size
        known = getattr(tokenizer, "known", None)
        self.tokens: list[bytes] = []
        self.special_token_ids: list[int] = []
        for i in range(v):
            if known is None and i < 256:  # the byte tokenizer
                self.tokens.append(bytes([i]))
                continue
            piece = tokenizer.id_to_token(i) if known is not None and i < known else None
            if piece is None:
                self.tokens.append(b"\xff" + f"<|{i}|>".encode())
                self.special_token_ids.append(i)
            else:
                self.tokens.append(_piece_bytes(piece))
        eos = tuple(tokenizer.eos_token_ids)
        self.eos_token_id = eos[0] if eos else v - 1
        if self.eos_token_id not in self.special_token_ids:
            self.special_token_ids.append(self.eos_token_id)
        self.bos_token_id = None
        self._encode = tokenizer.encode

    def __call__(self, text):
        return self._encode(text if isinstance(text, str) else text.decode("utf-8", "replace"))


def llg_tokenizer(tokenizer) -> llguidance.LLTokenizer:
    """An ``LLTokenizer`` over every id of ``tokenizer`` (``vocab_size`` entries)."""
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Vocabulary(tokenizer)))


def check_grammar(lltok: llguidance.LLTokenizer, grammar: str) -> None:
    """ValueError with llguidance's message when ``grammar`` does not compile."""
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, lltok)
    if is_error:
        raise ValueError("; ".join(m.strip() for m in messages) or "invalid grammar")


def new_matcher(lltok: llguidance.LLTokenizer, grammar: str) -> llguidance.LLMatcher:
    """A matcher at the start of ``grammar`` (ValueError if it does not compile)."""
    m = llguidance.LLMatcher(lltok, grammar)
    if m.is_error():
        raise ValueError(m.get_error())
    return m


def fill_masks(matchers: Sequence[tuple[int, llguidance.LLMatcher]], num_rows: int,
               vocab_size: int) -> np.ndarray:
    """int32 [num_rows, ceil(V / 32)]: all ones, except each (row, matcher)'s row: the tokens
    its matcher allows next."""
    words = mask_words(vocab_size)
    masks = np.full((num_rows, words), -1, np.int32)
    for row, m in matchers:
        shape = llg_numpy.get_bitmask_shape(1, m.vocab_size if hasattr(m, "vocab_size")
                                            else vocab_size)
        one = np.zeros(shape, np.int32)
        llg_numpy.fill_next_token_bitmask(m, one, 0)
        masks[row] = 0
        n = min(words, one.shape[1])
        masks[row, :n] = one[0, :n]
    return masks


__all__ = ["llg_tokenizer", "check_grammar", "new_matcher", "fill_masks"]
