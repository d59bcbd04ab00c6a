"""A Ponente language model as an ``lm-eval`` model: :class:`PonenteLM` (needs the ``eval`` extra).

``lm-eval`` asks a model three kinds of question, each as a list of requests:

- ``loglikelihood``: the summed log-probability of a continuation given a context, and whether greedy
  decoding would have produced it (multiple-choice tasks);
- ``loglikelihood_rolling``: the log-probability of a whole text, scored in windows of the model's length;
- ``generate_until``: greedy text after a context, cut at the first stop string (through
  :class:`ponente.trainer.inference.Engine`, with its key/value cache).

Contexts and continuations are tokenized as lm-eval's own Hugging Face backend tokenizes them (the whole text,
split after the context's tokens; empty contexts start from the prefix token), so scores agree with it on the
same weights. Requests are scored in batches of a fixed size, their lengths padded to a power of two, so a task
compiles a handful of programs.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from .config import MISSING_EXTRA

try:
    from lm_eval.api.model import TemplateLM
    from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError(MISSING_EXTRA) from e

__all__ = ["PonenteLM", "special_token_ids"]

_MIN_BUCKET = 16
"""The shortest padded length of a batch (shorter ones would only add compilations)."""

_SPECIAL_NAMES = {
    "eos": ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>"),
    "bos": ("<|begin_of_text|>", "<s>", "<bos>", "<|endoftext|>"),
}
"""Usual spellings of the special tokens, for a tokenizer that comes without a ``tokenizer_config.json``."""


def special_token_ids(tokenizer: Any, folder: str | os.PathLike[str] | None = None) -> tuple[int | None, int | None]:
    """The ``(bos, eos)`` token ids of a tokenizer.

    A ``transformers`` tokenizer says them itself. For a ``tokenizers.Tokenizer``, the ``bos_token`` and
    ``eos_token`` of ``folder/tokenizer_config.json`` are used when there is one, else the usual spellings
    (``<s>``, ``</s>``, ``<|endoftext|>``, ...) found in the vocabulary.

    Args:
        tokenizer: a ``tokenizers.Tokenizer`` or a ``transformers`` tokenizer.
        folder: the tokenizer's folder (None: no ``tokenizer_config.json`` to read).

    Returns:
        ``(bos_id, eos_id)``, each None when the tokenizer has no such token.
    """
    if hasattr(tokenizer, "eos_token_id") and not hasattr(tokenizer, "token_to_id"):
        return tokenizer.bos_token_id, tokenizer.eos_token_id
    named: dict[str, str] = {}
    config = Path(folder, "tokenizer_config.json") if folder is not None else None
    if config is not None and config.is_file():
        values = json.loads(config.read_text(encoding="utf-8"))
        for role in ("bos", "eos"):
            value = values.get(f"{role}_token")
            if isinstance(value, dict):
                value = value.get("content")
            if isinstance(value, str):
                named[role] = value
    ids: dict[str, int | None] = {}
    for role, candidates in _SPECIAL_NAMES.items():
        names = [named[role]] if role in named else list(candidates)
        ids[role] = next((i for i in map(tokenizer.token_to_id, names) if i is not None), None)
    return ids["bos"], ids["eos"]


class _Tokens:
    """One encode/decode interface over a ``tokenizers.Tokenizer`` and a ``transformers`` tokenizer."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.fast = hasattr(tokenizer, "token_to_id") and hasattr(tokenizer, "get_vocab_size")

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        if self.fast:
            return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens))


def _bucket(length: int, cap: int) -> int:
    """The padded length of a batch whose longest row has ``length`` tokens: a power of two, at most ``cap``."""
    size = _MIN_BUCKET
    while size < length:
        size *= 2
    return min(size, cap)


