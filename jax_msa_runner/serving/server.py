"""The HTTP server: FastAPI routes over an ``Engine`` (OpenAI-compatible).

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (JSON, or server-sent
events with ``"stream": true``: one ``data:`` line per chunk, ``data: [DONE]`` last),
``GET /v1/models``, ``GET /health`` (503 once the engine thread has died), ``GET /metrics``
(Prometheus text), and vLLM's tokenizer routes: ``POST /tokenize`` (a prompt or chat
messages -> ``tokens``, ``count``, ``max_model_len``), ``POST /detokenize`` (``tokens`` ->
``prompt``), ``GET /tokenizer_info`` (the special tokens, ``vocab_size``,
``model_max_length``), which lm-eval's ``local-completions`` model tokenizes with. A bad
request gets a 400 with an OpenAI-style error body naming the field; a full queue a 503. A
client that disconnects (mid-stream, or while waiting for a non-streamed answer) has its
request aborted, which frees its KV pages.

``ServerThread`` runs uvicorn on an already bound socket in a background thread (tests,
benchmarks); ``jax-msa-runner serve`` runs it in the foreground.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import socket
import threading
import time
import uuid

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from jax_msa_runner.serving.engine import (Engine, EngineDeadError, QueueFullError,
                                           RequestStream)
from jax_msa_runner.serving.openai_protocol import (APIError, ParsedRequest, bad_request,
                                                    chat_choice, chat_logprobs, completion_choice,
                                                    echo_logprobs,
                                                    completion_logprobs, envelope, parse_chat,
                                                    parse_completion, parse_detokenize,
                                                    parse_json_object, parse_tokenize, usage)
from jax_msa_runner.serving.m3_output import (ReasoningStream, ToolCallStream,
                                              parse_tool_calls, split_reasoning)
from jax_msa_runner.serving.sampling import SamplingParamError
from jax_msa_runner.serving.scheduler import RequestRejectedError


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


async def _until_disconnect(request: Request) -> None:
    """Returns when the client has gone (the request body is already read, so the server's
    next message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        await asyncio.sleep(0.1)  # not expected; never spin


def build_app(engine: Engine, *, model_name: str) -> FastAPI:
    """The FastAPI app serving ``engine`` under the model name ``model_name``."""
    app = FastAPI(title="jax-msa-runner", docs_url=None, redoc_url=None)
    created = int(time.time())
    tokenizer = engine.tokenizer
    max_model_len = engine.scheduler.config.max_model_len
    metrics = engine.metrics

    @app.exception_handler(APIError)
    async def api_error(_: Request, e: APIError):
        outcome = "overloaded" if e.status == 503 else "rejected" if e.status < 500 else None
        if outcome:
            metrics.requests.labels(outcome=outcome).inc()
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(Exception)
    async def internal_error(_: Request, e: Exception):
        metrics.requests.labels(outcome="error").inc()
        return JSONResponse(APIError(500, f"internal error: {e!r}", type="server_error",
                                     code="internal_error").body(), status_code=500)

    @app.get("/health")
    async def health():
        if not engine.alive:
            raise APIError(503, f"engine is not running: {engine.error!r}", type="server_error",
                           code="engine_unavailable")
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "jax-msa-runner",
                                            "max_model_len": max_model_len}]}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/tokenize")
    async def tokenize(request: Request):
        text, special = parse_tokenize(parse_json_object(await request.body()), model_name,
                                       tokenizer)
        ids = await asyncio.to_thread(tokenizer.encode, text, add_special_tokens=special)
        return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        ids = parse_detokenize(parse_json_object(await request.body()), model_name,
                               tokenizer.vocab_size)
        return {"prompt": await asyncio.to_thread(tokenizer.decode, ids)}

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        special = dict(tokenizer.special_tokens)
        return {"tokenizer_class": type(tokenizer).__name__, "vocab_size": tokenizer.vocab_size,
                "model_max_length": max_model_len, "eos_token": special.get("eos_token"),
                "bos_token": special.get("bos_token"), "pad_token": special.get("pad_token")}

    async def submit(parsed: ParsedRequest) -> tuple[list[RequestStream], list[int]]:
        """The request's ``n`` copies in the engine (copy i of a seeded request: seed + i),
        and the prompt's ids; all or none: a copy the engine refuses aborts the ones already
        queued."""
        ids = parsed.prompt_ids
        if ids is None:
            ids = await asyncio.to_thread(tokenizer.encode, parsed.prompt_text)
        max_tokens = parsed.max_tokens
        if max_tokens is None:
            max_tokens = max(1, max_model_len - len(ids))
        params = parsed.params(max_tokens)
        streams: list[RequestStream] = []
        try:
            for i in range(parsed.n):
                seed = None if params.seed is None else params.seed + i
                streams.append(engine.submit(ids, dataclasses.replace(params, seed=seed)))
        except (SamplingParamError, RequestRejectedError) as e:
            _abort_all(engine, streams)
            field = {"max_new_tokens": "max_tokens"}.get(e.field, e.field)
            param = parsed.fields.get(field, field)
            msg = str(e).removeprefix(f"{e.field}: ").replace("max_new_tokens", param)
            raise bad_request(param, msg) from None
        except QueueFullError as e:
            _abort_all(engine, streams)
            raise APIError(503, f"server overloaded: {e}; retry later", type="server_error",
                           code="queue_full") from None
        except EngineDeadError as e:
            _abort_all(engine, streams)
            raise APIError(503, str(e), type="server_error", code="engine_unavailable") from None
        return streams, ids

    async def generate(request: Request, chat: bool):
        body = parse_json_object(await request.body())
        parsed = parse_chat(body, model_name, tokenizer) if chat else parse_completion(body,
                                                                                       model_name)
        streams, ids = await submit(parsed)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        echo = _Echo(parsed, ids, tokenizer) if parsed.echo else None
        if parsed.stream:
            return _EventStream(_stream_events(engine, streams, parsed, rid, created_now(),
                                               model_name, echo), engine, streams)
        collect = asyncio.ensure_future(_collect(streams, parsed, rid, created_now(),
                                                 model_name, tokenizer, echo))
        gone = asyncio.ensure_future(_until_disconnect(request))
        try:
            await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not collect.done():
                collect.cancel()
                _abort_all(engine, streams)
        if not collect.done() or collect.cancelled():
            return Response(status_code=499)  # the client is gone; nobody reads this
        return JSONResponse(collect.result())

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await generate(request, chat=True)

    return app


