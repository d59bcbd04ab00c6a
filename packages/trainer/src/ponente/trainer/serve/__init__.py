"""An OpenAI-compatible HTTP server over the generation engine (``ponente-serve``; the ``serve`` extra).

Endpoints: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions`` (streaming with
server-sent events, ``logprobs``, ``stop``, ``max_tokens``, ``temperature``, ``top_p``, ``seed``), and
``GET /health``. From Python::

    from ponente.trainer.inference import Engine, load_model
    from ponente.trainer.serve import ChatTemplate, ServerLimits, ServerThread, create_app

    model, tokenizer = load_model("my-hf-folder")
    engine = Engine(model, tokenizer, max_batch_size=8)
    app = create_app(
        engine,
        tokenizer,
        limits=ServerLimits(model_name="tiny", max_seq_len=engine.max_seq_len),
        chat_template=ChatTemplate.load(tokenizer, "my-hf-folder"),
    )
    with ServerThread(app) as server:  # or serve(app, port=8000) in the foreground
        print(server.base_url)  # http://127.0.0.1:<port>/v1, for openai.OpenAI(base_url=...)

- ``_protocol``: request checking (:func:`parse_request`, :class:`ServerLimits`) and OpenAI errors (:class:`ApiError`).
- ``_chat``: :class:`ChatTemplate`, the tokenizer's chat template rendered as in SFT.
- ``_config``: :class:`ServeConfig`, the configuration of ``ponente-serve``.
- ``_scheduler``: :class:`BatchScheduler`, the background thread batching concurrent requests into the engine.
- ``_app``: :func:`create_app`, the FastAPI app.
- ``_build``: :func:`app_for_model`, the engine, stop ids (:func:`stop_token_ids`), chat template and limits of
  a loaded model (``ponente-serve``).
- ``_server``: uvicorn in the foreground (:func:`serve`) or on a thread (:class:`ServerThread`).

FastAPI and uvicorn are imported only when an app is built or served; without them that raises an ``ImportError``
naming ``pip install 'ponente-trainer[serve]'``.
"""

from ._app import MAX_BODY_BYTES, body_limit, create_app, longest_token_chars, require_serve_extra
from ._build import app_for_model, stop_token_ids, tokenizer_folder
from ._chat import ChatTemplate
from ._config import API_KEY_ENV, ServeConfig
from ._protocol import ApiError, GenerationRequest, ServerLimits, error_body, parse_request
from ._scheduler import BatchScheduler, Job, QueueFullError
from ._server import MAX_CONNECTIONS, ServerThread, free_port, serve

__all__ = [
    "API_KEY_ENV",
    "MAX_BODY_BYTES",
    "MAX_CONNECTIONS",
    "ApiError",
    "BatchScheduler",
    "ChatTemplate",
    "GenerationRequest",
    "Job",
    "QueueFullError",
    "ServeConfig",
    "ServerLimits",
    "ServerThread",
    "app_for_model",
    "body_limit",
    "create_app",
    "error_body",
    "free_port",
    "longest_token_chars",
    "parse_request",
    "require_serve_extra",
    "serve",
    "stop_token_ids",
    "tokenizer_folder",
]
