"""Text in and out for a checkpoint folder that ships tokenizer files.

``load_tokenizer(folder)`` reads ``tokenizer.json`` with the ``tokenizers`` library, returns
None for a folder without tokenizer files, and raises ValueError for one with other
tokenizer files only. The result has the interface of ``serving.tokenizer_io.Tokenizer``
(``encode``, ``decode``, ``token_str``, ``apply_chat_template``, ``vocab_size``,
``eos_token_ids``). ``apply_chat_template`` renders the folder's Jinja chat template
(``chat_template`` in ``tokenizer_config.json``, or ``chat_template.jinja``) in a sandbox, with
the generation prompt added; without one it raises ValueError. The end-of-sequence ids come
from ``generation_config.json``, else ``config.json`` (or its
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
    """encode: str -> list[int]; decode: ids below ``vocab_size`` -> str (special tokens
    dropped); token_str: id -> its vocabulary entry (distinct per id).

    ``vocab_size`` is the model's: ids from ``known`` (the tokenizer's own vocabulary size)
    up to it (a model vocabulary padded past the tokenizer's) decode to ``<|id|>``.
    """

    encode_fn: Callable[[str, bool], list[int]]  # (text, add_special_tokens) -> ids
    decode_fn: Callable[[list[int]], str]
    id_to_token: Callable[[int], str | None]
    known: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    chat_template: str | None = None  # Jinja source, None: the folder has none
    special_tokens: tuple[tuple[str, str], ...] = ()  # (name, text), e.g. ("bos_token", "<s>")

    def _check(self, token_id: int) -> int:
        if not 0 <= int(token_id) < self.vocab_size:
            raise ValueError(f"token id {token_id}: must be in [0, vocab_size={self.vocab_size})")
        return int(token_id)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.encode_fn(text, add_special_tokens))

    def decode(self, ids) -> str:
        parts, run = [], []
        for t in (self._check(i) for i in ids):
            if t < self.known:
                run.append(t)
                continue
            if run:
                parts.append(self.decode_fn(run))
                run = []
            parts.append(f"<|{t}|>")
        if run:
            parts.append(self.decode_fn(run))
        return "".join(parts)

    def token_str(self, token_id: int) -> str:
        t = self._check(token_id)
        piece = self.id_to_token(t) if t < self.known else None
        return f"<|{t}|>" if piece is None else piece

    def apply_chat_template(self, messages, tools=None, **kwargs) -> str:
        """The prompt text of ``messages`` (dicts with role and content, and an assistant's
        ``tool_calls`` / a tool message's ``tool_call_id``), ending with the template's
        generation prompt; ``tools`` (OpenAI tool definitions) and ``kwargs`` (the request's
        ``chat_template_kwargs``, e.g. the thinking switch) are template variables.
        ValueError without a template or when it raises."""
        if self.chat_template is None:
            raise ValueError("this checkpoint has no chat template (chat_template in "
                             "tokenizer_config.json or chat_template.jinja)")
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise ValueError(f"the chat template refused the messages: {message}")

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        try:
            return env.from_string(self.chat_template).render(
                **kwargs, messages=list(messages), tools=tools, add_generation_prompt=True,
                **dict(self.special_tokens))
        except TemplateError as e:
            raise ValueError(f"the chat template failed: {e}") from None


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


def _chat_template(folder: str, config: dict[str, Any]) -> str | None:
    """The folder's Jinja chat template: tokenizer_config's ``chat_template`` (a string, or
    a list of {name, template} of which "default" is taken), else ``chat_template.jinja``."""
    tpl = config.get("chat_template")
    if isinstance(tpl, list):
        tpl = next((t.get("template") for t in tpl if t.get("name") == "default"), None)
    path = os.path.join(folder, "chat_template.jinja")
    if tpl is None and os.path.exists(path):
        with open(path) as f:
            tpl = f.read()
    return tpl if isinstance(tpl, str) else None


def _special_tokens(config: dict[str, Any]) -> tuple[tuple[str, str], ...]:
    """(name, text) of tokenizer_config's bos/eos/pad/unk tokens (strings or {content})."""
    out = []
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        value = config.get(name)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            out.append((name, value))
    return tuple(out)


def load_tokenizer(folder: str | os.PathLike, vocab_size: int | None = None
                   ) -> TextTokenizer | None:
    """The folder's tokenizer, or None when it has no tokenizer files.

    vocab_size: the model's vocabulary (default: the tokenizer's); ValueError when the
    tokenizer's own vocabulary is larger (it could produce ids the model has no row for).
    """
    folder = os.fspath(folder)
    path = os.path.join(folder, "tokenizer.json")
    if os.path.exists(path):
        from tokenizers import Tokenizer
        tok = Tokenizer.from_file(path)
        config = _read_json(os.path.join(folder, "tokenizer_config.json"))
        known = tok.get_vocab_size(with_added_tokens=True)
        if vocab_size is not None and known > vocab_size:
            raise ValueError(f"{path}: {known} tokens, more than the model's vocab_size="
                             f"{vocab_size}")
        return TextTokenizer(
            encode_fn=lambda text, special: tok.encode(text, add_special_tokens=special).ids,
            decode_fn=lambda ids: tok.decode(ids, skip_special_tokens=True),
            id_to_token=tok.id_to_token, known=known,
            vocab_size=known if vocab_size is None else int(vocab_size),
            eos_token_ids=_eos_ids(folder, tok.token_to_id),
            chat_template=_chat_template(folder, config), special_tokens=_special_tokens(config))
    present = [n for n in TOKENIZER_FILES if os.path.exists(os.path.join(folder, n))]
    if not present:
        return None
    raise ValueError(f"{folder}: has tokenizer files {present} but no tokenizer.json (the "
                     f"'tokenizers' format this runner reads)")


__all__ = ["TextTokenizer", "load_tokenizer"]
