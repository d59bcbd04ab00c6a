"""Generation over records: prompts read from a jsonl file, completions written as records (``ponente-sample-lm``)."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._config import Completion, GenerationConfig
    from ._engine import Engine

__all__ = ["complete_records", "read_prompts", "write_records"]


def read_prompts(path: str, field: str) -> list[dict[str, Any]]:
    """The records of a jsonl file of prompts (``prompts_file``), each a JSON object with a string ``field``.

    Raises:
        FileNotFoundError: if ``path`` does not exist.
        ValueError: naming the file and line of a record that is not a JSON object with a string prompt.
    """
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"prompts_file: {file} does not exist")
    records = []
    for number, line in enumerate(file.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"prompts_file: {file}:{number}: not JSON ({e.msg})") from None
        if not isinstance(record, dict) or not isinstance(record.get(field), str):
            raise ValueError(f"prompts_file: {file}:{number}: expected an object with a string {field!r} field")
        records.append(record)
    return records


def complete_records(
    engine: Engine,
    records: Sequence[dict[str, Any]],
    generation: GenerationConfig,
    *,
    prompt_field: str = "prompt",
    batch_size: int = 8,
    progress_bar: bool = False,
) -> Iterator[dict[str, Any]]:
    """Continue the prompt of each record; yields one output record per input record, in order, as batches finish.

    An output record holds the input record's fields plus ``completion`` (the text), ``finish_reason``, ``tokens``
    (the generated ids) and, when ``generation.logprobs``, ``logprobs``.

    Args:
        engine: the generation engine.
        records: the input records (their ``prompt_field`` holds the prompt).
        generation: the sampling settings.
        prompt_field: the field holding the prompt.
        batch_size: records generated together.
        progress_bar: show a progress bar (with tokens per second) on stderr.
    """
    bar = _progress(len(records), progress_bar)
    started, tokens = time.perf_counter(), 0
    for start in range(0, len(records), batch_size):
        chunk = records[start : start + batch_size]
        done = engine.generate([r[prompt_field] for r in chunk], generation)
        for record, completion in zip(chunk, done, strict=True):
            tokens += len(completion.tokens)
            yield _output_record(record, completion)
        if bar is not None:
            bar.update(len(chunk))
            bar.set_postfix(tokens_per_s=f"{tokens / max(time.perf_counter() - started, 1e-9):.1f}")
    if bar is not None:
        bar.close()


def write_records(records: Iterable[dict[str, Any]], path: str | None) -> None:
    """Write each record as one JSON line to ``path`` (None: stdout) as it comes, flushing after each line."""
    out = open(path, "w", encoding="utf-8") if path else sys.stdout  # noqa: SIM115
    try:
        for record in records:
            out.write(json.dumps(record, ensure_ascii=False) + "\n")
            out.flush()
    finally:
        if out is not sys.stdout:
            out.close()


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
