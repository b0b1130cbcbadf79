"""Text in and out for a checkpoint folder that ships tokenizer files.

``load_tokenizer(folder)`` reads ``tokenizer.json`` with the ``tokenizers`` library, returns
None for a folder without tokenizer files, and raises ValueError for one with other
tokenizer files only. The
end-of-sequence ids come from ``generation_config.json``, else ``config.json`` (or its
``text_config``), else the tokenizer's ``eos_token`` in ``tokenizer_config.json``.
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Callable

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


@dataclasses.dataclass(frozen=True)
class TextTokenizer:
    """encode: str -> list[int]; decode: list[int] -> str (special tokens dropped)."""

    encode_fn: Callable[[str], list[int]]
    decode_fn: Callable[[list[int]], str]
    vocab_size: int
    eos_token_ids: tuple[int, ...]

    def encode(self, text: str) -> list[int]:
        return list(self.encode_fn(text))

    def decode(self, ids) -> str:
        return self.decode_fn([int(i) for i in ids])


def _read_json(path: str) -> dict[str, Any]:
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


def _ids(value) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(int(v) for v in value) if isinstance(value, (list, tuple)) else (int(value),)


def _eos_ids(folder: str, token_to_id: Callable[[str], int | None]) -> tuple[int, ...]:
    gen = _read_json(os.path.join(folder, "generation_config.json"))
    if _ids(gen.get("eos_token_id")):
        return _ids(gen["eos_token_id"])
    cfg = _read_json(os.path.join(folder, "config.json"))
    for c in (cfg, cfg.get("text_config") or {}):
        if _ids(c.get("eos_token_id")):
            return _ids(c["eos_token_id"])
    eos = _read_json(os.path.join(folder, "tokenizer_config.json")).get("eos_token")
    if isinstance(eos, dict):
        eos = eos.get("content")
    tid = token_to_id(eos) if isinstance(eos, str) else None
    return () if tid is None else (int(tid),)


def load_tokenizer(folder: str | os.PathLike) -> TextTokenizer | None:
    """The folder's tokenizer, or None when it has no tokenizer files."""
    folder = os.fspath(folder)
    path = os.path.join(folder, "tokenizer.json")
    if os.path.exists(path):
        from tokenizers import Tokenizer
        tok = Tokenizer.from_file(path)
        return TextTokenizer(
            encode_fn=lambda text: tok.encode(text).ids,
            decode_fn=lambda ids: tok.decode(ids, skip_special_tokens=True),
            vocab_size=tok.get_vocab_size(with_added_tokens=True),
            eos_token_ids=_eos_ids(folder, tok.token_to_id))
    present = [n for n in TOKENIZER_FILES if os.path.exists(os.path.join(folder, n))]
    if not present:
        return None
    raise ValueError(f"{folder}: has tokenizer files {present} but no tokenizer.json (the "
                     f"'tokenizers' format this runner reads)")


__all__ = ["TextTokenizer", "load_tokenizer"]