def created_now() -> int:
    return int(time.time())


def _abort_all(engine: Engine, streams) -> None:
    for stream in streams:
        if not stream.finished:
            engine.abort(stream.request_id)


class _Echo:
    """An echoed completion's prompt: its ids, text and (with logprobs) the logprobs object
    of prompt and output; ``prompt_only`` drops the one generated token."""

    def __init__(self, parsed: ParsedRequest, ids: list[int], tokenizer):
        self.ids, self.tokenizer = ids, tokenizer
        self.text = parsed.prompt_text if parsed.prompt_text is not None else tokenizer.decode(ids)
        self.prompt_only = parsed.prompt_only
        self.want_logprobs = parsed.logprobs is not None

    def logprobs(self, prompt_entries, entries, offsets) -> dict | None:
        if not self.want_logprobs:
            return None
        if self.prompt_only:
            entries, offsets = [], []
        shift = len(self.text)
        return echo_logprobs(self.ids, prompt_entries, entries, self.tokenizer,
                             [shift + o for o in offsets])


async def _collect_one(stream: RequestStream, parsed: ParsedRequest, index: int,
                       tokenizer, echo: _Echo | None) -> tuple[dict, int, int]:
    """One copy's choice, its output token count and its cached prompt tokens (waits for
    it to finish)."""
    text, ids, entries, offsets = [], [], [], []
    length = 0
    reason, n_out, prompt_entries, cached = None, 0, None, 0
    try:
        async for ev in stream:
            if ev.prompt_logprobs is not None:
                prompt_entries = ev.prompt_logprobs
            if ev.logprobs is not None:
                entries.extend(ev.logprobs)
                offsets.extend([length] * len(ev.logprobs))
            text.append(ev.text)
            length += len(ev.text)
            ids.extend(ev.token_ids)
            reason, n_out, cached = ev.finish_reason, ev.num_output_tokens, ev.num_cached_tokens
    except EngineDeadError as e:
        raise APIError(503, str(e), type="server_error", code="engine_unavailable") from None
    out = "".join(text)
    if echo is not None and echo.prompt_only:
        out, ids, n_out = "", [], 0
    token_ids = ids if parsed.return_token_ids else None
    if parsed.chat:
        lp = chat_logprobs(entries, tokenizer) if parsed.logprobs is not None else None
        reasoning, content = split_reasoning(out, starts_in_reasoning=parsed.starts_in_reasoning)
        calls = []
        if parsed.tools:
            content, found = parse_tool_calls(content, parsed.tools)
            calls = [c.to_openai() for c in found]
            if calls and reason == "stop":
                reason = "tool_calls"
            if calls and not content.strip():
                content = None
        return chat_choice(content, reason, lp, token_ids, delta=False, index=index,
                           reasoning=reasoning, tool_calls=calls), n_out, cached
    if echo is not None:
        return completion_choice(echo.text + out, reason,
                                 echo.logprobs(prompt_entries, entries, offsets), token_ids,
                                 index=index), n_out, cached
    lp = completion_logprobs(entries, tokenizer, offsets) if parsed.logprobs is not None else None
    return completion_choice(out, reason, lp, token_ids, index=index), n_out, cached


