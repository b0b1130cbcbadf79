"""The OpenAI API's request and response bodies: parsing with field-named errors, and the
JSON of completions, chat completions and their streamed chunks.

Errors are ``APIError``s whose ``body()`` is ``{"error": {"message", "type", "param",
"code"}}``. Requests are parsed by hand so every bad field is named: the model, the prompt
(a string or a list of token ids, or a batch of exactly one of either) or the messages,
the sampling fields, ``stream`` / ``stream_options``. Accepted beyond the OpenAI fields
(as vLLM does): ``top_k`` (0 or -1: off), ``min_p``, ``repetition_penalty``,
``stop_token_ids``, ``ignore_eos``, and ``return_token_ids`` (adds ``token_ids`` to each
choice or chunk). Completions' ``echo`` returns the prompt before the completion, with
``logprobs`` the prompt tokens' logprobs too (the first one null), computed in the prefill;
``max_tokens`` 0 is allowed with ``echo`` (the prompt alone: lm-eval's loglikelihood
request). Structured outputs (llguidance): ``response_format`` ``json_schema`` /
``json_object`` and vLLM's ``structured_outputs`` extra (``json``, ``regex``, ``choice``,
``grammar``) become a grammar that constrains every sampled token. Chat: ``tools`` are
rendered by the chat template and the model's M3 tool-call syntax comes back as
``tool_calls`` (``tool_choice`` ``auto``, ``none``, ``required`` or a named function, the last
two enforced by a grammar over that syntax); ``<mm:think>`` reasoning comes back as
``reasoning_content``; ``chat_template_kwargs`` reach the template. ``n`` (1 to ``MAX_N``) copies sample independently (copy ``i`` of a seeded
request uses seed ``seed + i``); ``logit_bias`` maps token ids (as strings) to biases in
[-100, 100], added on the device. Not supported, and rejected when set to anything but their
default: ``best_of`` other than 1, ``suffix``, functions. Unknown fields are ignored.
``/tokenize`` and ``/detokenize`` take vLLM's bodies (lm-eval's remote tokenizer uses them).
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any, Sequence

from jax_msa_runner.serving.engine import GenerationParams, TokenLogprob
from jax_msa_runner.serving.sampling import SamplingParams
from jax_msa_runner.serving.tokenizer_io import CHAT_ROLES, Tokenizer
from jax_msa_runner.serving.tool_grammar import (GrammarSpecError, structured_output_grammar,
                                                 tool_call_grammar)

COMPLETION_DEFAULT_MAX_TOKENS = 16  # the OpenAI default for /v1/completions
MAX_N = 16  # choices per request


class APIError(Exception):
    """An HTTP error with an OpenAI-style body."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (status, message, type,
                                                                       param, code)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def bad_request(param: str | None, message: str, code: str = "invalid_value") -> APIError:
    return APIError(400, f"{param}: {message}" if param else message, param=param, code=code)


def parse_json_object(raw: bytes) -> dict:
    """The request body as a JSON object, or a 400 naming the problem."""
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise bad_request(None, f"request body is not valid JSON: {e}", "invalid_json") from None
    if not isinstance(body, dict):
        raise bad_request(None, f"request body must be a JSON object, got {type(body).__name__}",
                          "invalid_json")
    return body


# ---- field readers ----------------------------------------------------------------------------

_MISSING = object()


def _number(body: dict, name: str, default):
    v = body.get(name, _MISSING)
    if v is _MISSING or v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise bad_request(name, f"must be a number, got {json.dumps(v)}", "invalid_type")
    return v


def _integer(body: dict, name: str, default):
    v = body.get(name, _MISSING)
    if v is _MISSING or v is None:
        return default
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int):
        raise bad_request(name, f"must be an integer, got {json.dumps(v)}", "invalid_type")
    return v


def _boolean(body: dict, name: str, default: bool) -> bool:
    v = body.get(name, _MISSING)
    if v is _MISSING or v is None:
        return default
    if not isinstance(v, bool):
        raise bad_request(name, f"must be true or false, got {json.dumps(v)}", "invalid_type")
    return v


def _reject_unsupported(body: dict, names: Sequence[str]) -> None:
    checks = {"best_of": lambda v: v == 1}
    # the others: any value but null is rejected
    for name in names:
        v = body.get(name)
        if v is None:
            continue
        ok = checks.get(name)
        if ok is None or not ok(v):
            raise bad_request(name, f"is not supported by this server (got {json.dumps(v)})",
                              "unsupported_parameter")


