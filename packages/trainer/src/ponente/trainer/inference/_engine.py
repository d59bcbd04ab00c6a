"""The generation engine: batched prompts, a key/value cache, one compiled prefill and decode step per bucket."""

from __future__ import annotations

import collections
import contextlib
import logging
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np

import ponente.namedtensor as hax
from ponente.namedtensor import Axis, NamedArray
from ponente.namedtensor.partitioning import ResourceMapping, named_jit

from ._config import Completion, FinishReason, GenerationConfig
from ._sampling import SamplingParams, sample_next
from ._text import TextStream, encode

__all__ = ["Engine", "TokenCallback"]

logger = logging.getLogger(__name__)

TokenCallback = Callable[[int, int, str, float], None]
"""``on_token(request_index, token_id, text_delta, logprob)``: called once per generated token, in order."""

_MIN_PREFILL = 8
"""The shortest prefill bucket: shorter prompts are padded to it (fewer compilations for tiny prompts)."""

_STEPS_PER_CALL = 8
"""How many decode steps one compiled call runs by default (see ``Engine``'s ``steps_per_call``)."""


def _bucket(n: int, cap: int | None = None) -> int:
    """The power of two >= ``n`` (at least :data:`_MIN_PREFILL`), at most ``cap``."""
    size = max(_MIN_PREFILL, 1 << max(n - 1, 0).bit_length())
    return size if cap is None else min(size, cap)


