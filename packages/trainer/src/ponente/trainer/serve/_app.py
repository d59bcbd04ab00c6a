"""The FastAPI app: ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions`` over a :class:`BatchScheduler`.

Each request is checked (:func:`parse_request`), tokenized (chat: rendered with the chat template first),
checked against the context length, then queued as a :class:`Job`; the handler awaits its completions (or
streams its tokens as server-sent events) while the scheduler batches it with the other requests. Everything a
client can get wrong is a 4xx OpenAI-style JSON error; a failure inside generation is a 500 for the request that
caused it only.

What one client cannot do to the others:

- send a body larger than the context can hold (413, refused while it is read, never read whole: the limit is
  derived from the context length, see :func:`body_limit`);
- make the server tokenize a text that cannot fit: a text longer than ``max_seq_len`` times the longest token of the
  vocabulary (x2 for normalizers that merge characters) is refused before tokenization;
- occupy every thread with tokenization: at most ``max_tokenizations`` prompts are tokenized at once, the others wait;
- send something other than JSON (415), or JSON strings that are not valid Unicode (lone surrogates: 400).

``/docs`` and ``/openapi.json`` exist only when asked for (``docs=True``); ``/health`` answers 503 when the
scheduler's thread has died. ``POST /v1/update_weights`` (``{"path": ...}``: a Hugging Face folder or a Ponente
checkpoint) swaps the engine's weights in place (:meth:`~ponente.trainer.inference.Engine.update_weights`: nothing is
compiled again); a folder of another shape is a 400 naming the difference, and the old weights stay.
``POST /v1/reset_prefix_cache`` makes the engine forget its cached prompt prefixes
(:meth:`~ponente.trainer.inference.Engine.reset_prefix_cache`). Both need the API key when the server has one.
"""

import asyncio
import dataclasses
import functools
import json
import logging
import secrets
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

from ._chat import ChatTemplate
from ._protocol import ApiError, Endpoint, GenerationRequest, ServerLimits, error_body, new_id, now, parse_request
from ._scheduler import BatchScheduler, Job, QueueFullError

if TYPE_CHECKING:
    from fastapi import FastAPI

__all__ = ["MAX_BODY_BYTES", "body_limit", "create_app", "longest_token_chars", "require_serve_extra"]

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 16 * 1024 * 1024
"""Request bodies are never larger than this (413), whatever the context length."""

_TEXT_MARGIN = 2
"""Text limit = context x longest token x this: room for normalizers that merge characters (NFKC)."""


def longest_token_chars(tokenizer: Any) -> int:
    """The length of the longest token of ``tokenizer``'s vocabulary (added tokens included), at least 1: no token
    covers more characters of (normalized) text, so a text longer than ``max_seq_len`` times this cannot fit."""
    return max((len(t) for t in tokenizer.get_vocab(with_added_tokens=True)), default=1) or 1


def body_limit(max_seq_len: int, max_prompts: int, token_chars: int) -> int:
    """The largest request body a server of this context can need, capped by :data:`MAX_BODY_BYTES`.

    Per prompt: its longest possible text, each character escaped as JSON can write it (6 bytes, ``\\uXXXX``), or
    its token ids (up to 64 bytes each, which also covers a chat message's JSON per token of context); plus 64 KiB
    for the other fields.
    """
    per_prompt = max_seq_len * (token_chars * _TEXT_MARGIN * 6 + 64)
    return min(MAX_BODY_BYTES, 64 * 1024 + max_prompts * per_prompt)


def require_serve_extra() -> None:
    """Check that FastAPI and uvicorn are installed.

    Raises:
        ImportError: one line naming ``pip install 'ponente-trainer[serve]'``.
    """
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as exc:
        raise ImportError(
            f"ponente-serve needs FastAPI and uvicorn ({exc.name} is missing): pip install 'ponente-trainer[serve]'"
        ) from exc