@dataclasses.dataclass
class ParsedRequest:
    """A validated request before tokenization.

    Exactly one of prompt_text / prompt_ids is set. max_tokens None: the default of the
    endpoint once the prompt length is known. ``generation``: the other GenerationParams
    fields (sampling, seed, stops, ignore_eos). ``fields`` maps generation-parameter names to
    the API field that set them (for error messages).
    """

    chat: bool
    prompt_text: str | None
    prompt_ids: list[int] | None
    max_tokens: int | None
    generation: dict[str, Any]
    stream: bool
    include_usage: bool
    return_token_ids: bool
    logprobs: int | None
    fields: dict[str, str]
    n: int = 1
    echo: bool = False
    tools: list | None = None  # chat: the tool definitions whose calls are parsed
    starts_in_reasoning: bool = False  # chat: the template opened the reasoning block

    @property
    def prompt_only(self) -> bool:
        """``echo`` with ``max_tokens`` 0: one token is generated and dropped."""
        return self.echo and self.max_tokens == 0

    def params(self, max_tokens: int) -> GenerationParams:
        prompt_lp = self.logprobs if self.echo else None
        return GenerationParams(max_tokens=max(max_tokens, 1) if self.echo else max_tokens,
                                logprobs=self.logprobs, prompt_logprobs=prompt_lp,
                                **self.generation)


def check_model(body: dict, model_name: str) -> None:
    model = body.get("model", _MISSING)
    if model is _MISSING or model is None:
        raise bad_request("model", "is required", "missing_required_parameter")
    if model != model_name:
        raise APIError(400, f"model: the model {json.dumps(model)} does not exist; this server "
                            f"serves {json.dumps(model_name)}", param="model",
                       code="model_not_found")


def _choices(body: dict) -> int:
    n = _integer(body, "n", 1)
    if not 1 <= n <= MAX_N:
        raise bad_request("n", f"must be in [1, {MAX_N}], got {n}")
    return n


def _logit_bias(body: dict) -> tuple[tuple[int, float], ...]:
    """``logit_bias`` as (token id, bias) pairs (ids and values are range-checked with the
    other sampling parameters)."""
    raw = body.get("logit_bias")
    if raw is None:
        return ()
    if not isinstance(raw, dict):
        raise bad_request("logit_bias", "must be an object mapping token ids to biases",
                          "invalid_type")
    pairs = []
    for key, value in raw.items():
        try:
            tok = int(key)
        except (TypeError, ValueError):
            raise bad_request("logit_bias", f"keys must be token ids, got {json.dumps(key)}",
                              "invalid_type") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad_request("logit_bias", f"bias of token {tok} must be a number, got "
                                            f"{json.dumps(value)}", "invalid_type")
        pairs.append((tok, float(value)))
    return tuple(pairs)


def _grammar_fields(body: dict) -> dict[str, Any]:
    """``grammar`` (and the field it came from) of the request's structured-output spec."""
    try:
        grammar = structured_output_grammar(body)
    except GrammarSpecError as e:
        raise bad_request(e.field, str(e).removeprefix(f"{e.field}: ")) from None
    if grammar is None:
        return {}
    field = "structured_outputs" if body.get("structured_outputs") is not None else \
        "response_format"
    return {"grammar": grammar, "grammar_field": field}


def _generation_fields(body: dict) -> dict[str, Any]:
    top_k = _integer(body, "top_k", 0)
    if top_k == -1:
        top_k = 0  # vLLM's "off"
    stop = body.get("stop")
    if stop is None:
        stop = ()
    elif isinstance(stop, str):
        stop = (stop,)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stop = tuple(stop)
    else:
        raise bad_request("stop", f"must be a string or a list of strings, got {json.dumps(stop)}",
                          "invalid_type")
    ids = body.get("stop_token_ids")
    if ids is None:
        ids = ()
    elif not isinstance(ids, list):
        raise bad_request("stop_token_ids", "must be a list of token ids", "invalid_type")
    sampling = SamplingParams(
        temperature=_number(body, "temperature", 1.0), top_k=top_k,
        top_p=_number(body, "top_p", 1.0), min_p=_number(body, "min_p", 0.0),
        presence_penalty=_number(body, "presence_penalty", 0.0),
        frequency_penalty=_number(body, "frequency_penalty", 0.0),
        repetition_penalty=_number(body, "repetition_penalty", 1.0),
        logit_bias=_logit_bias(body))
    return dict(sampling=sampling, seed=_integer(body, "seed", None), stop=stop,
                stop_token_ids=tuple(ids), ignore_eos=_boolean(body, "ignore_eos", False),
                **_grammar_fields(body))