class Engine:
    """Generates text from a language model: prompts batched together, a key/value cache, sharded like training.

    Prompts (text or token ids) are sorted by length and run in batches of up to ``max_batch_size``. A batch is
    right-padded to a power-of-two prompt length and prefilled in one call, which also allocates the cache (its
    length: the power of two holding the longest prompt plus the most new tokens, at most ``max_seq_len``) and
    attends with the model's forward attention backend; then compiled decode calls, each running up to
    ``steps_per_call`` steps on the device, feed each row's last token at its own position. Programs compile
    once per (batch bucket, cache-length bucket) (and prefill length), so repeated calls do not compile again.
    The host reads a call's tokens while the next call runs.

    Only ids below the tokenizer's vocabulary size are ever sampled: a model whose vocabulary axis is padded
    beyond the tokenizer's (e.g. to a multiple of 128) never emits the padding ids, whatever their logits.

    Sampling is per row: a row's draws depend only on its own config and seed, so a prompt gives the same
    completion alone or in any batch.

    Args:
        model: a language model with ``init_cache`` and ``decode`` (every ``ponente.models`` LM).
        tokenizer: a ``tokenizers.Tokenizer`` or ``transformers`` tokenizer; None when prompts are token ids
            (completions then have no text, and stop strings are refused).
        max_batch_size: the most prompts run together.
        max_seq_len: the longest prompt + completion (None: ``model.config.seq_len``).
        axis_mapping: the compute mapping (logical -> mesh axes, e.g. ``TrainerConfig.compute_axis_mapping``);
            the batch axis is ``"batch"``, the cache's ``"cache_position"``.
        mesh: the device mesh (None: one device).
        parameter_axis_mapping: how the parameters are stored on the mesh (e.g.
            ``TrainerConfig.parameter_axis_mapping``; None: ``axis_mapping``).
        cache_dtype: the cache's dtype (None: the model's choice).
        vocab_size: the number of real token ids; ids at or above it get probability 0 (None: the tokenizer's
            size, counting added tokens, when there is a tokenizer; else the model's real ``vocab_size``, else
            its whole vocabulary axis).
        steps_per_call: the most decode steps one compiled call runs before the host reads their tokens (fewer
            host round trips; a batch may compute up to ``steps_per_call - 1`` steps past its end, and streamed
            tokens arrive in groups of this size).

    Raises:
        ValueError: for ``max_batch_size < 1``, ``max_seq_len < 2``, ``vocab_size`` outside ``[1, vocabulary
            axis size]`` or ``steps_per_call < 1``.

    Example:
        >>> engine = Engine(model, tokenizer, max_batch_size=4)  # doctest: +SKIP
        >>> [
        ...     c.text for c in engine.generate(["Once upon a time"], GenerationConfig(max_new_tokens=8))
        ... ]  # doctest: +SKIP
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any = None,
        *,
        max_batch_size: int = 8,
        max_seq_len: int | None = None,
        axis_mapping: ResourceMapping | None = None,
        mesh: jax.sharding.Mesh | None = None,
        parameter_axis_mapping: ResourceMapping | None = None,
        cache_dtype: Any = None,
        vocab_size: int | None = None,
        steps_per_call: int = _STEPS_PER_CALL,
    ) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size: must be >= 1, got {max_batch_size}")
        if steps_per_call < 1:
            raise ValueError(f"steps_per_call: must be >= 1, got {steps_per_call}")
        self.max_seq_len = int(max_seq_len if max_seq_len is not None else model.config.seq_len)
        if self.max_seq_len < 2:
            raise ValueError(f"max_seq_len: must be >= 2, got {self.max_seq_len}")
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        self.mesh = mesh
        self.axis_mapping = None if axis_mapping is None else dict(axis_mapping)
        self.cache_dtype = cache_dtype
        self._batch_shards = 1
        if mesh is not None:
            stored = parameter_axis_mapping if parameter_axis_mapping is not None else (self.axis_mapping or {})
            model = hax.shard(model, dict(stored), mesh)
            if self.axis_mapping is not None and "batch" in self.axis_mapping:
                self._batch_shards = hax.partitioning.physical_axis_size("batch", self.axis_mapping, mesh=mesh) or 1
        self.model = model
        self._stored_mapping = None if mesh is None else dict(parameter_axis_mapping or self.axis_mapping or {})
        self.steps_per_call = steps_per_call
        self.vocab_size = _real_vocab_size(model, tokenizer, vocab_size)
        self.weights_version = 0
        """How many times :meth:`update_weights` replaced the weights (0: the weights the engine was built with)."""

    def update_weights(self, model: Any) -> None:
        """Replace the weights of this engine by ``model``'s, without compiling anything again.

        ``model`` must have the engine model's structure (configuration and parameter names), shapes and
        dtypes; its arrays are placed like the current ones (same devices and shardings), so the compiled prefill
        and decode programs are reused. A batch already running finishes on the weights it started with; the
        next batch uses the new ones. Safe to call from another thread than the one generating.

        Args:
            model: the new model (e.g. the trainer's current model, or one loaded from a folder).

        Raises:
            ValueError: naming the first difference (a parameter, its shape or dtype, or the structure); the
                engine keeps its weights.
        """
        import equinox as eqx

        old_leaves, old_def = jax.tree_util.tree_flatten_with_path(eqx.filter(self.model, eqx.is_array))
        new_leaves, new_def = jax.tree_util.tree_flatten_with_path(eqx.filter(model, eqx.is_array))
        old_by_name = {jax.tree_util.keystr(p): a for p, a in old_leaves}
        new_by_name = {jax.tree_util.keystr(p): a for p, a in new_leaves}
        problem = None
        for name, old in old_by_name.items():
            new = new_by_name.get(name)
            if new is None:
                problem = f"{name} is missing from the new model"
            elif tuple(old.shape) != tuple(new.shape) or old.dtype != new.dtype:
                problem = (
                    f"{name} is {new.dtype}{list(new.shape)} in the new model but {old.dtype}{list(old.shape)} here"
                )
            if problem:
                break
        if problem is None and len(new_by_name) != len(old_by_name):
            problem = f"{sorted(set(new_by_name) - set(old_by_name))[0]} is not a parameter of the engine's model"
        if problem is None and cast(Any, old_def) != new_def:
            problem = "the two models' configurations differ"
        if problem is not None:
            raise ValueError(f"update_weights: {problem}")
        if self.mesh is not None:
            model = hax.shard(model, self._stored_mapping or {}, self.mesh)
        else:
            placed = [
                jax.device_put(new, old.sharding) for (_, old), (_, new) in zip(old_leaves, new_leaves, strict=True)
            ]
            arrays = jax.tree_util.tree_unflatten(new_def, placed)
            model = eqx.combine(arrays, eqx.filter(model, eqx.is_array, inverse=True))
        self.model = model  # one reference swap: a running batch holds the old model
        self.weights_version += 1

    @classmethod
    def data_parallel(cls, model: Any, tokenizer: Any = None, **kwargs: Any) -> Engine:
        """An engine whose batch is split over every device (a ``data`` mesh axis); on one device, no mesh.

        ``kwargs`` are the other arguments of :class:`Engine` (``max_batch_size``, ``max_seq_len``, ...).
        """
        if jax.device_count() == 1:
            return cls(model, tokenizer, **kwargs)
        from ponente.namedtensor.partitioning import make_mesh

        return cls(model, tokenizer, axis_mapping={"batch": "data"}, mesh=make_mesh({"data": -1}), **kwargs)

    @property
    def Vocab(self) -> Axis:
        """The model's vocabulary axis."""
        return self.model.Vocab

    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        """The token ids of a prompt (text is encoded with the tokenizer; ids are checked and kept).

        Raises:
            ValueError: for text without a tokenizer, or ids outside the vocabulary.
        """
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompts: text prompts need a tokenizer (Engine(model, tokenizer))")
            return encode(self.tokenizer, prompt)
        ids = [int(t) for t in prompt]
        bad = [t for t in ids if not 0 <= t < self.Vocab.size]
        if bad:
            raise ValueError(f"prompts: token id {bad[0]} is outside the vocabulary [0, {self.Vocab.size})")
        return ids

    def generate(
        self,
        prompts: Sequence[str | Sequence[int]],
        config: GenerationConfig | Sequence[GenerationConfig] | None = None,
        *,
        on_token: TokenCallback | None = None,
    ) -> list[Completion]:
        """Continue each prompt.

        Args:
            prompts: texts or token-id sequences (each at least one token, shorter than ``max_seq_len``).
            config: one config for every prompt, or one per prompt (None: ``GenerationConfig()``, greedy).
            on_token: streaming callback ``on_token(request_index, token_id, text_delta, logprob)``, called once
                per generated token in the order of generation; the deltas of a request add up to its text.
                ``logprob`` is always the token's log-probability (also without ``config.logprobs``).

        Returns:
            One :class:`Completion` per prompt, in order.

        Raises:
            ValueError: naming the prompt: empty, as long as ``max_seq_len`` or longer, text without a tokenizer,
                stop strings without a tokenizer, or a config list of another length.
        """
        configs = _per_prompt(config, len(prompts))
        if self.tokenizer is None and any(c.stop_strings for c in configs):
            raise ValueError("stop_strings: need a tokenizer (Engine(model, tokenizer))")
        encoded = []
        for i, prompt in enumerate(prompts):
            ids = self.encode(prompt)
            if not ids:
                raise ValueError(f"prompts[{i}]: empty (a prompt needs at least one token)")
            if len(ids) >= self.max_seq_len:
                raise ValueError(f"prompts[{i}]: {len(ids)} tokens; the engine's max_seq_len is {self.max_seq_len}")
            encoded.append(ids)
        results: list[Completion | None] = [None] * len(prompts)
        order = sorted(range(len(prompts)), key=lambda i: len(encoded[i]))
        for start in range(0, len(order), self.max_batch_size):
            chunk = order[start : start + self.max_batch_size]
            done = self._generate_batch([encoded[i] for i in chunk], [configs[i] for i in chunk], chunk, on_token)
            for i, completion in zip(chunk, done, strict=True):
                results[i] = completion
        return [r for r in results if r is not None]

    @contextlib.contextmanager
    def _on_mesh(self) -> Iterator[None]:
        """The engine's mesh and compute mapping, which the compiled programs read (and are cached by)."""
        with contextlib.ExitStack() as stack:
            if self.mesh is not None:
                stack.enter_context(jax.set_mesh(self.mesh))
            if self.axis_mapping is not None:
                stack.enter_context(hax.axis_mapping(self.axis_mapping))
            yield

    def _generate_batch(
        self,
        prompts: list[list[int]],
        configs: list[GenerationConfig],
        indices: list[int],
        on_token: TokenCallback | None,
    ) -> list[Completion]:
        n = len(prompts)
        lengths = [len(p) for p in prompts]
        budgets = [
            min(c.max_new_tokens, self.max_seq_len - length) for c, length in zip(configs, lengths, strict=True)
        ]
        rows = 1 << (n - 1).bit_length()
        rows = math.ceil(rows / self._batch_shards) * self._batch_shards
        cache_len = _bucket(max(length + b for length, b in zip(lengths, budgets, strict=True)), self.max_seq_len)
        prefill_len = _bucket(max(lengths), cache_len)
        Batch, Pos = Axis("batch", rows), Axis("position", prefill_len)
        tokens = np.zeros((rows, prefill_len), np.int32)
        for r, p in enumerate(prompts):
            tokens[r, : len(p)] = p
        padded_lengths = np.asarray(lengths + [1] * (rows - n), np.int32)
        params = SamplingParams.of([*configs, *([None] * (rows - n))])
        positions = np.broadcast_to(np.arange(prefill_len, dtype=np.int32), (rows, prefill_len))
        streams = [TextStream(self.tokenizer, c.stop_strings) for c in configs]
        out_tokens: list[list[int]] = [[] for _ in range(n)]
        out_logprobs: list[list[float]] = [[] for _ in range(n)]
        finish: list[FinishReason | None] = [None] * n

        def take(step: int, host_tokens: np.ndarray, host_logprobs: np.ndarray) -> None:
            for r in range(n):
                if finish[r] is not None:
                    continue
                token, logprob = int(host_tokens[r]), float(host_logprobs[r])
                out_tokens[r].append(token)
                out_logprobs[r].append(logprob)
                is_stop_token = token in configs[r].stop_token_ids
                last = is_stop_token or step + 1 >= budgets[r]
                delta = streams[r].push(None if is_stop_token else token, final=last)
                if is_stop_token or streams[r].stopped:
                    finish[r] = "stop"
                elif last:
                    finish[r] = "length"
                if on_token is not None:
                    on_token(indices[r], token, delta, logprob)

        longest = max(budgets)
        model = self.model  # the whole batch runs on these weights, even if update_weights swaps them meanwhile
        with self._on_mesh():
            cache, last_tokens, first_logprobs = _PREFILL(
                model,
                hax.named(jnp.asarray(tokens), (Batch, Pos)),
                hax.named(jnp.asarray(positions), (Batch, Pos)),
                jnp.asarray(padded_lengths - 1),
                params,
                cache_len,
                self.cache_dtype,
                self.vocab_size,
            )
            # device results not read yet: (tokens, logprobs), each (steps, rows), in order of generation
            pending = collections.deque([(last_tokens[None], first_logprobs[None])])
            produced = 1  # tokens generated (or dispatched) per row
            step = 0
            while pending:
                if produced < longest:  # dispatch the next call before reading the previous one's tokens
                    n_steps = min(self.steps_per_call, 1 << (longest - produced - 1).bit_length())
                    cache, last_tokens, chunk_tokens, chunk_logprobs = _DECODE_STEPS(
                        model,
                        cache,
                        last_tokens,
                        jnp.asarray(padded_lengths + produced - 1),
                        params,
                        jnp.full((rows,), produced, jnp.int32),
                        n_steps,
                        cache_len,
                        self.vocab_size,
                    )
                    pending.append((chunk_tokens, chunk_logprobs))
                    produced += n_steps
                host_tokens, host_logprobs = (np.asarray(a) for a in jax.device_get(pending.popleft()))
                for i in range(host_tokens.shape[0]):
                    take(step, host_tokens[i], host_logprobs[i])
                    step += 1
                    if all(f is not None for f in finish):
                        break
                if all(f is not None for f in finish):
                    break
        return [
            Completion(
                prompt_tokens=list(prompts[r]),
                tokens=out_tokens[r],
                text=streams[r].text,
                logprobs=out_logprobs[r] if configs[r].logprobs else None,
                finish_reason=finish[r] or "length",
            )
            for r in range(n)
        ]


def _per_prompt(config: GenerationConfig | Sequence[GenerationConfig] | None, n: int) -> list[GenerationConfig]:
    if config is None:
        return [GenerationConfig()] * n
    if isinstance(config, GenerationConfig):
        return [config] * n
    configs = list(config)
    if len(configs) != n:
        raise ValueError(f"config: {len(configs)} configs for {n} prompts (pass one, or one per prompt)")
    return configs


def _real_vocab_size(model: Any, tokenizer: Any, vocab_size: int | None) -> int:
    """How many ids can be sampled: ``vocab_size``, else the tokenizer's size, else the model's real vocabulary."""
    size = int(model.Vocab.size)
    if vocab_size is None:
        known = _tokenizer_size(tokenizer) if tokenizer is not None else None
        if known is None:
            known = getattr(model, "vocab_size", None)
        return size if known is None else max(1, min(int(known), size))
    if isinstance(vocab_size, bool) or not 1 <= vocab_size <= size:
        raise ValueError(f"vocab_size: must be in [1, {size}] (the model's vocabulary axis), got {vocab_size}")
    return int(vocab_size)


def _tokenizer_size(tokenizer: Any) -> int | None:
    """One more than the largest id of a ``tokenizers`` or ``transformers`` tokenizer (added tokens included)."""
    get_vocab = getattr(tokenizer, "get_vocab", None)
    if get_vocab is None:
        return None
    try:
        vocab = get_vocab(with_added_tokens=True)
    except TypeError:  # transformers' get_vocab() takes no argument and includes the added tokens
        vocab = get_vocab()
    return max(vocab.values()) + 1 if vocab else None


def _rows_first(logits: NamedArray) -> jax.Array:
    """The logits as a ``(batch, position, vocab)`` array."""
    return logits.rearrange(("batch", "position", "vocab")).array


def _only_real_ids(logits: jax.Array, vocab_size: int) -> jax.Array:
    """``(batch, vocab)`` logits with the ids at or above ``vocab_size`` (vocabulary padding) set to ``-inf``."""
    if vocab_size >= logits.shape[-1]:
        return logits
    return jnp.where(jnp.arange(logits.shape[-1]) < vocab_size, logits.astype(jnp.float32), -jnp.inf)


def _prefill(
    model: Any,
    tokens: NamedArray,
    pos_ids: NamedArray,
    last: jax.Array,
    params: SamplingParams,
    cache_len: int,
    cache_dtype: Any,
    vocab_size: int,
) -> tuple[Any, jax.Array, jax.Array]:
    """Allocate the cache, run the padded prompts through it (a prefill), and sample each row's first token."""
    Batch = tokens.resolve_axis("batch")
    cache = hax.auto_sharded(model.init_cache(Batch, cache_len, dtype=cache_dtype))
    # the output projection runs on each row's last prompt token only
    logits, cache = model.decode(tokens, cache.for_prefill(), pos_ids, logits_at=hax.named(last, Batch))
    final = logits.rearrange((Batch, model.Vocab)).array
    new_tokens, logprobs = sample_next(_only_real_ids(final, vocab_size), params, jnp.zeros_like(last))
    return cache, new_tokens, logprobs


def _decode_steps(
    model: Any,
    cache: Any,
    tokens: jax.Array,
    pos: jax.Array,
    params: SamplingParams,
    steps: jax.Array,
    n_steps: int,
    cache_len: int,
    vocab_size: int,
) -> tuple[Any, jax.Array, jax.Array, jax.Array]:
    """``n_steps`` decode steps in one loop: feed each row's last token at its position, sample the next one.

    Returns:
        ``(cache, last tokens (rows,), tokens (n_steps, rows), logprobs (n_steps, rows))``.
    """
    Batch = Axis("batch", tokens.shape[0])
    Pos = Axis("position", 1)

    def step(
        carry: tuple[Any, jax.Array, jax.Array, jax.Array], _: None
    ) -> tuple[tuple[Any, jax.Array, jax.Array, jax.Array], tuple[jax.Array, jax.Array]]:
        cache, tokens, pos, steps = carry
        logits, cache = model.decode(
            hax.named(tokens[:, None], (Batch, Pos)), cache, hax.named(pos[:, None], (Batch, Pos))
        )
        new_tokens, logprobs = sample_next(_only_real_ids(_rows_first(logits)[:, 0, :], vocab_size), params, steps)
        # a row past its end keeps stepping until the batch's call ends: its writes stay in its own last slot
        return (cache, new_tokens, jnp.minimum(pos + 1, cache_len - 1), steps + 1), (new_tokens, logprobs)

    (cache, tokens, _, _), (all_tokens, all_logprobs) = jax.lax.scan(
        step, (cache, tokens, jnp.minimum(pos, cache_len - 1), steps), None, length=n_steps
    )
    return cache, tokens, all_tokens, all_logprobs


# Shared by every engine: programs are cached by the model's structure, the shapes, the mapping and the mesh, so
# engines over the same model (or models of the same architecture) compile each bucket once per process.
_PREFILL = named_jit(_prefill)
_DECODE_STEPS = named_jit(_decode_steps, donate_args=(False, True, False, False, False, False, False, False, False))
