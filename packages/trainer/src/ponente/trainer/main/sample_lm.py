"""Continue prompts with a language model: ``ponente-sample-lm`` (``python -m ponente.trainer.main.sample_lm``).

Prompts come from the command line (``--prompts '[Once upon a time, "1, 2, 3,"]'``) or a jsonl file
(``--prompts_file prompts.jsonl``, one object per line with a ``prompt`` field); each completion is one jsonl line
(``--output completions.jsonl``, or stdout). The model is a Hugging Face folder (``hf_checkpoint``) or a Ponente
checkpoint or run directory (``checkpoint_path``; its saved configuration gives the architecture and tokenizer)::

    ponente-sample-lm --hf_checkpoint gpt2-nano-hf --prompts '[Once upon a time]' --max_new_tokens 32
    ponente-sample-lm --checkpoint_path ponente_hello/checkpoints/<run id> --prompts_file prompts.jsonl \\
        --output completions.jsonl --temperature 0.8 --top_p 0.95 --seed 1

An output line holds the input record's fields plus ``completion`` (the text), ``finish_reason`` (``stop`` or
``length``), ``tokens`` (the generated ids) and, with ``--logprobs true``, ``logprobs``. With several devices the
batch is split over them (data parallel).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any

from ponente.trainer.inference import (
    Engine,
    GenerationConfig,
    complete_records,
    eos_token_ids,
    load_model,
    read_prompts,
    write_records,
)
from ponente.trainer.run import tool_main

__all__ = ["SampleLmConfig", "main", "sample_lm"]


@dataclasses.dataclass(frozen=True)
class SampleLmConfig:
    """Configuration of ``ponente-sample-lm``.

    Attributes:
        hf_checkpoint: a Hugging Face model folder (or hub id).
        checkpoint_path: a Ponente checkpoint or run directory (instead of ``hf_checkpoint``).
        tokenizer: the tokenizer (None: the model folder's, or the checkpoint configuration's ``data.tokenizer``).
        vocab_size: the vocabulary size of ``checkpoint_path`` (None: from its configuration).
        prompts: prompts given on the command line.
        prompts_file: a jsonl file of prompts (instead of ``prompts``).
        prompt_field: the field of each jsonl record that holds the prompt.
        output: the jsonl file to write (None: stdout).
        max_new_tokens: the most tokens per completion.
        temperature: softmax temperature (0: greedy).
        top_k: sample among the ``top_k`` most likely tokens (None: all).
        top_p: nucleus sampling threshold (None: off).
        stop_strings: stop once the completion contains one of these.
        stop_at_eos: stop at the model's end-of-sequence ids (``generation_config.json`` / ``config.json``).
        seed: the random seed.
        logprobs: write each token's log-probability.
        max_batch_size: prompts generated together.
        max_seq_len: the longest prompt + completion (None: the model's ``seq_len``).
        progress_bar: show a progress bar on stderr.
    """

    hf_checkpoint: str | None = None
    checkpoint_path: str | None = None
    tokenizer: str | None = None
    vocab_size: int | None = None
    prompts: list[str] = dataclasses.field(default_factory=list)
    prompts_file: str | None = None
    prompt_field: str = "prompt"
    output: str | None = None
    max_new_tokens: int = 64
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    stop_strings: list[str] = dataclasses.field(default_factory=list)
    stop_at_eos: bool = True
    seed: int = 0
    logprobs: bool = False
    max_batch_size: int = 8
    max_seq_len: int | None = None
    progress_bar: bool = True

    def __post_init__(self) -> None:
        if (self.checkpoint_path is None) == (self.hf_checkpoint is None):
            raise ValueError("checkpoint_path / hf_checkpoint: set exactly one of them")
        if bool(self.prompts) == (self.prompts_file is not None):
            raise ValueError("prompts / prompts_file: set exactly one of them")
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size: must be >= 1, got {self.max_batch_size}")

    def generation_config(self, stop_token_ids: Sequence[int] = ()) -> GenerationConfig:
        """The :class:`GenerationConfig` of these settings (``stop_token_ids``: e.g. the model's EOS ids)."""
        return GenerationConfig(
            max_new_tokens=self.max_new_tokens,
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            stop_token_ids=tuple(stop_token_ids),
            stop_strings=tuple(self.stop_strings),
            seed=self.seed,
            logprobs=self.logprobs,
        )


def sample_lm(config: SampleLmConfig) -> Iterator[dict[str, Any]]:
    """Generate as configured; yields one output record per prompt, in order, as batches finish."""
    field = config.prompt_field
    if config.prompts_file is None:
        records = [{field: p} for p in config.prompts]
    else:
        records = read_prompts(config.prompts_file, field)
    path = config.hf_checkpoint if config.hf_checkpoint is not None else config.checkpoint_path
    assert path is not None  # checked in __post_init__
    model, tokenizer = load_model(path, vocab_size=config.vocab_size, tokenizer=config.tokenizer)
    stops = eos_token_ids(path) if config.stop_at_eos and config.hf_checkpoint is not None else ()
    engine = Engine.data_parallel(
        model, tokenizer, max_batch_size=config.max_batch_size, max_seq_len=config.max_seq_len
    )
    generation = config.generation_config(stops)
    yield from complete_records(
        engine,
        records,
        generation,
        prompt_field=field,
        batch_size=config.max_batch_size,
        progress_bar=config.progress_bar,
    )


def _sample_to_output(config: SampleLmConfig) -> None:
    write_records(sample_lm(config), config.output)


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the command line, generate and write the completions; returns the exit code.

    Errors print one line ``error: <message>`` on stderr (exit status 2 for a configuration error, 1 for another;
    ``--debug`` adds the traceback).
    """
    return tool_main(_sample_to_output, SampleLmConfig, argv, prog="ponente-sample-lm")


if __name__ == "__main__":
    raise SystemExit(main())