def _stream_fields(body: dict) -> tuple[bool, bool]:
    stream = _boolean(body, "stream", False)
    opts = body.get("stream_options")
    if opts is None:
        return stream, False
    if not stream:
        raise bad_request("stream_options", "is only allowed when stream is true")
    if not isinstance(opts, dict):
        raise bad_request("stream_options", "must be an object", "invalid_type")
    return stream, _boolean(opts, "include_usage", False)


def _token_ids(value) -> list[int] | None:
    """value as a list of ints, or None when it is not one."""
    if isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool)
                                       for t in value):
        return list(value)
    return None


def parse_completion(body: dict, model_name: str) -> ParsedRequest:
    """/v1/completions: prompt (string, token ids, or a batch of one), max_tokens (16)."""
    check_model(body, model_name)
    _reject_unsupported(body, ("best_of", "suffix"))
    prompt = body.get("prompt", _MISSING)
    if prompt is _MISSING or prompt is None:
        raise bad_request("prompt", "is required", "missing_required_parameter")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    text = ids = None
    if isinstance(prompt, str):
        text = prompt
        if not text:
            raise bad_request("prompt", "must not be empty")
    elif isinstance(prompt, list):
        if not prompt:
            raise bad_request("prompt", "must not be empty")
        if all(isinstance(p, (str, list)) for p in prompt):
            raise bad_request("prompt", f"batches of {len(prompt)} prompts are not supported; "
                                        f"send one prompt per request", "unsupported_parameter")
        ids = _token_ids(prompt)
        if ids is None:
            raise bad_request("prompt", "a token-id prompt must be a list of integers",
                              "invalid_type")
    else:
        raise bad_request("prompt", f"must be a string or a list of token ids, got "
                                    f"{type(prompt).__name__}", "invalid_type")
    logprobs = _integer(body, "logprobs", None)
    stream, include_usage = _stream_fields(body)
    return ParsedRequest(chat=False, prompt_text=text, prompt_ids=ids,
                         max_tokens=_integer(body, "max_tokens", COMPLETION_DEFAULT_MAX_TOKENS),
                         generation=_generation_fields(body), stream=stream,
                         include_usage=include_usage,
                         return_token_ids=_boolean(body, "return_token_ids", False),
                         logprobs=logprobs, fields={"prompt": "prompt", "max_tokens": "max_tokens",
                                                    "logprobs": "logprobs"},
                         n=_choices(body), echo=_boolean(body, "echo", False))


def _message_text(msg: Any, i: int) -> tuple[str, str]:
    param = f"messages[{i}]"
    if not isinstance(msg, dict):
        raise bad_request(param, "must be an object with role and content", "invalid_type")
    role = msg.get("role")
    if role not in CHAT_ROLES:
        raise bad_request(f"{param}.role", f"must be one of {list(CHAT_ROLES)}, got "
                                           f"{json.dumps(role)}")
    content = msg.get("content")
    if isinstance(content, list):  # content parts: only text
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" \
                    or not isinstance(part.get("text"), str):
                raise bad_request(f"{param}.content[{j}]", "only text parts "
                                  '({"type": "text", "text": ...}) are supported', "invalid_type")
            texts.append(part["text"])
        content = "".join(texts)
    if content is None and role == "assistant":
        content = ""
    if not isinstance(content, str):
        raise bad_request(f"{param}.content", "must be a string or a list of text parts",
                          "invalid_type")
    return role, content


def _tools(body: dict) -> tuple[list | None, str]:
    """(the ``tools`` list or None, the tool choice: "none", "auto", "required" or
    "named"), each checked (400 naming the field)."""
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list) or not tools:
            raise bad_request("tools", "must be a non-empty list of tools", "invalid_type")
        for i, t in enumerate(tools):
            fn = t.get("function") if isinstance(t, dict) else None
            if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict) \
                    or not isinstance(fn.get("name"), str) or not fn["name"]:
                raise bad_request(f"tools[{i}]", 'must be {"type": "function", "function": '
                                                 '{"name": ..., "parameters": ...}}')
            params = fn.get("parameters", {})
            if not isinstance(params, dict):
                raise bad_request(f"tools[{i}].function.parameters", "must be a JSON schema "
                                                                      "object", "invalid_type")
    choice = body.get("tool_choice")
    if choice is None:
        return tools, "auto" if tools else "none"
    if choice in ("none", "auto", "required"):
        if choice != "none" and not tools:
            raise bad_request("tool_choice", f"{json.dumps(choice)} needs tools")
        return tools, choice
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(name, str):
        raise bad_request("tool_choice", 'must be "none", "auto", "required" or {"type": '
                                         '"function", "function": {"name": ...}}')
    known = [t["function"]["name"] for t in tools or []]
    if name not in known:
        raise bad_request("tool_choice", f"unknown tool {json.dumps(name)}; the tools are "
                                         f"{json.dumps(known)}")
    return tools, "named"