@dataclasses.dataclass
class _Served:
    """What the handlers share."""

    engine: Any
    tokenizer: Any
    limits: ServerLimits
    scheduler: BatchScheduler
    chat_template: ChatTemplate | None
    stop_token_ids: tuple[int, ...]
    api_key: str | None
    vocab_size: int
    max_text_chars: int
    body_limit: int
    tokenizing: asyncio.Semaphore

    @functools.cached_property
    def token_text(self) -> Any:
        """``token_text(id)``: the text of one token, special tokens included (cached)."""
        return functools.lru_cache(maxsize=1 << 16)(lambda t: self.tokenizer.decode([t], skip_special_tokens=False))


def create_app(
    engine: Any,
    tokenizer: Any,
    *,
    limits: ServerLimits | None = None,
    chat_template: ChatTemplate | None = None,
    stop_token_ids: Sequence[int] = (),
    api_key: str | None = None,
    max_pending: int = 256,
    max_tokenizations: int = 4,
    docs: bool = False,
) -> "FastAPI":
    """An OpenAI-compatible FastAPI app serving ``engine``.

    The app starts its :class:`BatchScheduler` when the server starts (the app's lifespan) and stops it on
    shutdown; ``app.state.scheduler`` is the scheduler.

    Args:
        engine: a ``ponente.trainer.inference.Engine``.
        tokenizer: its ``tokenizers.Tokenizer`` (prompts are tokenized by the server, so their lengths are checked
            before they are queued).
        limits: what a request may ask for (``max_prompts`` is capped by the engine's ``max_batch_size``).
        chat_template: the chat template (None: ``/v1/chat/completions`` answers 400).
        stop_token_ids: tokens that end every completion (e.g. the end-of-sequence token).
        api_key: if set, requests need ``Authorization: Bearer <api_key>`` (401 otherwise).
        max_pending: requests waiting for a batch, at most (429 beyond).
        max_tokenizations: requests tokenized at the same time, at most (the others wait their turn).
        docs: serve the OpenAPI schema and its pages (``/docs``, ``/redoc``, ``/openapi.json``).

    Returns:
        The app, to run with uvicorn (see :func:`ponente.trainer.serve.serve` and :class:`ServerThread`).

    Raises:
        ImportError: if the ``serve`` extra is not installed.
    """
    require_serve_extra()
    # FastAPI reads the handlers' annotations (``request: Request``) at run time: this module does not postpone
    # annotations, and these names are imported here because FastAPI is an optional extra
    from fastapi import FastAPI, Request, Response
    from fastapi.responses import JSONResponse, StreamingResponse
    from starlette.concurrency import run_in_threadpool
    from starlette.exceptions import HTTPException
    from starlette.requests import ClientDisconnect

    limits = limits or ServerLimits()
    batch = int(getattr(engine, "max_batch_size", limits.max_prompts))
    limits = dataclasses.replace(limits, max_prompts=min(limits.max_prompts, batch))
    if max_tokenizations < 1:
        raise ValueError(f"max_tokenizations: must be >= 1, got {max_tokenizations}")
    token_chars = longest_token_chars(tokenizer)
    served = _Served(
        engine=engine,
        tokenizer=tokenizer,
        limits=limits,
        scheduler=BatchScheduler(engine, max_batch_size=batch, max_pending=max_pending),
        chat_template=chat_template,
        stop_token_ids=tuple(int(t) for t in stop_token_ids),
        api_key=api_key,
        vocab_size=min(int(tokenizer.get_vocab_size(with_added_tokens=True)), int(engine.Vocab.size)),
        max_text_chars=limits.max_seq_len * token_chars * _TEXT_MARGIN,
        body_limit=body_limit(limits.max_seq_len, limits.max_prompts, token_chars),
        tokenizing=asyncio.Semaphore(max_tokenizations),
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        served.scheduler.start()
        try:
            yield
        finally:
            served.scheduler.stop(timeout=30)

    hidden: dict[str, Any] = {} if docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="ponente-serve", lifespan=lifespan, **hidden)
    app.state.scheduler = served.scheduler
    app.state.limits = limits

    async def api_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, ApiError)
        headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
        return JSONResponse(exc.body(), status_code=exc.status, headers=headers)

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        message = f"{request.method} {request.url.path}: {exc.detail}"
        return JSONResponse(error_body(message, kind), status_code=exc.status_code, headers=exc.headers)

    async def internal_error(request: Request, exc: Exception) -> Response:
        logger.exception("unexpected error answering %s %s", request.method, request.url.path, exc_info=exc)
        return JSONResponse(error_body(f"internal error: {type(exc).__name__}: {exc}", "server_error"), 500)

    app.add_exception_handler(ApiError, api_error)
    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(Exception, internal_error)

    def authorize(request: Request) -> None:
        if served.api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), served.api_key.encode()):
            raise ApiError(
                401, "Authorization: missing or wrong API key (expected 'Bearer <key>')", code="invalid_api_key"
            )

    async def read_json(request: Request) -> Any:
        media_type = request.headers.get("content-type", "").partition(";")[0].strip().lower()
        if media_type != "application/json":
            raise ApiError(415, f"Content-Type: expected application/json, got {media_type or 'none'!r}")
        limit = served.body_limit
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise ApiError(413, _too_large(int(declared), limit, served.limits.max_seq_len))
        chunks, size = [], 0
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise ApiError(413, _too_large(size, limit, served.limits.max_seq_len))
                chunks.append(chunk)
        except ClientDisconnect as exc:
            raise ApiError(400, "the client disconnected while sending the request") from exc
        try:
            body = json.loads(b"".join(chunks))
        except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError; too deep: RecursionError
            raise ApiError(400, f"the request body is not valid JSON: {type(exc).__name__}: {exc}") from exc
        _check_unicode(body)
        return body

    @app.get("/health")
    async def health() -> Response:
        scheduler = served.scheduler
        if not scheduler.alive:
            error = scheduler.error
            reason = "stopped" if error is None else f"died: {type(error).__name__}: {error}"
            return JSONResponse({"status": "error", "scheduler": reason, "pending": scheduler.pending}, 503)
        return JSONResponse({"status": "ok", "pending": scheduler.pending})

    updating = asyncio.Lock()

    @app.post("/v1/update_weights")
    async def update_weights(request: Request) -> Response:
        authorize(request)
        body = await read_json(request)
        path = body.get("path") if isinstance(body, dict) else None
        if not isinstance(path, str) or not path:
            raise ApiError(400, "path: expected a Hugging Face folder or a Ponente checkpoint path", param="path")
        async with updating:
            version = await run_in_threadpool(_update_weights, served, path)
        logger.info("weights replaced by %s (version %d)", path, version)
        return JSONResponse({"status": "ok", "path": path, "weights_version": version})

    @app.post("/v1/reset_prefix_cache")
    async def reset_prefix_cache(request: Request) -> Response:
        authorize(request)
        reset = getattr(served.engine, "reset_prefix_cache", None)
        if reset is not None:
            reset()
        logger.info("prefix cache reset")
        return JSONResponse({"status": "ok"})

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        authorize(request)
        card = {"id": limits.model_name, "object": "model", "created": 0, "owned_by": "ponente"}
        return {"object": "list", "data": [card]}

    async def generate(request: Request, endpoint: Endpoint) -> Response:
        authorize(request)
        req = parse_request(await read_json(request), endpoint, limits)
        _check_text_length(served, req)
        async with served.tokenizing:
            prompts = await run_in_threadpool(_tokenize, served, req)
        max_tokens = _max_tokens(served.limits, req, prompts)
        config = _generation_config(served, req, max_tokens)
        if req.stream:
            return StreamingResponse(
                _stream(served, req, prompts, config),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        completions = await _complete(served, req, prompts, config)
        return JSONResponse(_response(served, req, completions))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generate(request, "completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await generate(request, "chat")

    return app


def _update_weights(served: _Served, path: str) -> int:
    """Load ``path`` and swap it into the engine (old weights kept on any error); the new weights version."""
    from ponente.trainer.inference import load_model

    engine = served.engine
    try:
        model, _ = load_model(path, vocab_size=getattr(engine.model, "vocab_size", None))
    except FileNotFoundError as exc:
        raise ApiError(400, f"path: {exc}", param="path") from exc
    except (ValueError, KeyError) as exc:
        raise ApiError(400, f"path: {path} cannot be loaded: {exc}", param="path") from exc
    try:
        engine.update_weights(model)
    except ValueError as exc:
        raise ApiError(400, f"path: {path}: {exc}; the server keeps its weights", param="path") from exc
    return int(engine.weights_version)


def _too_large(size: int, limit: int, max_seq_len: int) -> str:
    return (
        f"the request body ({size} bytes) is larger than any request to this model's context of {max_seq_len} "
        f"tokens can be ({limit} bytes)"
    )


def _check_unicode(body: Any) -> None:
    """Refuse strings that cannot be encoded as UTF-8 (JSON's ``\\ud800`` escapes decode to lone surrogates)."""
    stack: list[tuple[str, Any]] = [("", body)]
    while stack:
        where, value = stack.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as exc:
                param = where.partition(".")[0].partition("[")[0] or None
                raise ApiError(
                    400,
                    f"{where or 'the body'}: not valid Unicode (a lone surrogate {value[exc.start]!r} at character "
                    f"{exc.start})",
                    param=param,
                ) from None
        elif isinstance(value, dict):
            stack.extend((f"{where}.{k}" if where else str(k), v) for k, v in value.items())
            stack.extend((f"{where}.<key>", k) for k in value)
        elif isinstance(value, list):
            stack.extend((f"{where}[{i}]", v) for i, v in enumerate(value))


def _check_text_length(served: _Served, req: GenerationRequest) -> None:
    """Refuse text that cannot fit the context before it is tokenized (tokenizing it could take seconds)."""
    if req.endpoint == "chat":
        texts = [("messages", sum(len(m["content"]) for m in req.messages))]
    else:
        texts = [("prompt", len(p)) for p in req.prompts if isinstance(p, str)]
    for param, chars in texts:
        if chars > served.max_text_chars:
            raise ApiError(
                400,
                f"{param}: {chars} characters cannot fit this model's context of {served.limits.max_seq_len} tokens "
                f"(at most {served.max_text_chars} characters could)",
                param=param,
                code="context_length_exceeded",
            )


def _tokenize(served: _Served, req: GenerationRequest) -> list[list[int]]:
    """Token ids of each prompt (chat: of the rendered conversation, special tokens written by the template)."""
    if req.endpoint == "chat":
        if served.chat_template is None:
            raise ApiError(
                400,
                "messages: this model has no chat template (start the server with --chat_template); use "
                "/v1/completions",
                param="messages",
            )
        try:
            text = served.chat_template.render(req.messages)
        except ValueError as exc:
            raise ApiError(400, f"messages: {exc}", param="messages") from exc
        ids = [[int(t) for t in served.tokenizer.encode(text, add_special_tokens=False).ids]]
    else:
        ids = []
        for prompt in req.prompts:
            if isinstance(prompt, str):
                ids.append(served.engine.encode(prompt))  # as Engine.generate encodes text (BOS per the tokenizer)
            else:
                bad = [t for t in prompt if t >= served.vocab_size]
                if bad:
                    raise ApiError(
                        400,
                        f"prompt: token id {bad[0]} is not in the vocabulary (size {served.vocab_size})",
                        param="prompt",
                    )
                ids.append(list(prompt))
    for i, prompt_ids in enumerate(ids):
        if not prompt_ids:
            raise ApiError(400, f"prompt {i}: empty (no tokens to continue)", param="prompt")
    return ids


def _max_tokens(limits: ServerLimits, req: GenerationRequest, prompts: list[list[int]]) -> int:
    """The request's ``max_tokens`` (or the default), checked against the context left after the longest prompt."""
    longest = max(len(p) for p in prompts)
    room = limits.max_seq_len - longest
    param = "messages" if req.endpoint == "chat" else "prompt"
    if room < 1:
        raise ApiError(
            400,
            f"{param}: {longest} tokens leave no room to generate in this model's context of "
            f"{limits.max_seq_len} tokens",
            param=param,
            code="context_length_exceeded",
        )
    if req.max_tokens is None:
        return min(limits.default_max_tokens, room)
    if req.max_tokens > room:
        raise ApiError(
            400,
            f"max_tokens: {longest} prompt tokens + {req.max_tokens} exceed this model's context of "
            f"{limits.max_seq_len} tokens (at most {room} here)",
            param="max_tokens",
            code="context_length_exceeded",
        )
    return req.max_tokens


def _generation_config(served: _Served, req: GenerationRequest, max_tokens: int) -> Any:
    from ponente.trainer.inference import GenerationConfig

    try:
        return GenerationConfig(
            max_new_tokens=max_tokens,
            temperature=req.temperature,
            top_p=req.top_p,
            stop_token_ids=served.stop_token_ids,
            stop_strings=req.stop,
            seed=_engine_seed(req),
            logprobs=req.logprobs,
        )
    except ValueError as exc:
        raise ApiError(400, str(exc)) from exc


def _engine_seed(req: GenerationRequest) -> int:
    """The engine's 32-bit seed: the request's (any integer, taken modulo 2**32), or a fresh one if it sets none."""
    if req.seed is not None:
        return req.seed % 2**32
    return 0 if req.temperature == 0 else secrets.randbits(32)


def _submit(served: _Served, job: Job) -> None:
    try:
        served.scheduler.submit(job)
    except QueueFullError as exc:
        raise ApiError(429, f"server busy: {exc}") from exc
    except RuntimeError as exc:
        raise ApiError(503, f"server unavailable: {exc}") from exc


def _failure(result: BaseException) -> ApiError:
    if isinstance(result, ApiError):
        return result
    if isinstance(result, ValueError):
        return ApiError(400, str(result))
    return ApiError(500, f"generation failed: {type(result).__name__}: {result}")


async def _complete(served: _Served, req: GenerationRequest, prompts: list[list[int]], config: Any) -> list[Any]:
    loop = asyncio.get_running_loop()
    future: asyncio.Future[Any] = loop.create_future()

    def resolve(result: Any) -> None:
        if not future.done():  # the handler may have been cancelled meanwhile
            future.set_result(result)

    def done(result: Any) -> None:
        loop.call_soon_threadsafe(resolve, result)

    job = Job(prompts, config, on_done=done)
    _submit(served, job)
    try:
        result = await future
    finally:
        job.cancelled.set()  # if the handler is cancelled (client gone), drop the job if it has not started
    if isinstance(result, BaseException):
        raise _failure(result)
    return list(result)


def _finish_reason(completion: Any) -> str:
    return "stop" if completion.finish_reason == "stop" else "length"


def _usage(completions: Sequence[Any]) -> dict[str, int]:
    prompt = sum(len(c.prompt_tokens) for c in completions)
    generated = sum(len(c.tokens) for c in completions)
    return {"prompt_tokens": prompt, "completion_tokens": generated, "total_tokens": prompt + generated}


def _completion_logprobs(served: _Served, tokens: Sequence[int], logprobs: Sequence[float], offset: int) -> Any:
    texts = [served.token_text(t) for t in tokens]
    offsets, at = [], offset
    for text in texts:
        offsets.append(at)
        at += len(text)
    return {
        "tokens": texts,
        "token_logprobs": [float(lp) for lp in logprobs],
        "top_logprobs": [{t: float(lp)} for t, lp in zip(texts, logprobs, strict=True)],
        "text_offset": offsets,
    }


def _chat_logprobs(served: _Served, tokens: Sequence[int], logprobs: Sequence[float]) -> Any:
    content = []
    for t, lp in zip(tokens, logprobs, strict=True):
        text = served.token_text(t)
        content.append({"token": text, "logprob": float(lp), "bytes": list(text.encode("utf-8")), "top_logprobs": []})
    return {"content": content}


def _response(served: _Served, req: GenerationRequest, completions: Sequence[Any]) -> dict[str, Any]:
    choices: list[dict[str, Any]] = []
    for i, c in enumerate(completions):
        logprobs = None
        if req.logprobs and c.logprobs is not None:
            if req.endpoint == "chat":
                logprobs = _chat_logprobs(served, c.tokens, c.logprobs)
            else:
                logprobs = _completion_logprobs(served, c.tokens, c.logprobs, 0)
        if req.endpoint == "chat":
            message = {"role": "assistant", "content": c.text}
            choices.append({"index": i, "message": message, "logprobs": logprobs, "finish_reason": _finish_reason(c)})
        else:
            choices.append({"index": i, "text": c.text, "logprobs": logprobs, "finish_reason": _finish_reason(c)})
    chat = req.endpoint == "chat"
    return {
        "id": new_id("chatcmpl" if chat else "cmpl"),
        "object": "chat.completion" if chat else "text_completion",
        "created": now(),
        "model": served.limits.model_name,
        "choices": choices,
        "usage": _usage(completions),
    }


def _sse(payload: Any) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def _stream(served: _Served, req: GenerationRequest, prompts: list[list[int]], config: Any) -> AsyncIterator[str]:
    """Queue the request, then stream server-sent events: a chunk per token, the finish reasons, ``data: [DONE]``.

    The request is queued before the response starts, so a full queue is still a plain 429.
    """
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
    chat = req.endpoint == "chat"
    head = {
        "id": new_id("chatcmpl" if chat else "cmpl"),
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": now(),
        "model": served.limits.model_name,
    }

    def on_token(i: int, token: int, delta: str, logprob: float | None) -> None:
        loop.call_soon_threadsafe(queue.put_nowait, ("token", (i, token, delta, logprob)))

    def done(result: Any) -> None:
        loop.call_soon_threadsafe(queue.put_nowait, ("done", result))

    job = Job(prompts, config, on_done=done, on_token=on_token)
    _submit(served, job)

    def chunk(i: int, text: str | None, logprobs: Any = None, finish: str | None = None) -> str:
        if chat:
            delta = {} if text is None else {"content": text}
            choice = {"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        else:
            choice = {"index": i, "text": text or "", "logprobs": logprobs, "finish_reason": finish}
        return _sse({**head, "choices": [choice]})

    async def events() -> AsyncIterator[str]:
        offsets = [0] * len(prompts)
        try:
            if chat:
                role = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None}
                yield _sse({**head, "choices": [{**role, "finish_reason": None}]})
            while True:
                kind, payload = await queue.get()
                if kind == "token":
                    i, token, delta, logprob = payload
                    logprobs = None
                    if req.logprobs and logprob is not None:
                        if chat:
                            logprobs = _chat_logprobs(served, [token], [logprob])
                        else:
                            logprobs = _completion_logprobs(served, [token], [logprob], offsets[i])
                    if delta or logprobs is not None:
                        offsets[i] += len(delta)
                        yield chunk(i, delta, logprobs)
                    continue
                if isinstance(payload, BaseException):
                    yield _sse(_failure(payload).body())
                    break
                for i, completion in enumerate(payload):
                    yield chunk(i, None if chat else "", None, _finish_reason(completion))
                if req.include_usage:
                    yield _sse({**head, "choices": [], "usage": _usage(payload)})
                break
            yield "data: [DONE]\n\n"
        finally:
            job.cancelled.set()  # the client may be gone: stop forwarding its tokens, drop it if still waiting

    return events()
