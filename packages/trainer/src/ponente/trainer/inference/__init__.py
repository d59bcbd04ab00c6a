"""Generation: continue prompts with a language model through its key/value cache, batched and sharded.

One engine serves the sampler (``ponente-sample-lm``), the server, the evaluation harness and RL rollouts::

    from ponente.trainer.inference import Engine, GenerationConfig, load_model

    model, tokenizer = load_model("my-hf-folder")  # or a Ponente checkpoint
    engine = Engine(model, tokenizer, max_batch_size=8)
    for c in engine.generate(["The capital of France is", "1, 2, 3,"], GenerationConfig(max_new_tokens=16)):
        print(c.text, c.finish_reason)

- ``_config``: :class:`GenerationConfig` (greedy/temperature/top-k/top-p, stops, seed, log-probs) and
  :class:`Completion`.
- ``_sampling``: the next token of each row from its logits (per-row settings, per-row PRNG keys).
- ``_text``: incremental decoding with stop strings (the deltas a stream sends).
- ``_paged``: the pages of a paged cache on the host: allocation with reference counts, the prefix cache.
- ``_engine``: :class:`Engine`: continuous batching over a paged cache (slots, chunked prefill, one compiled step
  per bucket), or static batches (the compiled prefill and decode steps); the host loop.
- ``_load``: :func:`load_model` from a Hugging Face folder or a Ponente checkpoint.
- ``_records``: :func:`read_prompts` from a jsonl file, :func:`complete_records`, :func:`write_records`.
"""

from ._config import Completion, FinishReason, GenerationConfig
from ._engine import Engine, TokenCallback
from ._load import eos_token_ids, load_model
from ._records import complete_records, read_prompts, write_records
from ._sampling import SamplingParams, sample_next

__all__ = [
    "Completion",
    "Engine",
    "FinishReason",
    "GenerationConfig",
    "SamplingParams",
    "TokenCallback",
    "complete_records",
    "eos_token_ids",
    "load_model",
    "read_prompts",
    "sample_next",
    "write_records",
]