def parse_chat(body: dict, model_name: str, tokenizer: Tokenizer) -> ParsedRequest:
    """/v1/chat/completions: messages through the tokenizer's chat template; max_tokens (or
    max_completion_tokens) defaults to what max_model_len leaves after the prompt."""
    check_model(body, model_name)
    _reject_unsupported(body, ("functions", "function_call"))
    messages = body.get("messages", _MISSING)
    if messages is _MISSING or messages is None:
        raise bad_request("messages", "is required", "missing_required_parameter")
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages", "must be a non-empty list of messages")
    msgs = []
    for i, m in enumerate(messages):
        role, content = _message_text(m, i)
        msg = {"role": role, "content": content}
        for key in ("tool_calls", "tool_call_id", "name"):
            if m.get(key) is not None:
                msg[key] = m[key]
        msgs.append(msg)
    tools, choice = _tools(body)
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise bad_request("chat_template_kwargs", "must be an object", "invalid_type")
    try:
        text = tokenizer.apply_chat_template(msgs, tools=tools if choice != "none" else None,
                                             **kwargs)
    except (ValueError, TypeError) as e:
        raise bad_request("messages", f"cannot apply the chat template: {e}") from None
    generation = _generation_fields(body)
    if choice in ("required", "named"):
        if "grammar" in generation:
            raise bad_request("tool_choice", "a forced tool call cannot be combined with "
                                             "response_format or structured_outputs")
        try:
            generation.update(grammar=tool_call_grammar(
                tools, mode=choice, name=body["tool_choice"]["function"]["name"]
                if choice == "named" else None, allow_content_before=False),
                grammar_field="tool_choice")
        except GrammarSpecError as e:
            raise bad_request(e.field if e.field.startswith("tools") else "tool_choice",
                              str(e).removeprefix(f"{e.field}: ")) from None
    field = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _integer(body, field, None)
    want = _boolean(body, "logprobs", False)
    top = _integer(body, "top_logprobs", None)
    if top is not None and not want:
        raise bad_request("top_logprobs", "requires logprobs to be true")
    stream, include_usage = _stream_fields(body)
    thinking = kwargs.get("thinking_mode") == "enabled" or kwargs.get("enable_thinking") is True
    return ParsedRequest(chat=True, prompt_text=text, prompt_ids=None, max_tokens=max_tokens,
                         generation=generation, stream=stream,
                         include_usage=include_usage,
                         return_token_ids=_boolean(body, "return_token_ids", False),
                         logprobs=(top or 0) if want else None,
                         fields={"prompt": "messages", "max_tokens": field,
                                 "logprobs": "top_logprobs"}, n=_choices(body),
                         tools=tools if choice != "none" else None,
                         starts_in_reasoning=thinking)


def parse_tokenize(body: dict, model_name: str, tokenizer: Tokenizer) -> tuple[str, bool]:
    """/tokenize (vLLM's): ``prompt`` (a string) or ``messages`` (rendered as
    /v1/chat/completions renders them, ``tools`` and ``chat_template_kwargs`` included);
    ``model`` optional; ``add_special_tokens`` (default: true for a prompt, false for messages,
    whose template writes its own). Returns (text, add_special_tokens)."""
    if body.get("model") is not None:
        check_model(body, model_name)
    has_prompt, has_messages = body.get("prompt") is not None, body.get("messages") is not None
    if has_prompt == has_messages:
        raise bad_request("prompt", "exactly one of prompt and messages is required",
                          "missing_required_parameter")
    if has_messages:
        text = parse_chat({**body, "model": model_name}, model_name, tokenizer).prompt_text
    elif not isinstance(body["prompt"], str):
        raise bad_request("prompt", f"must be a string, got {type(body['prompt']).__name__}",
                          "invalid_type")
    else:
        text = body["prompt"]
    return text, _boolean(body, "add_special_tokens", not has_messages)


def parse_detokenize(body: dict, model_name: str, vocab_size: int) -> list[int]:
    """/detokenize (vLLM's): ``tokens``, a list of ids in [0, vocab_size); ``model`` optional."""
    if body.get("model") is not None:
        check_model(body, model_name)
    tokens = body.get("tokens", _MISSING)
    if tokens is _MISSING or tokens is None:
        raise bad_request("tokens", "is required", "missing_required_parameter")
    ids = _token_ids(tokens)
    if ids is None:
        raise bad_request("tokens", "must be a list of integer token ids", "invalid_type")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise bad_request("tokens", f"token id {bad[0]} is outside [0, vocab_size={vocab_size})")
    return ids


