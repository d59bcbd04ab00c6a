"""Serve a language model over an OpenAI-compatible HTTP API: ``ponente-serve`` (the ``serve`` extra).

Example::

    ponente-serve --hf_checkpoint my-hf-folder --port 8000
    ponente-serve --checkpoint_path runs/checkpoints/<run id> --model_name my-run --api_key secret

The model comes from a Hugging Face folder (``hf_checkpoint``) or a Ponente checkpoint or run directory
(``checkpoint_path``: the run's saved configuration gives the architecture and tokenizer; ``model`` and
``tokenizer`` override them). Concurrent requests are batched together (``max_batch_size``); requests beyond
the limits (``max_tokens``, the context of ``max_seq_len`` tokens) get a 400 JSON error. The API key may also
come from the ``PONENTE_SERVE_API_KEY`` environment variable (kept out of the process list).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ponente.trainer.run import tool_main
from ponente.trainer.serve import API_KEY_ENV, ServeConfig

__all__ = ["API_KEY_ENV", "ServeConfig", "build_app", "main"]

logger = logging.getLogger(__name__)


def build_app(config: ServeConfig) -> Any:
    """Load the model, build its engine and the app, as ``config`` says.

    Args:
        config: the configuration.

    Returns:
        The FastAPI app (serve it with ``ponente.trainer.serve.serve``).

    Raises:
        ImportError: if the ``serve`` extra is not installed.
        ValueError: naming the key: no tokenizer, a stop token not in the vocabulary, a bad chat template.
    """
    from ponente.trainer.inference import eos_token_ids, load_model
    from ponente.trainer.serve import app_for_model, require_serve_extra, tokenizer_folder

    require_serve_extra()
    model, tokenizer = load_model(
        config.source, vocab_size=config.vocab_size, model_config=config.model, tokenizer=config.tokenizer
    )
    if tokenizer is None:
        raise ValueError(f"tokenizer: {config.source} has no tokenizer.json; pass --tokenizer")
    return app_for_model(
        model,
        tokenizer,
        folder=tokenizer_folder(config.tokenizer if config.tokenizer is not None else config.source),
        model_name=config.model_name or Path(config.source.rstrip("/")).name or "ponente",
        eos_ids=eos_token_ids(config.source) if config.hf_checkpoint is not None else (),
        stop_tokens=config.stop_tokens,
        chat_template=config.chat_template,
        max_batch_size=config.max_batch_size,
        max_seq_len=config.max_seq_len,
        max_tokens=config.max_tokens,
        default_max_tokens=config.default_max_tokens,
        max_pending=config.max_pending,
        max_tokenizations=config.max_tokenizations,
        docs=config.docs,
        engine_options={
            "continuous": config.continuous,
            "page_size": config.page_size,
            "max_pages": config.max_pages,
            "prefill_chunk": config.prefill_chunk,
            "prefix_caching": config.prefix_caching,
            "steps_per_call": config.steps_per_call,
        },
        api_key=config.api_key if config.api_key is not None else os.environ.get(API_KEY_ENV) or None,
    )


def _serve(config: ServeConfig) -> None:
    from ponente.trainer.serve import serve

    app = build_app(config)
    logger.info("serving %r on http://%s:%d/v1", app.state.limits.model_name, config.host, config.port)
    serve(app, host=config.host, port=config.port, log_level=config.log_level, max_connections=config.max_connections)


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the command line, load the model and serve until interrupted; returns the exit code.

    Errors print one line ``error: <message>`` on stderr (exit status 2 for a configuration error, 1 for another;
    ``--debug`` adds the traceback).
    """
    return tool_main(_serve, ServeConfig, argv, prog="ponente-serve")


if __name__ == "__main__":
    raise SystemExit(main())
