"""Draw a model's token log-probabilities as an HTML page: ``ponente-viz-logprobs`` (Levanter's ``viz_logprobs``).

Each token of some documents is coloured by the log-probability the model gave it, from green (likely) to red
(unlikely); hovering over a token shows the value and the most likely alternatives. The page is self-contained
(inline CSS and script, no network assets). The documents are the first ``num_docs`` rows of the validation
set of ``data`` (as evaluation sees them), or the first ``num_docs`` records of a jsonl file (``documents``).
The model comes from a Hugging Face folder (``hf_checkpoint``) or a training checkpoint (``checkpoint_path``
with the run's ``model:`` section). Examples::

    ponente-viz-logprobs --hf_checkpoint out/hf --documents notes.jsonl --output notes.html
    ponente-viz-logprobs --config_path run.yaml --checkpoint_path checkpoints/<run id> --num_docs 4

where ``run.yaml`` holds the run's ``data:`` and ``model:`` sections. See ``docs/trainer/docs/visualisation.md``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ponente.models import Gpt2Config, LmConfig
from ponente.trainer.data import LMDatasetConfig, LMMixtureDatasetConfig, data_tokenizer, validation_sets
from ponente.trainer.run import load_model_of, parse_command_line, run_cli

__all__ = ["VizLmConfig", "main", "viz_logprobs"]


@dataclasses.dataclass(frozen=True)
class VizLmConfig:
    """Configuration of ``ponente-viz-logprobs``.

    Attributes:
        data: the validation data and tokenizer (the training config's ``data:`` section).
        model: the model config of ``checkpoint_path`` (ignored with ``hf_checkpoint``).
        checkpoint_path: a training checkpoint or run directory.
        hf_checkpoint: a Hugging Face model folder (instead of ``checkpoint_path``).
        tokenizer: the tokenizer (a ``tokenizer.json``, a folder with one, or a hub id); None: the
            ``hf_checkpoint`` folder's ``tokenizer.json`` if it has one, else ``data.tokenizer``.
        documents: a jsonl file (optionally ``.gz``) whose records' ``data.text_key`` field holds the documents,
            tokenized as the tokenizer's own post-processor says (e.g. with a BOS token); None: the validation
            rows of ``data``.
        num_docs: how many documents (rows) to draw.
        max_length: cut documents to this many tokens (None: the model's ``seq_len``).
        top_k: alternatives shown per token.
        batch_size: documents per forward pass.
        output: the HTML file to write (a local path or an fsspec URL).
    """

    data: LMDatasetConfig | LMMixtureDatasetConfig = dataclasses.field(default_factory=LMDatasetConfig)
    model: LmConfig = dataclasses.field(default_factory=Gpt2Config)
    checkpoint_path: str | None = None
    hf_checkpoint: str | None = None
    tokenizer: str | None = None
    documents: str | None = None
    num_docs: int = 8
    max_length: int | None = None
    top_k: int = 5
    batch_size: int = 1
    output: str = "logprobs.html"

    def __post_init__(self) -> None:
        if (self.checkpoint_path is None) == (self.hf_checkpoint is None):
            raise ValueError("checkpoint_path / hf_checkpoint: set exactly one of them")
        for key in ("num_docs", "top_k", "batch_size", "max_length"):
            value = getattr(self, key)
            if value is not None and value < 1:
                raise ValueError(f"{key}: must be >= 1, got {value}")
        if not self.output:
            raise ValueError("output: required (the HTML file to write)")


def _tokenizer(config: VizLmConfig) -> Any:
    from ponente.datacache import load_tokenizer
    from ponente.trainer.data import resolve_url

    if config.tokenizer is not None:
        return load_tokenizer(resolve_url(config.tokenizer))
    if config.hf_checkpoint is not None and (Path(config.hf_checkpoint) / "tokenizer.json").is_file():
        return load_tokenizer(config.hf_checkpoint)
    return data_tokenizer(config.data)


def viz_logprobs(config: VizLmConfig) -> str:
    """Draw the page as configured; returns where it was written.

    Raises:
        ValueError: if there are no documents (no validation data or no validation token, a jsonl file without
            records or whose records all tokenize to nothing).
    """
    from ponente.trainer.viz_logprobs import (
        document_logprobs,
        document_rows,
        render_page,
        validation_rows,
        write_page,
    )

    tokenizer = _tokenizer(config)
    model = load_model_of(config)
    length = config.max_length or model.config.seq_len
    if config.documents is not None:
        text_key = getattr(getattr(config.data, "format", None), "text_key", "text")
        rows, names = document_rows(config.documents, text_key, config.num_docs, tokenizer, max_length=length)
    else:
        datasets = validation_sets(config.data, length)
        if not datasets:
            raise ValueError("data.validation_urls: no validation data to draw (or pass --documents a jsonl file)")
        try:
            rows, names = validation_rows(datasets, config.num_docs)
        except ValueError as exc:
            raise ValueError(f"data.validation_urls: {exc}") from None
    documents = document_logprobs(model, rows, names=names, top_k=config.top_k, batch_size=config.batch_size)
    source = config.hf_checkpoint or config.checkpoint_path
    return write_page(render_page(documents, tokenizer, title=f"Token log-probabilities of {source}"), config.output)


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the command line, draw the page and print where it went; returns the exit code.

    Errors print one line ``error: <message>`` on stderr (exit status 2 for a configuration error, 1 for another;
    ``--debug`` adds the traceback).
    """

    def run_main(args: list[str]) -> int:
        config = parse_command_line(VizLmConfig, args, prog="ponente-viz-logprobs")
        print(f"wrote {viz_logprobs(config)}")
        return 0

    return run_cli(run_main, argv)


if __name__ == "__main__":
    raise SystemExit(main())
