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
import json
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from ponente.trainer.inference import Completion, Engine, GenerationConfig, eos_token_ids, load_model
from ponente.trainer.run import parse_command_line, print_versions, run_cli

__all__ = ["SampleLmConfig", "main", "read_prompts", "sample_lm"]


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


def read_prompts(config: SampleLmConfig) -> list[dict[str, Any]]:
    """The input records: ``{"prompt": text}`` per command-line prompt, or the jsonl file's records.

    Raises:
        FileNotFoundError: if ``prompts_file`` does not exist.
        ValueError: naming the file and line of a record that is not a JSON object with a string prompt.
    """
    field = config.prompt_field
    if config.prompts_file is None:
        return [{field: p} for p in config.prompts]
    path = Path(config.prompts_file)
    if not path.is_file():
        raise FileNotFoundError(f"prompts_file: {path} does not exist")
    records = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"prompts_file: {path}:{number}: not JSON ({e.msg})") from None
        if not isinstance(record, dict) or not isinstance(record.get(field), str):
            raise ValueError(f"prompts_file: {path}:{number}: expected an object with a string {field!r} field")
        records.append(record)
    return records


def sample_lm(config: SampleLmConfig) -> Iterator[dict[str, Any]]:
    """Generate as configured; yields one output record per prompt, in order, as batches finish."""
    import jax

    from ponente.namedtensor.partitioning import make_mesh

    records = read_prompts(config)
    path = config.hf_checkpoint if config.hf_checkpoint is not None else config.checkpoint_path
    assert path is not None  # checked in __post_init__
    model, tokenizer = load_model(path, vocab_size=config.vocab_size, tokenizer=config.tokenizer)
    stops = eos_token_ids(path) if config.stop_at_eos and config.hf_checkpoint is not None else ()
    mesh = make_mesh({"data": -1}) if jax.device_count() > 1 else None
    engine = Engine(
        model,
        tokenizer,
        max_batch_size=config.max_batch_size,
        max_seq_len=config.max_seq_len,
        axis_mapping={"batch": "data"} if mesh is not None else None,
        mesh=mesh,
    )
    generation = config.generation_config(stops)
    bar = _progress(len(records), config.progress_bar)
    started, tokens = time.perf_counter(), 0
    for start in range(0, len(records), config.max_batch_size):
        chunk = records[start : start + config.max_batch_size]
        done = engine.generate([r[config.prompt_field] for r in chunk], generation)
        for record, completion in zip(chunk, done, strict=True):
            tokens += len(completion.tokens)
            yield _output_record(record, completion)
        if bar is not None:
            bar.update(len(chunk))
            bar.set_postfix(tokens_per_s=f"{tokens / max(time.perf_counter() - started, 1e-9):.1f}")
    if bar is not None:
        bar.close()


def _progress(total: int, enabled: bool) -> Any:
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, unit="prompt", file=sys.stderr, desc="sample-lm")


def _output_record(record: dict[str, Any], completion: Completion) -> dict[str, Any]:
    out = dict(record)
    out.update(completion=completion.text, finish_reason=completion.finish_reason, tokens=completion.tokens)
    if completion.logprobs is not None:
        out["logprobs"] = completion.logprobs
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the command line, generate and write the completions; returns the exit code.

    Errors print one line ``error: <message>`` on stderr (exit status 2 for a configuration error, 1 for another;
    ``--debug`` adds the traceback).
    """

    def run_main(args: list[str]) -> int:
        if "--version" in args:
            print_versions()
            return 0
        config = parse_command_line(SampleLmConfig, args, prog="ponente-sample-lm")
        out = open(config.output, "w", encoding="utf-8") if config.output else sys.stdout  # noqa: SIM115
        try:
            for record in sample_lm(config):
                out.write(json.dumps(record, ensure_ascii=False) + "\n")
                out.flush()
        finally:
            if out is not sys.stdout:
                out.close()
        return 0

    return run_cli(run_main, argv)


if __name__ == "__main__":
    raise SystemExit(main())