async def _collect(streams: list[RequestStream], parsed: ParsedRequest, rid: str, created: int,
                   model: str, tokenizer, echo: _Echo | None = None) -> dict:
    """The non-streamed response body of a request: its copies' choices in index order;
    usage counts the prompt once (its cached tokens: copy 0's) and every copy's output."""
    done = await asyncio.gather(*(_collect_one(s, parsed, i, tokenizer, echo)
                                  for i, s in enumerate(streams)))
    return envelope(rid, created, model, chat=parsed.chat, chunk=False,
                    choices=[c for c, _, _ in done],
                    usage_body=usage(streams[0].num_prompt_tokens, sum(n for _, n, _ in done),
                                     done[0][2]))


async def _merged(streams: list[RequestStream]):
    """(copy index, RequestOutput) of every copy as they arrive; an EngineDeadError ends it."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i, stream):
        try:
            async for ev in stream:
                await queue.put((i, ev))
        except EngineDeadError as e:
            await queue.put((i, e))
        await queue.put((i, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(streams)
        while left:
            i, ev = await queue.get()
            if ev is None:
                left -= 1
            elif isinstance(ev, BaseException):
                raise ev
            else:
                yield i, ev
    finally:
        for t in tasks:
            t.cancel()


async def _stream_events(engine: Engine, streams: list[RequestStream], parsed: ParsedRequest,
                         rid: str, created: int, model: str, echo: _Echo | None = None):
    """Server-sent events of one request's copies (``_EventStream`` aborts them if they stop
    early). An echoed completion's first chunk per copy carries the prompt (and its
    logprobs); with ``max_tokens`` 0 nothing else but the finish."""
    tok = engine.tokenizer
    chat = parsed.chat
    length = [0] * len(streams)
    n_out = [0] * len(streams)
    cached = [0] * len(streams)
    echoed: set[int] = set()
    reasoning = [ReasoningStream(starts_in_reasoning=parsed.starts_in_reasoning)
                 for _ in streams]
    calls = [ToolCallStream(parsed.tools) if parsed.tools else None for _ in streams]

    def chat_deltas(i, text, final):
        """(reasoning delta, content delta, tool-call deltas) of copy i's new text."""
        r, c = reasoning[i].feed(text)
        if final:
            r2, c2 = reasoning[i].finish()
            r, c = r + r2, c + c2
        if calls[i] is None:
            return r, c, []
        events = calls[i].feed(c) + (calls[i].finish() if final else [])
        content = "".join(e.get("content", "") for e in events)
        return r, content, [d for e in events for d in e.get("tool_calls", [])]

    def chunk(choice, usage_body=None):
        return _sse(envelope(rid, created, model, chat=chat, chunk=True,
                             choices=[] if choice is None else [choice], usage_body=usage_body))

    try:
        if chat:
            for i in range(len(streams)):
                yield chunk(chat_choice("", None, None, [] if parsed.return_token_ids else None,
                                        delta=True, first=True, index=i))
        async for i, ev in _merged(streams):
            if echo is not None and i not in echoed:  # a copy's first output
                echoed.add(i)
                lp = echo.logprobs(ev.prompt_logprobs, [], []) if echo.want_logprobs else None
                yield chunk(completion_choice(echo.text, None, lp, None, index=i))
                length[i] += len(echo.text)
            cached[i] = ev.num_cached_tokens
            if echo is not None and echo.prompt_only:
                if ev.finish_reason is not None:
                    yield chunk(completion_choice("", ev.finish_reason, None,
                                                  [] if parsed.return_token_ids else None,
                                                  index=i))
                continue
            n_out[i] = ev.num_output_tokens
            if not ev.text and ev.finish_reason is None and not parsed.return_token_ids \
                    and parsed.logprobs is None:
                continue
            ids = ev.token_ids if parsed.return_token_ids else None
            if chat:
                lp = chat_logprobs(ev.logprobs, tok) if ev.logprobs is not None else None
                r, c, deltas = chat_deltas(i, ev.text, ev.finish_reason is not None)
                reason = ev.finish_reason
                if reason == "stop" and calls[i] is not None and calls[i].calls:
                    reason = "tool_calls"
                yield chunk(chat_choice(c, reason, lp, ids, delta=True, index=i,
                                        reasoning=r, tool_calls=deltas))
            else:
                lp = (completion_logprobs(ev.logprobs, tok, [length[i]] * len(ev.logprobs))
                      if ev.logprobs is not None else None)
                yield chunk(completion_choice(ev.text, ev.finish_reason, lp, ids, index=i))
            length[i] += len(ev.text)
        if parsed.include_usage:
            yield chunk(None, usage(streams[0].num_prompt_tokens, sum(n_out), cached[0]))
        yield "data: [DONE]\n\n"
    except EngineDeadError as e:
        yield _sse(APIError(503, str(e), type="server_error", code="engine_unavailable").body())


class _EventStream(StreamingResponse):
    """Server-sent events that abort their request's copies however the response ends
    (finished, client gone, cancelled), unless they finished."""

    def __init__(self, events, engine: Engine, streams: list[RequestStream]):
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache"})
        self._engine, self._streams = engine, streams

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            _abort_all(self._engine, self._streams)


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on (host, port); port 0 picks a free one."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


class ServerThread:
    """uvicorn serving ``app`` on a bound socket in a daemon thread.

    ``url`` is the base URL (``http://host:port``); ``stop()`` shuts uvicorn down.
    """

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0,
                 log_level: str = "warning"):
        self.sock = bind_socket(host, port)
        self.port = self.sock.getsockname()[1]
        self.url = f"http://{host}:{self.port}"
        config = uvicorn.Config(app, log_level=log_level, lifespan="off", timeout_keep_alive=30)
        self.server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                        name="uvicorn", daemon=True)

    def start(self, timeout: float = 30.0) -> "ServerThread":
        self._thread.start()
        t0 = time.monotonic()
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() - t0 > timeout:
                raise RuntimeError(f"uvicorn did not start on {self.url}")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self.server.should_exit = True
        self._thread.join(timeout)
        self.sock.close()
