"""The configuration of ``ponente-serve`` (:class:`ServeConfig`): where the model comes from, the server's limits."""

from __future__ import annotations

import dataclasses

from ponente.models import LmConfig

__all__ = ["API_KEY_ENV", "ServeConfig"]

API_KEY_ENV = "PONENTE_SERVE_API_KEY"
"""Environment variable holding the API key when ``api_key`` is not set."""


@dataclasses.dataclass(frozen=True)
class ServeConfig:
    """Configuration of ``ponente-serve``.

    Attributes:
        hf_checkpoint: a Hugging Face model folder (or hub id).
        checkpoint_path: a Ponente checkpoint or run directory (instead of ``hf_checkpoint``).
        model: the architecture of ``checkpoint_path`` (None: from the run's saved configuration).
        tokenizer: a ``tokenizer.json``, a folder holding one, or a hub id (None: the model's own).
        vocab_size: the vocabulary size of ``checkpoint_path`` (None: from its configuration or tokenizer).
        model_name: the model id clients name (None: the folder's name).
        host: the address to listen on (``0.0.0.0``: every interface).
        port: the TCP port.
        api_key: require ``Authorization: Bearer <api_key>`` (None: ``$PONENTE_SERVE_API_KEY``, else no key).
        chat_template: the chat template: Jinja text or a ``.jinja`` file (None: the tokenizer folder's, from
            ``chat_template.jinja`` or ``tokenizer_config.json``; without one, chat requests get 400).
        stop_tokens: tokens that end a completion besides the model's end-of-sequence ids (e.g. ``<|im_end|>``).
        max_batch_size: prompts generated together, at most.
        max_seq_len: prompt plus completion tokens, at most (None: the model's ``seq_len``).
        max_tokens: the largest ``max_tokens`` a request may ask for.
        default_max_tokens: ``max_tokens`` of requests that set none (capped by the context left).
        max_pending: requests waiting for a batch, at most (429 beyond).
        max_tokenizations: requests tokenized at the same time, at most (the others wait).
        max_connections: open connections at most (uvicorn answers 503 beyond).
        continuous: continuous batching over a paged cache (None: whenever the model's cache can be paged; False:
            static batches).
        page_size: continuous batching: tokens per cache page.
        max_pages: continuous batching: pages in the pool (None: enough for ``max_batch_size`` sequences of
            ``max_seq_len`` tokens).
        prefill_chunk: continuous batching: the most prompt tokens a request feeds per step.
        prefix_caching: continuous batching: reuse the cache pages of shared prompt prefixes
            (``POST /v1/reset_prefix_cache`` forgets them).
        steps_per_call: the most decode steps one compiled call runs (continuous batching: only while every
            request decodes and none waits for a slot it could take; fewer host round trips, streamed tokens
            arrive in groups of up to this many; 1: each token as soon as it exists).
        docs: serve the OpenAPI pages (``/docs``, ``/redoc``, ``/openapi.json``); off by default.
        log_level: uvicorn's log level.
        context_axis_size: refused unless 1: context parallelism (``trainer.context_axis_size``) splits training
            sequences; the generation engine decodes unsplit ones.
    """

    hf_checkpoint: str | None = None
    checkpoint_path: str | None = None
    model: LmConfig | None = None
    tokenizer: str | None = None
    vocab_size: int | None = None
    model_name: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    chat_template: str | None = None
    stop_tokens: tuple[str, ...] = ()
    max_batch_size: int = 8
    max_seq_len: int | None = None
    max_tokens: int = 1024
    default_max_tokens: int = 64
    max_pending: int = 256
    max_tokenizations: int = 4
    max_connections: int = 512
    continuous: bool | None = None
    page_size: int = 16
    max_pages: int | None = None
    prefill_chunk: int = 32
    prefix_caching: bool = True
    steps_per_call: int = 8
    docs: bool = False
    log_level: str = "info"
    context_axis_size: int = 1

    def __post_init__(self) -> None:
        if self.context_axis_size != 1:
            raise ValueError(
                f"context_axis_size={self.context_axis_size}: context parallelism is for training only; the "
                "generation engine does not split sequences (set it to 1)"
            )
        if (self.checkpoint_path is None) == (self.hf_checkpoint is None):
            raise ValueError("checkpoint_path / hf_checkpoint: set exactly one of them")
        for name in (
            "max_batch_size",
            "max_tokens",
            "default_max_tokens",
            "max_pending",
            "max_tokenizations",
            "max_connections",
            "page_size",
            "prefill_chunk",
            "steps_per_call",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.max_pages is not None and self.max_pages < 1:
            raise ValueError(f"max_pages: must be >= 1, got {self.max_pages}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port: must be in [0, 65535], got {self.port}")

    @property
    def source(self) -> str:
        """The model's folder or checkpoint."""
        return str(self.hf_checkpoint if self.hf_checkpoint is not None else self.checkpoint_path)
