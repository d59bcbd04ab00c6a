"""The OpenAI request format: parse and check a request body, build the response objects and the errors.

Plain Python (no FastAPI, no pydantic): every check names the parameter it rejects, and every rejection is an
:class:`ApiError` that the app turns into the OpenAI JSON error, so no request body can crash the server.
"""

from __future__ import annotations

import dataclasses
import math
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, Literal

__all__ = ["ApiError", "Endpoint", "GenerationRequest", "ServerLimits", "error_body", "new_id", "now", "parse_request"]

Endpoint = Literal["completions", "chat"]


@dataclasses.dataclass(frozen=True)
class ServerLimits:
    """What a request may ask for.

    Attributes:
        model_name: the model id ``/v1/models`` lists; requests naming another model get 404.
        max_seq_len: prompt plus generated tokens, at most (the engine's cache length).
        max_tokens: the largest ``max_tokens`` (``max_completion_tokens``) a request may ask for.
        default_max_tokens: ``max_tokens`` of a request that sets none (capped by what the context leaves).
        max_prompts: prompts in one ``/v1/completions`` request (a list ``prompt``), at most.
        max_stop: stop strings per request, at most.
    """

    model_name: str = "ponente"
    max_seq_len: int = 2048
    max_tokens: int = 1024
    default_max_tokens: int = 64
    max_prompts: int = 8
    max_stop: int = 4

    def __post_init__(self) -> None:
        for name in ("max_seq_len", "max_tokens", "default_max_tokens", "max_prompts"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")


class ApiError(Exception):
    """A request the server answers with an OpenAI-style JSON error instead of a completion.

    Args:
        status: the HTTP status (400 bad request, 401 no/wrong key, 404 unknown model, 413 body too large,
            415 not JSON, 429 busy, 500, 503 not running).
        message: one line for the client, naming the parameter.
        param: the request parameter at fault, if any.
        code: a machine-readable code (e.g. ``context_length_exceeded``), if any.
    """

    _TYPES: ClassVar[dict[int, str]] = {
        400: "invalid_request_error",
        401: "authentication_error",
        404: "invalid_request_error",
    }

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        """The JSON body: ``{"error": {"message", "type", "param", "code"}}``."""
        default = "invalid_request_error" if 400 <= self.status < 500 else "server_error"
        kind = self._TYPES.get(self.status, "rate_limit_error" if self.status == 429 else default)
        return error_body(self.message, kind, param=self.param, code=self.code)


def error_body(message: str, kind: str, *, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """An OpenAI error object.

    Args:
        message: what went wrong.
        kind: its ``type`` (``invalid_request_error``, ``authentication_error``, ``server_error``, ...).
        param: the parameter at fault.
        code: a machine-readable code.

    Returns:
        ``{"error": {"message": ..., "type": ..., "param": ..., "code": ...}}``.
    """
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


@dataclasses.dataclass(frozen=True)
class GenerationRequest:
    """A checked request: what to generate and how to answer.

    Attributes:
        endpoint: ``completions`` or ``chat``.
        prompts: the prompts (text, or token ids for ``/v1/completions``); chat: the messages, rendered later.
        messages: the chat messages (chat only).
        max_tokens: tokens to generate at most (None: the server's default, capped by the context).
        temperature: softmax temperature (0: greedy).
        top_p: nucleus sampling threshold (None: off).
        seed: the sampling seed (None: drawn by the server for sampled requests).
        stop: stop strings.
        logprobs: return the log-probability of each generated token.
        stream: answer with server-sent events.
        include_usage: with ``stream``, a last chunk with the token counts (``stream_options.include_usage``).
    """

    endpoint: Endpoint
    prompts: tuple[str | tuple[int, ...], ...] = ()
    messages: tuple[Mapping[str, str], ...] = ()
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    logprobs: bool = False
    stream: bool = False
    include_usage: bool = False


_COMMON = {
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "n",
    "logprobs",
    "user",
    "frequency_penalty",
    "presence_penalty",
}
_COMPLETIONS = _COMMON | {"prompt", "echo", "best_of", "suffix", "logit_bias"}
_CHAT = _COMMON | {"messages", "max_completion_tokens", "top_logprobs", "logit_bias", "response_format"}


def _bad(message: str, param: str, code: str | None = None) -> ApiError:
    return ApiError(400, f"{param}: {message}", param=param, code=code)


def _number(body: Mapping[str, Any], name: str, default: float | None, lo: float, hi: float) -> float | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise _bad(f"expected a number, got {value!r}", name)
    if not lo <= value <= hi:
        raise _bad(f"must be in [{lo:g}, {hi:g}], got {value!r}", name)
    return float(value)


def _integer(body: Mapping[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(f"expected an integer, got {value!r}", name)
    return value


def _flag(body: Mapping[str, Any], name: str) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise _bad(f"expected true or false, got {value!r}", name)
    return value


def _prompts(value: Any, limits: ServerLimits) -> tuple[str | tuple[int, ...], ...]:
    """``prompt``: a string, a list of strings, a list of token ids, or a list of lists of token ids."""

    def ids(item: Sequence[Any]) -> tuple[int, ...]:
        if not item or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in item):
            raise _bad("a token-id prompt must be a non-empty list of non-negative integers", "prompt")
        return tuple(item)

    if isinstance(value, str):
        prompts: list[str | tuple[int, ...]] = [value]
    elif isinstance(value, list) and value and all(isinstance(p, str) for p in value):
        prompts = list(value)
    elif isinstance(value, list) and value and all(isinstance(p, int) for p in value):
        prompts = [ids(value)]
    elif isinstance(value, list) and value and all(isinstance(p, list) for p in value):
        prompts = [ids(p) for p in value]
    else:
        raise _bad("expected a string, a list of strings, or token ids (a list of integers or of lists)", "prompt")
    if len(prompts) > limits.max_prompts:
        raise _bad(f"at most {limits.max_prompts} prompts per request, got {len(prompts)}", "prompt")
    return tuple(prompts)


def _messages(value: Any) -> tuple[Mapping[str, str], ...]:
    if not isinstance(value, list) or not value:
        raise _bad("expected a non-empty list of {role, content} messages", "messages")
    messages = []
    for k, message in enumerate(value):
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise _bad(f"message {k}: expected an object with a string 'role'", "messages")
        if "content" not in message:
            raise _bad(f"message {k}: no 'content'", "messages")
        content = message["content"]
        if isinstance(content, list):  # content parts: only text parts are understood
            if not all(
                isinstance(p, Mapping) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
            ):
                raise _bad(f"message {k}: only text content parts are supported", "messages")
            content = "".join(p["text"] for p in content)
        if content is None and message["role"] == "assistant":  # an assistant turn that only called tools
            content = ""
        if not isinstance(content, str):
            raise _bad(f"message {k}: expected 'content' to be a string, got {type(content).__name__}", "messages")
        messages.append({"role": message["role"], "content": content})
    return tuple(messages)


def _stop(value: Any, limits: ServerLimits) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise _bad("expected a non-empty string or a list of them", "stop")
    if len(stops) > limits.max_stop:
        raise _bad(f"at most {limits.max_stop} stop strings, got {len(stops)}", "stop")
    return tuple(stops)


def parse_request(body: Any, endpoint: Endpoint, limits: ServerLimits) -> GenerationRequest:
    """Check a request body of ``/v1/completions`` or ``/v1/chat/completions``.

    Supported: ``prompt``/``messages``, ``max_tokens`` (chat: also ``max_completion_tokens``), ``temperature``
    (default 1, as OpenAI), ``top_p``, ``seed``, ``stop``, ``stream`` (+ ``stream_options.include_usage``),
    ``logprobs`` (completions: 0 or 1; chat: true/false, ``top_logprobs`` 0), ``n`` 1. Unknown parameters and
    unsupported values (``echo``, ``best_of`` > 1, penalties other than 0, ``logit_bias``) are rejected rather
    than silently ignored.

    Args:
        body: the decoded JSON body.
        endpoint: ``completions`` or ``chat``.
        limits: the server's limits.

    Returns:
        The checked request (token counts are checked later, once the prompt is tokenized).

    Raises:
        ApiError: 400 naming the parameter; 404 for a model other than the served one.
    """
    if not isinstance(body, Mapping):
        raise ApiError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    known = _COMPLETIONS if endpoint == "completions" else _CHAT
    unknown = sorted(str(k) for k in body if k not in known)
    if unknown:
        raise _bad(f"unknown or unsupported parameter (supported: {', '.join(sorted(known))})", unknown[0])
    model = body.get("model")
    if model is not None and model != limits.model_name:
        raise ApiError(
            404,
            f"model: {model!r} is not served here (this server serves {limits.model_name!r})",
            param="model",
            code="model_not_found",
        )
    n = _integer(body, "n")
    if n not in (None, 1):
        raise _bad(f"only n=1 is supported, got {n}", "n")
    for name in ("frequency_penalty", "presence_penalty"):
        if _number(body, name, 0.0, -2.0, 2.0) != 0.0:
            raise _bad("only 0 is supported", name)
    if body.get("logit_bias"):
        raise _bad("not supported", "logit_bias")
    max_tokens = _integer(body, "max_tokens")
    if endpoint == "chat" and body.get("max_completion_tokens") is not None:
        max_tokens = _integer(body, "max_completion_tokens")
    if max_tokens is not None and not 1 <= max_tokens <= limits.max_tokens:
        param = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        raise _bad(f"must be in [1, {limits.max_tokens}] on this server, got {max_tokens}", param)
    seed = _integer(body, "seed")
    if seed is not None and not -(2**63) <= seed < 2**63:
        raise _bad(f"must be a 64-bit integer, got {seed}", "seed")
    top_p = _number(body, "top_p", None, 0.0, 1.0)
    if top_p is not None and top_p <= 0.0:
        raise _bad("must be > 0", "top_p")
    stream = _flag(body, "stream")
    options = body.get("stream_options")
    if options is not None and not (isinstance(options, Mapping) and set(options) <= {"include_usage"}):
        raise _bad('expected {"include_usage": true|false}', "stream_options")
    include_usage = _flag(options, "include_usage") if options else False
    common: dict[str, Any] = {
        "max_tokens": max_tokens,
        "temperature": _number(body, "temperature", 1.0, 0.0, 2.0),
        "top_p": None if top_p == 1.0 else top_p,
        "seed": seed,
        "stop": _stop(body.get("stop"), limits),
        "stream": stream,
        "include_usage": include_usage and stream,
    }
    if endpoint == "completions":
        if "prompt" not in body:
            raise _bad("required", "prompt")
        if _flag(body, "echo"):
            raise _bad("echo is not supported", "echo")
        if _integer(body, "best_of") not in (None, 1):
            raise _bad("only best_of=1 is supported", "best_of")
        if body.get("suffix"):
            raise _bad("not supported", "suffix")
        logprobs = _integer(body, "logprobs")
        if logprobs not in (None, 0, 1):
            raise _bad(f"only the chosen token's log-prob is available: 0 or 1, got {logprobs}", "logprobs")
        return GenerationRequest(
            "completions", prompts=_prompts(body["prompt"], limits), logprobs=logprobs == 1, **common
        )
    if "messages" not in body:
        raise _bad("required", "messages")
    top = _integer(body, "top_logprobs")
    if top not in (None, 0):
        raise _bad(f"only the chosen token's log-prob is available: 0, got {top}", "top_logprobs")
    fmt = body.get("response_format")
    if fmt is not None and not (isinstance(fmt, Mapping) and fmt.get("type") == "text"):
        raise _bad('only {"type": "text"} is supported', "response_format")
    return GenerationRequest("chat", messages=_messages(body["messages"]), logprobs=_flag(body, "logprobs"), **common)


def new_id(prefix: str) -> str:
    """A fresh response id, e.g. ``cmpl-1f0c...``."""
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    """The ``created`` field: seconds since the epoch."""
    return int(time.time())