class PonenteLM(TemplateLM):
    """A Ponente language model and its tokenizer, answering ``lm-eval``'s requests.

    Pass it to ``lm_eval.simple_evaluate(model=PonenteLM(...), tasks=...)`` or use
    :func:`~ponente.trainer.eval_harness.run_harness`.

    Args:
        model: a ``ponente.models`` language model (e.g. ``ponente.models.hf.load_pretrained(folder)``).
        tokenizer: its ``tokenizers.Tokenizer`` (or a ``transformers`` tokenizer).
        batch_size: sequences per forward pass (the last batch of a task is padded up to it).
        max_length: the longest sequence the model sees (None: ``model.config.seq_len``).
        max_gen_toks: the most tokens ``generate_until`` produces when a request does not say.
        vocab_size: the tokenizer's vocabulary size when the model's vocabulary axis is padded beyond it: ids at
            or above it are never predicted (None: the model's vocabulary).
        bos_token_id: the prefix of an empty context and of rolling windows (None: the tokenizer's BOS, else EOS;
            see :func:`special_token_ids`).
        eos_token_id: the end-of-text token (generation stops there) (None: the tokenizer's).
        tokenizer_folder: where the tokenizer's ``tokenizer_config.json`` is, to find its special tokens.
        mesh: the device mesh the model's parameters live on (None: the default device).
        axis_mapping: logical -> mesh axes while computing (e.g. the trainer's ``compute_axis_mapping``).
        parameter_axis_mapping: how the parameters are stored on the mesh (e.g. the trainer's
            ``parameter_axis_mapping``; None: ``axis_mapping``), for generation.

    Raises:
        ValueError: if the tokenizer has neither a BOS nor an EOS token and none is given, or a size is invalid.
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        batch_size: int = 8,
        max_length: int | None = None,
        max_gen_toks: int = 256,
        vocab_size: int | None = None,
        bos_token_id: int | None = None,
        eos_token_id: int | None = None,
        tokenizer_folder: str | os.PathLike[str] | None = None,
        mesh: Any = None,
        axis_mapping: Any = None,
        parameter_axis_mapping: Any = None,
    ) -> None:
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"batch_size: must be >= 1, got {batch_size}")
        self.model = model
        self.tokenizer = tokenizer
        self._tokens = _Tokens(tokenizer)
        self.batch_size = batch_size
        self._max_length = min(max_length or model.config.seq_len, model.config.seq_len)
        if self._max_length < 2:
            raise ValueError(f"max_length: must be >= 2, got {self._max_length}")
        self.max_gen_toks = max_gen_toks
        self.vocab_size = vocab_size or model.Vocab.size
        bos, eos = special_token_ids(tokenizer, tokenizer_folder)
        self._eos = eos_token_id if eos_token_id is not None else eos
        self._prefix = bos_token_id if bos_token_id is not None else (bos if bos is not None else self._eos)
        if self._prefix is None:
            raise ValueError("bos_token_id / eos_token_id: the tokenizer has neither a BOS nor an EOS token; pass one")
        self.mesh = mesh
        self.axis_mapping = axis_mapping
        self.parameter_axis_mapping = parameter_axis_mapping
        self._generator: Any = None
        self._programs: dict[str, Callable[..., Any]] = {}

    # -- what lm-eval reads ---------------------------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        """The end-of-text token (the prefix token when the tokenizer has no EOS)."""
        return self._eos if self._eos is not None else int(self._prefix)  # type: ignore[arg-type]

    @property
    def prefix_token_id(self) -> int:
        """The token an empty context, and the first rolling window, start from (BOS, else EOS)."""
        return int(self._prefix)  # type: ignore[arg-type]

    @property
    def max_length(self) -> int:
        """The longest sequence the model sees."""
        return self._max_length

    @property
    def tokenizer_name(self) -> str:
        """A name for lm-eval's request caches."""
        return type(self.tokenizer).__name__

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        """Token ids of ``string``; the tokenizer's special tokens are added unless it already starts with BOS.

        Args:
            string: the text.
            add_special_tokens: force adding (True) or not (False) the tokenizer's special tokens (None: add them
                unless ``string`` starts with the prefix token's text, as lm-eval's HF backend does).
            **kwargs: ignored (lm-eval's other backends take more options).

        Returns:
            The ids.
        """
        if add_special_tokens is None:
            prefix = self._tokens.decode([self.prefix_token_id], skip_special_tokens=False)
            add_special_tokens = not (prefix and string.startswith(prefix))
        return self._tokens.encode(string, add_special_tokens)

    def tok_decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """The text of ``ids`` (special tokens dropped unless ``skip_special_tokens`` is False)."""
        return self._tokens.decode(ids, skip_special_tokens)

    # -- loglikelihood -----------------------------------------------------------------------------------------
    def _loglikelihood_tokens(
        self, requests: list[tuple[Any, list[int], list[int]]], disable_tqdm: bool = False, **kwargs: Any
    ) -> list[tuple[float, bool]]:
        """``(sum of log p(continuation | context), greedy)`` of ``(key, context ids, continuation ids)`` requests.

        Sequences longer than :attr:`max_length` + 1 keep their last tokens.
        """
        rows: list[tuple[list[int], int]] = []
        for _, context, continuation in requests:
            if not continuation:
                raise ValueError("loglikelihood: a request has an empty continuation")
            whole = (list(context) + list(continuation))[-(self.max_length + 1) :]
            rows.append((whole, min(len(continuation), len(whole) - 1)))
        scores = self._score_rows(rows)
        for (key, _, _), answer in zip(requests, scores, strict=True):
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, answer)
        return scores

    def _score_rows(self, rows: Sequence[tuple[list[int], int]]) -> list[tuple[float, bool]]:
        """Score the last ``n`` tokens of each ``(tokens, n)`` row, longest rows first in fixed-size batches."""
        import numpy as np

        order = sorted(range(len(rows)), key=lambda i: -len(rows[i][0]))
        results: list[tuple[float, bool]] = [(0.0, False)] * len(rows)
        for start in range(0, len(order), self.batch_size):
            chunk = order[start : start + self.batch_size]
            width = _bucket(max(len(rows[i][0]) - 1 for i in chunk), self.max_length)
            inputs = np.zeros((self.batch_size, width), np.int32)
            targets = np.zeros((self.batch_size, width), np.int32)
            for r, i in enumerate(chunk):
                tokens = rows[i][0]
                inputs[r, : len(tokens) - 1] = tokens[:-1]
                targets[r, : len(tokens) - 1] = tokens[1:]
            logprobs, greedy = self._run("score", inputs, targets)
            for r, i in enumerate(chunk):
                tokens, n = rows[i]
                scored = slice(len(tokens) - 1 - n, len(tokens) - 1)
                results[i] = (float(np.sum(logprobs[r, scored], dtype=np.float64)), bool(np.all(greedy[r, scored])))
        return results

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        """The log-probability of each request's whole text, in disjoint windows of :attr:`max_length` tokens.

        Every token is predicted once, each window with as much preceding context as fits; the first token is
        predicted from the prefix token.

        Args:
            requests: ``Instance`` objects whose ``args`` are ``(text,)``.
            disable_tqdm: unused (no progress bar).

        Returns:
            One summed log-probability per request.
        """
        rows: list[tuple[list[int], int]] = []
        owners: list[int] = []
        for index, request in enumerate(requests):
            (text,) = request.args
            windows = get_rolling_token_windows(
                token_list=self.tok_encode(text),
                prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length,
                context_len=1,
            )
            for context, predicted in map(make_disjoint_window, windows):
                rows.append((list(context) + list(predicted), len(predicted)))
                owners.append(index)
        totals = [0.0] * len(requests)
        for owner, (logprob, _) in zip(owners, self._score_rows(rows), strict=True):
            totals[owner] += logprob
        for request, total in zip(requests, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    # -- generation ----------------------------------------------------------------------------------------------
    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        """Greedy continuations of each request's context, cut before the first stop string.

        The requests run together through :class:`ponente.trainer.inference.Engine` (key/value cache, batches
        of :attr:`batch_size`).

        Args:
            requests: ``Instance`` objects whose ``args`` are ``(context, gen_kwargs)``; ``gen_kwargs`` may set
                ``until`` (stop strings; the EOS token's text is added) and ``max_gen_toks``. Sampling options
                are not supported.
            disable_tqdm: unused (no progress bar).

        Returns:
            One continuation per request.

        Raises:
            ValueError: if a request asks for sampling, or for more new tokens than :attr:`max_length` allows.
        """
        from ponente.trainer.inference import GenerationConfig

        if not requests:
            return []
        eos_text = self.tok_decode([self.eot_token_id], skip_special_tokens=False)
        prompts: list[list[int]] = []
        configs: list[GenerationConfig] = []
        stops: list[list[str]] = []
        for request in requests:
            context, gen_kwargs = request.args
            options = normalize_gen_kwargs(dict(gen_kwargs), self.max_gen_toks)
            if options.get("do_sample"):
                raise ValueError("generate_until: do_sample is not supported (greedy decoding only)")
            until = [s for s in handle_stop_sequences(options.get("until"), eos=eos_text) if s]
            budget = int(options["max_gen_toks"])
            room = self.max_length - budget
            if room < 1:
                raise ValueError(f"max_gen_toks: {budget} leaves no room for a context within {self.max_length}")
            prompts.append(self.tok_encode(context)[-room:] or [self.prefix_token_id])
            configs.append(
                GenerationConfig(
                    max_new_tokens=budget,
                    temperature=0.0,
                    stop_token_ids=(self.eot_token_id,),
                    stop_strings=tuple(until),
                )
            )
            stops.append(until)
        completions = self._engine().generate(prompts, configs)
        answers: list[str] = []
        for request, completion, until in zip(requests, completions, stops, strict=True):
            text = completion.text
            for stop in until:
                text = text.split(stop)[0]
            self.cache_hook.add_partial("generate_until", request.args, text)
            answers.append(text)
        return answers

    def _engine(self) -> Any:
        """The generation engine (built on first use)."""
        if self._generator is None:
            from ponente.trainer.inference import Engine

            self._generator = Engine(
                self.model,
                self.tokenizer,
                max_batch_size=self.batch_size,
                max_seq_len=self.max_length,
                axis_mapping=self.axis_mapping,
                mesh=self.mesh,
                parameter_axis_mapping=self.parameter_axis_mapping,
            )
        return self._generator

    # -- compiled programs ----------------------------------------------------------------------------------------
    def _run(self, name: str, *arrays: Any) -> Any:
        """Run the compiled program ``name`` (``score``) on host arrays; returns host arrays."""
        import contextlib

        import jax

        if name not in self._programs:
            self._programs[name] = self._compile(name)
        scope = jax.set_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext()
        with scope:
            return jax.device_get(self._programs[name](self.model, *arrays))

    def _compile(self, name: str) -> Callable[..., Any]:
        import jax
        import jax.numpy as jnp

        import ponente.namedtensor as hax
        from ponente.models import AttentionMask
        from ponente.namedtensor.partitioning import named_jit

        Pos = self.model.config.Pos
        Vocab = self.model.Vocab
        vocab_size = self.vocab_size

        def logits_of(model: Any, inputs: jax.Array) -> jax.Array:
            Batch = hax.Axis("batch", inputs.shape[0])
            Len = Pos.resize(inputs.shape[1])
            logits = model(hax.named(inputs, (Batch, Len)), AttentionMask.causal())
            values = logits.rearrange((Batch, Len, Vocab)).array.astype(jnp.float32)
            return jnp.where(jnp.arange(Vocab.size) < vocab_size, values, -jnp.inf)

        def score(model: Any, inputs: jax.Array, targets: jax.Array) -> tuple[jax.Array, jax.Array]:
            logits = logits_of(model, inputs)
            logprobs = jax.nn.log_softmax(logits, axis=-1)
            chosen = jnp.take_along_axis(logprobs, targets[..., None], axis=-1)[..., 0]
            return chosen, jnp.argmax(logits, axis=-1) == targets

        return named_jit(score, axis_resources=self.axis_mapping)