# ---- responses --------------------------------------------------------------------------------

def usage(num_prompt: int, num_output: int, num_cached: int = 0) -> dict:
    """The usage object; ``prompt_tokens_details.cached_tokens``: prompt tokens served from
    the prefix cache."""
    return {"prompt_tokens": num_prompt, "completion_tokens": num_output,
            "total_tokens": num_prompt + num_output,
            "prompt_tokens_details": {"cached_tokens": num_cached}}


def completion_logprobs(entries: Sequence[TokenLogprob], tokenizer: Tokenizer,
                        offsets: Sequence[int]) -> dict:
    """The legacy completions logprobs object (keys are ``tokenizer.token_str`` pieces;
    ``text_offset``: the output text's length when the token's step was delivered)."""
    return {"tokens": [tokenizer.token_str(e.token_id) for e in entries],
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{tokenizer.token_str(i): lp for i, lp in e.top} for e in entries],
            "text_offset": list(offsets)}


def echo_logprobs(prompt_ids: Sequence[int], prompt_entries: Sequence[TokenLogprob | None],
                  entries: Sequence[TokenLogprob], tokenizer: Tokenizer,
                  offsets: Sequence[int]) -> dict:
    """The completions logprobs object of an echoed request: the prompt's tokens (the first
    with null logprob and top) then the generated ones (``offsets``: their text offsets, in
    the output text after the prompt)."""
    prompt_offsets = [len(tokenizer.decode(list(prompt_ids[:i]))) for i in range(len(prompt_ids))]
    gen = completion_logprobs(entries, tokenizer, offsets)
    return {"tokens": [tokenizer.token_str(t) for t in prompt_ids] + gen["tokens"],
            "token_logprobs": [None if e is None else e.logprob for e in prompt_entries]
            + gen["token_logprobs"],
            "top_logprobs": [None if e is None else {tokenizer.token_str(i): lp for i, lp in e.top}
                             for e in prompt_entries] + gen["top_logprobs"],
            "text_offset": prompt_offsets + gen["text_offset"]}


def chat_logprobs(entries: Sequence[TokenLogprob], tokenizer: Tokenizer) -> dict:
    def item(i, lp):
        s = tokenizer.token_str(i)
        return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}

    return {"content": [{**item(e.token_id, e.logprob),
                         "top_logprobs": [item(i, lp) for i, lp in e.top]} for e in entries]}


def completion_choice(text: str, finish_reason: str | None, logprobs: dict | None,
                      token_ids: Sequence[int] | None, index: int = 0) -> dict:
    choice = {"index": index, "text": text, "logprobs": logprobs,
              "finish_reason": finish_reason}
    if token_ids is not None:
        choice["token_ids"] = list(token_ids)
    return choice


def chat_choice(text: str | None, finish_reason: str | None, logprobs: dict | None,
                token_ids: Sequence[int] | None, *, delta: bool, first: bool = False,
                index: int = 0, reasoning: str | None = None,
                tool_calls: list | None = None) -> dict:
    """A chat choice (``delta``: a stream chunk's). ``reasoning``: ``reasoning_content``;
    ``tool_calls``: OpenAI tool calls (deltas in a chunk)."""
    if delta:
        msg = {"role": "assistant", "content": text or ""} if first else (
            {"content": text} if text else {})
        if reasoning:
            msg["reasoning_content"] = reasoning
        if tool_calls:
            msg["tool_calls"] = tool_calls
        choice = {"index": index, "delta": msg}
    else:
        msg = {"role": "assistant", "content": text}
        if reasoning is not None:
            msg["reasoning_content"] = reasoning
        if tool_calls:
            msg["tool_calls"] = tool_calls
        choice = {"index": index, "message": msg}
    choice.update(logprobs=logprobs, finish_reason=finish_reason)
    if token_ids is not None:
        choice["token_ids"] = list(token_ids)
    return choice


def envelope(request_id: str, created: int, model: str, *, chat: bool, chunk: bool,
             choices: list, usage_body: dict | None) -> dict:
    obj = ("chat.completion.chunk" if chunk else "chat.completion") if chat else "text_completion"
    body = {"id": request_id, "object": obj, "created": created, "model": model,
            "choices": choices}
    if usage_body is not None:
        body["usage"] = usage_body
    return body
