"""The generation engine: batched prompts, a key/value cache, one compiled prefill and decode step per bucket."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import math
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np

import ponente.namedtensor as hax
from ponente.models import KvCache, PagedKvCache
from ponente.namedtensor import Axis, NamedArray
from ponente.namedtensor.partitioning import ResourceMapping, named_jit

from ._config import Completion, FinishReason, GenerationConfig
from ._paged import PagePool, prefix_hashes
from ._sampling import SamplingParams, sample_next
from ._text import TextStream, encode

__all__ = ["Engine", "TokenCallback"]

logger = logging.getLogger(__name__)

TokenCallback = Callable[[int, int, str, float], None]
"""``on_token(request_index, token_id, text_delta, logprob)``: called once per generated token, in order."""

_MIN_PREFILL = 8
"""The shortest prefill bucket: shorter prompts are padded to it (fewer compilations for tiny prompts)."""

_STEPS_PER_CALL = 8

_MIN_ROWS = 8
"""Continuous batching: the fewest token rows a step runs (fewer buckets for a batch of a few requests)."""

_MIN_GATHER = 64
"""Continuous batching: the fewest cache slots a step gathers per row (fewer page buckets for short sequences)."""

CACHE_POSITION = "cache_position"
"""The slot axis of a model's contiguous cache (dropped from a page pool)."""
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
            tokens arrive in groups of up to this size; 1: one step per call). Continuous batching runs several only
            while every busy slot decodes and no waiting request could take a free slot (see below).
        continuous: True: continuous batching over a paged cache (see below); False: static batches, each with a
            contiguous cache; None: continuous whenever the model's cache can be paged (every decoder-only family,
            DeepSeek-V3's latent cache included).
        page_size: continuous batching: the token slots of a cache page.
        max_pages: continuous batching: the pages of the pool (None: ``kv_cache_bytes``, else enough for
            ``max_batch_size`` sequences of ``max_seq_len`` tokens).
        kv_cache_bytes: continuous batching: size the pool by memory instead (keys and values of every layer).
        prefill_chunk: continuous batching: the most prompt tokens fed per step, all slots together (longer
            prompts run as several chunks, while the other sequences keep decoding).
        prefix_caching: continuous batching: keep the full pages of prompts and reuse them for later prompts with
            the same prefix (reference-counted; unreferenced ones are evicted, least recently used first).

    Continuous batching (the default): a fixed number of slots (``max_batch_size``) share a pool of cache pages.
    Every step runs one compiled call in which each busy slot feeds either its last generated token or its next
    chunk of prompt tokens (``prefill_chunk`` prompt tokens per step, shared by the slots still in their prompts);
    a request joins at the next step after it arrives and leaves as soon as it ends, and it
    takes pages only as its tokens reach them (when the pool runs out, the youngest sequence gives its pages back
    and later recomputes them). Programs compile once per (tokens per step, pages per slot) bucket, both powers of two.
    A request's greedy tokens do not depend on the other requests, and its sampled tokens depend only on its seed.
    When every busy slot decodes (no prompt chunk), no waiting request could be admitted and every sequence has at
    least ``steps_per_call`` tokens of budget left, one call runs ``steps_per_call`` decode steps (the pages they
    need taken first; never preempting: one step when the pool cannot give them); the host takes each sequence's
    tokens in order until it ends and drops the rest, so the completions equal those of one step per call, and a
    request arriving meanwhile joins at the next call. Calls whose rows are all greedy compile without the random
    draw (two programs per bucket at most).

    Raises:
        ValueError: for ``max_batch_size < 1``, ``max_seq_len < 2``, ``vocab_size`` outside ``[1, vocabulary
            axis size]``, ``steps_per_call < 1``, ``page_size < 1``, ``prefill_chunk < 1``, ``max_pages < 1``,
            both ``max_pages`` and ``kv_cache_bytes``, or ``continuous=True`` for a model whose cache cannot be
            paged.

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
        continuous: bool | None = None,
        page_size: int = 16,
        max_pages: int | None = None,
        kv_cache_bytes: int | None = None,
        prefill_chunk: int = 32,
        prefix_caching: bool = True,
    ) -> None:
        if page_size < 1:
            raise ValueError(f"page_size: must be >= 1, got {page_size}")
        if prefill_chunk < 1:
            raise ValueError(f"prefill_chunk: must be >= 1, got {prefill_chunk}")
        if max_pages is not None and kv_cache_bytes is not None:
            raise ValueError("max_pages, kv_cache_bytes: give one of them (both size the page pool)")
        if max_pages is not None and max_pages < 1:
            raise ValueError(f"max_pages: must be >= 1, got {max_pages}")
        if kv_cache_bytes is not None and kv_cache_bytes < 1:
            raise ValueError(f"kv_cache_bytes: must be >= 1, got {kv_cache_bytes}")
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
        self.page_size = page_size
        self.prefill_chunk = prefill_chunk
        self.prefix_caching = prefix_caching
        template = jax.eval_shape(lambda: model.init_cache(Axis("batch", 1), 1, dtype=cache_dtype))
        pageable = (  # keys and values may differ in their last axis (DeepSeek-V3's latents and rotary keys)
            type(template) is KvCache
            and template.keys.axes[:-1] == template.values.axes[:-1]
            and template.keys.dtype == template.values.dtype
            and {"batch", CACHE_POSITION} <= set(template.keys.axis_names)
        )
        if continuous and not pageable:
            raise ValueError(
                f"continuous: {type(model).__name__}'s cache cannot be paged (use continuous=False, static batches)"
            )
        self.continuous = pageable if continuous is None else bool(continuous)
        """Whether requests run in a continuous batch over a paged cache (else static batches, one cache each)."""
        self._batch: _ContinuousBatch | None = None
        self.max_pages = 0
        """The pages of the pool (continuous batching; 0 otherwise)."""
        if self.continuous:
            pages_per_seq = -(-self.max_seq_len // page_size)
            per_token = sum(
                x.dtype.itemsize * math.prod(ax.size for ax in x.axes if ax.name not in ("batch", CACHE_POSITION))
                for x in (template.keys, template.values)
            )
            self.kv_bytes_per_token = per_token
            """Bytes of keys and values one token takes in the cache (every layer)."""
            if kv_cache_bytes is not None:
                max_pages = kv_cache_bytes // (per_token * page_size)
                if max_pages < 1:
                    raise ValueError(
                        f"kv_cache_bytes: {kv_cache_bytes} bytes hold no page of {page_size} tokens "
                        f"({per_token * page_size} bytes)"
                    )
            self.max_pages = int(max_pages if max_pages is not None else max_batch_size * pages_per_seq)
            self._batch = _ContinuousBatch(self, template)

    def update_weights(self, model: Any) -> None:
        """Replace the weights of this engine by ``model``'s, without compiling anything again.

        ``model`` must have the engine model's structure (configuration and parameter names), shapes and
        dtypes; its arrays are placed like the current ones (same devices and shardings), so the compiled prefill
        and decode programs are reused. A static batch already running finishes on the weights it started with;
        in a continuous batch, the next step uses the new weights (requests in flight keep the keys and values
        they have cached). The prefix cache is reset. Safe to call from another thread than the one generating.

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
        self.model = model  # one reference swap: a running static batch holds the old model
        self.weights_version += 1
        self.reset_prefix_cache()  # cached pages hold keys and values of the old weights

    def reset_prefix_cache(self) -> None:
        """Forget the cached prompt prefixes (pages still used by running requests stay theirs until they end).

        Takes effect before the next step of the continuous batch; a no-op for static batches.
        """
        if self._batch is not None:
            self._batch.reset_prefix_cache()

    @property
    def prefix_cache_hits(self) -> int:
        """Cache pages reused from the prefix cache so far (``page_size`` prompt tokens not prefilled each)."""
        return 0 if self._batch is None else self._batch.pool.hits

    @property
    def kv_pages_in_use(self) -> int:
        """Cache pages referenced by running requests now (continuous batching; 0 otherwise)."""
        return 0 if self._batch is None else self._batch.pool.in_use

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
        if self._batch is not None:
            seqs = [
                self._sequence(f"prompts[{i}]", ids, c, i, on_token, None, None)
                for i, (ids, c) in enumerate(zip(encoded, configs, strict=True))
            ]
            for seq in seqs:
                self._batch.submit(seq)
            while any(seq.completion is None for seq in seqs):
                self._batch.step()
            return [cast(Completion, seq.completion) for seq in seqs]
        results: list[Completion | None] = [None] * len(prompts)
        order = sorted(range(len(prompts)), key=lambda i: len(encoded[i]))
        for start in range(0, len(order), self.max_batch_size):
            chunk = order[start : start + self.max_batch_size]
            done = self._generate_batch([encoded[i] for i in chunk], [configs[i] for i in chunk], chunk, on_token)
            for i, completion in zip(chunk, done, strict=True):
                results[i] = completion
        return [r for r in results if r is not None]

    def submit(
        self,
        prompt: str | Sequence[int],
        config: GenerationConfig | None = None,
        *,
        on_done: Callable[[Completion], None],
        on_token: TokenCallback | None = None,
        cancelled: threading.Event | None = None,
        index: int = 0,
    ) -> None:
        """Queue one request on the continuous batch; it joins the running sequences at the next :meth:`step`.

        Whoever drives the batch calls :meth:`step` while :attr:`busy` (e.g. the server's scheduler thread);
        ``on_token(index, ...)`` and then ``on_done(completion)`` are called from inside :meth:`step`. When
        ``cancelled`` is set, the request leaves at the next step (``on_done`` still gets what it generated).

        Raises:
            ValueError: for static batches (``continuous=False``), or a prompt :meth:`generate` refuses.
        """
        if self._batch is None:
            raise ValueError("submit: needs continuous batching (Engine(..., continuous=True))")
        config = config or GenerationConfig()
        if self.tokenizer is None and config.stop_strings:
            raise ValueError("stop_strings: need a tokenizer (Engine(model, tokenizer))")
        ids = self.encode(prompt)
        if not ids:
            raise ValueError("prompt: empty (a prompt needs at least one token)")
        if len(ids) >= self.max_seq_len:
            raise ValueError(f"prompt: {len(ids)} tokens; the engine's max_seq_len is {self.max_seq_len}")
        self._batch.submit(self._sequence("prompt", ids, config, index, on_token, on_done, cancelled))

    def step(self) -> None:
        """Run one step of the continuous batch (admit waiting requests, feed every busy slot, sample)."""
        if self._batch is not None:
            self._batch.step()

    def abort(self) -> None:
        """Drop every request of the continuous batch (running or waiting), without calling their callbacks."""
        if self._batch is not None:
            self._batch.abort()

    @property
    def waiting(self) -> int:
        """Requests of the continuous batch waiting for a slot (0 for static batches)."""
        return 0 if self._batch is None else len(self._batch._waiting)

    @property
    def busy(self) -> bool:
        """Whether the continuous batch has requests running or waiting."""
        return self._batch is not None and self._batch.busy

    def _sequence(
        self,
        name: str,
        ids: list[int],
        config: GenerationConfig,
        index: int,
        on_token: TokenCallback | None,
        on_done: Callable[[Completion], None] | None,
        cancelled: threading.Event | None,
    ) -> _Sequence:
        budget = min(config.max_new_tokens, self.max_seq_len - len(ids))
        pages = -(-(len(ids) + budget) // self.page_size)
        if pages > self.max_pages:
            raise ValueError(
                f"{name}: {len(ids)} tokens and {budget} new ones need {pages} cache pages; the pool has "
                f"max_pages={self.max_pages}"
            )
        return _Sequence(
            index=index,
            prompt=ids,
            config=config,
            budget=budget,
            stream=TextStream(self.tokenizer, config.stop_strings),
            on_token=on_token,
            on_done=on_done,
            cancelled=cancelled,
            hashes=prefix_hashes(ids, self.page_size) if self.prefix_caching else [],
        )

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


@dataclasses.dataclass(eq=False)
class _Sequence:
    """One request in the continuous batch (host state)."""

    index: int
    prompt: list[int]
    config: GenerationConfig
    budget: int
    stream: TextStream
    on_token: TokenCallback | None
    on_done: Callable[[Completion], None] | None
    cancelled: threading.Event | None
    hashes: list[int]
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    finish: FinishReason | None = None
    pages: list[int] = dataclasses.field(default_factory=list)
    cached: int = 0  # positions whose keys and values are in ``pages``
    registered: int = 0  # leading prompt pages offered to the prefix cache
    admitted: int = -1  # admission order (the youngest is preempted first)
    completion: Completion | None = None

    def token_at(self, start: int, stop: int) -> list[int]:
        n = len(self.prompt)
        if stop <= n:
            return self.prompt[start:stop]
        return (self.prompt + self.tokens)[start:stop]

    @property
    def length(self) -> int:
        return len(self.prompt) + len(self.tokens)


class _ContinuousBatch:
    """The host side of continuous batching: slots, pages, the prefix cache and one compiled step per bucket.

    Each :meth:`step` feeds every busy slot either its last generated token or (oldest first, ``prefill_chunk``
    prompt tokens per step in all) its next chunk of prompt tokens, in one compiled call whose rows are the tokens
    fed (a power of two, at least 8) over the pages their slots own (``seq_page``: the power of two holding the
    most pages a slot owns, at least 64 tokens' worth); slots that finished their prompt sample their next token.
    Waiting sequences take free slots between steps, finished ones leave. While every busy slot decodes, one call
    may run several decode steps (:meth:`_block`, :func:`_paged_steps`).
    """

    def __init__(self, engine: Engine, template: Any) -> None:
        self.engine = engine
        self.page_size = engine.page_size
        self.pages_per_seq = -(-engine.max_seq_len // self.page_size)
        self.slots = math.ceil(engine.max_batch_size / engine._batch_shards) * engine._batch_shards
        self.pool = PagePool(engine.max_pages, prefix_caching=engine.prefix_caching)
        self.template = template
        self._kv: Any = None  # the device pool, made at the first step
        self._slot: list[_Sequence | None] = [None] * self.slots
        self._waiting: collections.deque[_Sequence] = collections.deque()
        self._lock = threading.Lock()  # guards _waiting and the reset flag (submit may come from other threads)
        self._step_lock = threading.Lock()  # one step at a time
        self._reset_requested = False
        self._keys: dict[int, np.ndarray] = {}  # seed -> raw PRNG key
        self._admitted = 0
        self.steps = 0
        """Steps run so far (a call of several decode steps counts each)."""
        self.calls = 0
        """Compiled calls run so far (at most :attr:`steps`: a call may run several decode steps)."""
        self.fallbacks = 0
        """Calls that could have run several decode steps but ran one: the free pages could not cover more."""
        self.peak_pages = 0
        """The most pages referenced at once so far."""
        self.page_token_steps = 0
        """Sum over steps of the page slots held (pages in use x ``page_size``): with :attr:`cached_token_steps`, the
        time-averaged cache slots per token in flight."""
        self.cached_token_steps = 0
        """Sum over steps of the tokens whose keys and values are cached (prompt and generated, all sequences)."""
        self.preemptions = 0
        """Sequences that gave their pages back to let older ones go on (they recompute them later)."""

    @property
    def busy(self) -> bool:
        """Whether a sequence is running or waiting."""
        return bool(self._waiting) or any(s is not None for s in self._slot)

    def submit(self, seq: _Sequence) -> None:
        with self._lock:
            self._waiting.append(seq)

    def abort(self) -> None:
        with self._step_lock, self._lock:
            for slot, seq in enumerate(self._slot):
                if seq is not None:
                    for page in seq.pages:
                        self.pool.release(page)
                    self._slot[slot] = None
            self._waiting.clear()
            self._kv = None  # a failed step may have consumed the donated pool
            self.pool = PagePool(self.engine.max_pages, prefix_caching=self.engine.prefix_caching)

    def reset_prefix_cache(self) -> None:
        with self._lock:
            self._reset_requested = True

    def _device_pool(self) -> Any:
        if self._kv is None:
            with self.engine._on_mesh():
                keys, values = (
                    tuple(ax for ax in x.axes if ax.name not in ("batch", CACHE_POSITION))
                    for x in (self.template.keys, self.template.values)
                )
                dtype = self.template.keys.dtype
                self._kv = _NEW_POOL(keys[:-1], keys[-1], values[-1], dtype, self.engine.max_pages, self.page_size)
        return self._kv

    def _finish(self, slot: int | None, seq: _Sequence) -> None:
        for page in seq.pages:
            self.pool.release(page)
        seq.pages = []
        if slot is not None:
            self._slot[slot] = None
        seq.completion = Completion(
            prompt_tokens=list(seq.prompt),
            tokens=seq.tokens,
            text=seq.stream.text,
            logprobs=seq.logprobs if seq.config.logprobs else None,
            finish_reason=seq.finish or "length",
        )
        if seq.on_done is not None:
            seq.on_done(seq.completion)

    def _preempt(self, slot: int) -> None:
        """Give a running sequence's pages back and queue it first: it recomputes its tokens when it returns."""
        seq = self._slot[slot]
        assert seq is not None
        for page in seq.pages:
            self.pool.release(page)
        seq.pages, seq.cached, seq.registered = [], 0, 0
        self._slot[slot] = None
        self.preemptions += 1
        with self._lock:
            self._waiting.appendleft(seq)

    def _admit(self) -> None:
        with self._lock:
            if self._reset_requested:
                self.pool.reset_prefix_cache()
                self._reset_requested = False
            while self._waiting and None in self._slot:
                seq = self._waiting[0]
                if seq.cancelled is not None and seq.cancelled.is_set():
                    self._waiting.popleft()
                    seq.finish = seq.finish or "length"
                    self._finish(None, seq)
                    continue
                # pages of the prompt's prefix already cached (never its last token: its logits are needed)
                usable = min(len(seq.hashes), (seq.length - 1) // self.page_size)
                first = min(seq.length, self.engine.prefill_chunk)
                if self.pool.available < -(-first // self.page_size):
                    break
                self._waiting.popleft()
                seq.pages = self.pool.lookup(seq.hashes[:usable])
                seq.cached = len(seq.pages) * self.page_size
                seq.registered = len(seq.pages)
                if seq.admitted < 0:  # a preempted sequence keeps its age (it does not become the next victim)
                    seq.admitted = self._admitted
                    self._admitted += 1
                self._slot[self._slot.index(None)] = seq

    def _plan(self) -> dict[int, int]:
        """How many tokens each busy slot feeds this step, with the pages they need allocated.

        Oldest first: a decoding slot feeds its last token; slots still in their prompt share ``prefill_chunk``
        prompt tokens (a slot left without any waits for the next step). When the pool runs out, the youngest
        sequence is preempted.
        """
        feeds: dict[int, int] = {}
        busy = {s: seq for s, seq in enumerate(self._slot) if seq is not None}
        budget = self.engine.prefill_chunk
        for slot in sorted(busy, key=lambda s: busy[s].admitted):
            seq = self._slot[slot]
            if seq is None:  # preempted by an older one
                continue
            if seq.cancelled is not None and seq.cancelled.is_set():
                seq.finish = seq.finish or "length"
                self._finish(slot, seq)
                continue
            left = seq.length - seq.cached
            n = 1 if left == 1 else min(left, budget)
            if n < 1:
                continue
            needed = (seq.cached + n - 1) // self.page_size + 1
            while len(seq.pages) < needed:
                page = self.pool.allocate()
                if page is not None:
                    seq.pages.append(page)
                    continue
                victims = [s for s, other in enumerate(self._slot) if other is not None and s not in feeds]
                victim = max(victims, key=lambda s: cast(_Sequence, self._slot[s]).admitted)
                self._preempt(victim)
                if victim == slot:
                    break
            if self._slot[slot] is seq:
                feeds[slot] = n
                if left > 1:
                    budget -= n
        self.peak_pages = max(self.peak_pages, self.pool.in_use)
        return feeds

    def step(self) -> None:
        """Admit waiting sequences, run one compiled step over the busy slots, and hand out the sampled tokens.

        The step's rows are tokens, not slots: every token fed (a decoding slot's last one, a prompt chunk's) is
        one row with its own position and its slot's page table, so a step costs the tokens it feeds. Each row
        writes its keys and values into its slot's pages before any row attends, so a prompt chunk's tokens see
        each other (causally, by position) as well as the pages cached before.
        """
        with self._step_lock:
            self._admit()
            feeds = self._plan()
            if not feeds:
                return
            n_steps = self._block(feeds)
            if n_steps > 1:
                self._run_block(feeds, n_steps)
                return
            total = sum(feeds.values())
            rows = max(_pow2(total), _MIN_ROWS)
            rows = math.ceil(rows / self.engine._batch_shards) * self.engine._batch_shards
            most_pages = max(len(cast(_Sequence, self._slot[s]).pages) for s in feeds)
            seq_pages = min(max(_pow2(most_pages), _MIN_GATHER // self.page_size), self.pages_per_seq)
            tokens = np.zeros((rows, 1), np.int32)
            pos = np.zeros((rows, 1), np.int32)
            write = np.zeros((rows, 1), bool)
            table = np.zeros((rows, seq_pages), np.int32)
            steps = np.zeros((rows,), np.int32)
            configs: list[GenerationConfig | None] = [None] * rows
            sample_row: dict[int, int] = {}  # slot -> the row whose logits give its next token
            row = 0
            for slot, n in feeds.items():
                seq = self._slot[slot]
                assert seq is not None
                tokens[row : row + n, 0] = seq.token_at(seq.cached, seq.cached + n)
                pos[row : row + n, 0] = np.arange(seq.cached, seq.cached + n)
                write[row : row + n, 0] = True
                table[row : row + n, : len(seq.pages)] = seq.pages
                steps[row + n - 1] = len(seq.tokens)
                configs[row + n - 1] = seq.config
                sample_row[slot] = row + n - 1
                row += n
            Batch, Pos = Axis("batch", rows), Axis("position", 1)
            with self.engine._on_mesh():
                self._kv, new_tokens, new_logprobs = _PAGED_STEP(
                    self.engine.model,
                    self._device_pool(),
                    hax.named(jnp.asarray(tokens), (Batch, Pos)),
                    hax.named(jnp.asarray(pos), (Batch, Pos)),
                    hax.named(jnp.asarray(write), (Batch, Pos)),
                    hax.named(jnp.asarray(table), (Batch, Axis("seq_page", seq_pages))),
                    jnp.zeros((rows,), jnp.int32),
                    self._params(configs),
                    jnp.asarray(steps),
                    self.engine.vocab_size,
                )
            self.steps += 1
            self.calls += 1
            self.page_token_steps += self.pool.in_use * self.page_size
            self.cached_token_steps += sum(cast(_Sequence, self._slot[s]).cached + n for s, n in feeds.items()) + sum(
                seq.cached for s, seq in enumerate(self._slot) if seq is not None and s not in feeds
            )
            host_tokens, host_logprobs = (np.asarray(a) for a in jax.device_get((new_tokens, new_logprobs)))
            for slot, n in feeds.items():
                seq = self._slot[slot]
                assert seq is not None
                seq.cached += n
                full = min(seq.cached, len(seq.prompt)) // self.page_size
                while seq.registered < min(full, len(seq.hashes)):
                    self.pool.register(seq.hashes[seq.registered], seq.pages[seq.registered])
                    seq.registered += 1
                if seq.cached < seq.length:
                    continue  # the prompt goes on in the next step
                r = sample_row[slot]
                self._take(seq, int(host_tokens[r]), float(host_logprobs[r]))
                if seq.finish is not None:
                    self._finish(slot, seq)

    def _block(self, feeds: dict[int, int]) -> int:
        """How many decode steps this call runs (1: the mixed step above), with the pages they need allocated.

        Several only when every busy slot decodes (feeds the last token of its sequence, no prompt chunk) and no
        waiting sequence could take a free slot, every sequence has at least ``steps_per_call`` tokens of budget left
        (none runs past it, and one that ends by length frees its slot with the block) and the free pages hold every
        row's next ``steps_per_call`` tokens (they are taken now): then ``steps_per_call`` steps. Never preempts:
        without pages, one step (:attr:`fallbacks`)."""
        most = self.engine.steps_per_call
        if most < 2:
            return 1
        seqs = [cast(_Sequence, self._slot[s]) for s in feeds]
        if len(feeds) != sum(seq is not None for seq in self._slot):
            return 1  # a slot waits for prompt budget
        if any(seq.cached != seq.length - 1 for seq in seqs):
            return 1  # a prompt chunk
        with self._lock:
            if self._waiting and None in self._slot:
                return 1  # a waiting sequence lacks pages: let finished ones free them at every step
        # one program per bucket: steps_per_call steps or one. No row runs past its budget, so a sequence that ends
        # by length ends with the block and its slot is free for the next call.
        if min(seq.budget - len(seq.tokens) for seq in seqs) < most:
            return 1
        needed = [(seq.cached + most - 1) // self.page_size + 1 - len(seq.pages) for seq in seqs]
        if sum(max(n, 0) for n in needed) > self.pool.available:
            self.fallbacks += 1
            return 1
        for seq, n in zip(seqs, needed, strict=True):
            for _ in range(n):
                seq.pages.append(cast(int, self.pool.allocate()))
        self.peak_pages = max(self.peak_pages, self.pool.in_use)
        return most

    def _run_block(self, feeds: dict[int, int], n_steps: int) -> None:
        """``n_steps`` decode steps of the decoding slots in one compiled call; the host then takes each row's tokens
        in order (the 1-step order: step by step, slot by slot) until it finishes, and drops the rest."""
        slots = list(feeds)
        rows = max(_pow2(len(slots)), _MIN_ROWS)
        rows = math.ceil(rows / self.engine._batch_shards) * self.engine._batch_shards
        seqs = [cast(_Sequence, self._slot[s]) for s in slots]
        most_pages = max(len(seq.pages) for seq in seqs)
        seq_pages = min(max(_pow2(most_pages), _MIN_GATHER // self.page_size), self.pages_per_seq)
        tokens = np.zeros((rows,), np.int32)
        pos = np.zeros((rows,), np.int32)
        left = np.zeros((rows,), np.int32)  # steps whose keys and values a row stores (0: a padding row)
        table = np.zeros((rows, seq_pages), np.int32)
        steps = np.zeros((rows,), np.int32)
        configs: list[GenerationConfig | None] = [None] * rows
        for r, seq in enumerate(seqs):
            tokens[r] = seq.token_at(seq.cached, seq.cached + 1)[0]
            pos[r] = seq.cached
            left[r] = min(n_steps, seq.budget - len(seq.tokens))
            table[r, : len(seq.pages)] = seq.pages
            steps[r] = len(seq.tokens)
            configs[r] = seq.config
        with self.engine._on_mesh():
            self._kv, new_tokens, new_logprobs = _PAGED_STEPS(
                self.engine.model,
                self._device_pool(),
                jnp.asarray(tokens),
                jnp.asarray(pos),
                hax.named(jnp.asarray(table), (Axis("batch", rows), Axis("seq_page", seq_pages))),
                jnp.asarray(left),
                self._params(configs),
                jnp.asarray(steps),
                n_steps,
                self.engine.max_seq_len - 1,
                self.engine.vocab_size,
            )
        self.steps += n_steps
        self.calls += 1
        self.page_token_steps += self.pool.in_use * self.page_size * n_steps
        self.cached_token_steps += sum(
            (seq.cached + 1) * n_steps + n_steps * (n_steps - 1) // 2 for seq in self._slot if seq is not None
        )
        host_tokens, host_logprobs = (np.asarray(a) for a in jax.device_get((new_tokens, new_logprobs)))
        for seq in seqs:
            seq.cached += n_steps  # a sequence that finishes before gives its pages back anyway
            full = min(seq.cached, len(seq.prompt)) // self.page_size
            while seq.registered < min(full, len(seq.hashes)):
                self.pool.register(seq.hashes[seq.registered], seq.pages[seq.registered])
                seq.registered += 1
        for j in range(n_steps):
            for r, (slot, seq) in enumerate(zip(slots, seqs, strict=True)):
                if seq.finish is not None:
                    continue
                self._take(seq, int(host_tokens[j, r]), float(host_logprobs[j, r]))
                if seq.finish is not None:
                    self._finish(slot, seq)

    def _params(self, configs: list[GenerationConfig | None]) -> SamplingParams:
        """The rows' sampling settings, built on the host (each config's PRNG key computed once, not per step).

        A call whose rows are all greedy compiles without the random draw (on a CPU the draw over the vocabulary cost
        about 40 % of a decode step of a small model): at most two programs per bucket, greedy and sampled."""
        return SamplingParams.of(configs, key=self._key)

    def _key(self, seed: int) -> np.ndarray:
        key = self._keys.get(seed)
        if key is None:
            key = self._keys[seed] = np.asarray(jax.random.PRNGKey(seed), np.uint32)
            if len(self._keys) > 4096:
                self._keys.pop(next(iter(self._keys)))
        return key

    def _take(self, seq: _Sequence, token: int, logprob: float) -> None:
        seq.tokens.append(token)
        seq.logprobs.append(logprob)
        is_stop_token = token in seq.config.stop_token_ids
        last = is_stop_token or len(seq.tokens) >= seq.budget
        delta = seq.stream.push(None if is_stop_token else token, final=last)
        if is_stop_token or seq.stream.stopped:
            seq.finish = "stop"
        elif last:
            seq.finish = "length"
        if seq.on_token is not None and not (seq.cancelled is not None and seq.cancelled.is_set()):
            seq.on_token(seq.index, token, delta, logprob)


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _new_pool(
    leading: tuple[Axis, ...], HeadSize: Axis, ValueSize: Axis, dtype: Any, pages: int, page_size: int
) -> Any:
    """The zero page pool of a model (compiled, so a mesh places it sharded); values may end in another axis than the
    keys (DeepSeek-V3's latent cache)."""
    cache = PagedKvCache.init(leading, HeadSize, pages=pages, page_size=page_size, dtype=dtype, ValueSize=ValueSize)
    return hax.auto_sharded(cache)


def _paged_step(
    model: Any,
    pool: Any,
    tokens: NamedArray,
    pos_ids: NamedArray,
    write: NamedArray,
    table: NamedArray,
    last: jax.Array,
    params: SamplingParams,
    steps: jax.Array,
    vocab_size: int,
) -> tuple[Any, jax.Array, jax.Array]:
    """One step of the continuous batch: each row's tokens over its pages, then a token sampled at its last one."""
    Batch = tokens.resolve_axis("batch")
    cache = pool.with_pages(table, write)
    logits, cache = model.decode(tokens, cache, pos_ids, logits_at=hax.named(last, Batch))
    final = logits.rearrange((Batch, model.Vocab)).array
    new_tokens, logprobs = sample_next(_only_real_ids(final, vocab_size), params, steps)
    return PagedKvCache(cache.keys, cache.values), new_tokens, logprobs


def _paged_steps(
    model: Any,
    pool: Any,
    tokens: jax.Array,
    pos: jax.Array,
    table: NamedArray,
    left: jax.Array,
    params: SamplingParams,
    steps: jax.Array,
    n_steps: int,
    max_pos: int,
    vocab_size: int,
) -> tuple[Any, jax.Array, jax.Array]:
    """``n_steps`` decode steps of the continuous batch in one loop: each row feeds its last token at its position,
    stores its keys and values in its pages (only its first ``left`` steps: later ones are past its budget) and
    samples the next token (draw index ``steps``, then one more each step), which it feeds at the next position.

    Returns:
        ``(pool, tokens (n_steps, rows), logprobs (n_steps, rows))``.
    """
    Batch, Pos = table.resolve_axis("batch"), Axis("position", 1)
    first = hax.named(jnp.zeros((Batch.size,), jnp.int32), Batch)

    def step(
        carry: tuple[Any, jax.Array, jax.Array, jax.Array], j: jax.Array
    ) -> tuple[tuple[Any, jax.Array, jax.Array, jax.Array], tuple[jax.Array, jax.Array]]:
        pool, tokens, pos, steps = carry
        cache = pool.with_pages(table, hax.named((j < left)[:, None], (Batch, Pos)))
        logits, cache = model.decode(
            hax.named(tokens[:, None], (Batch, Pos)),
            cache,
            hax.named(jnp.minimum(pos, max_pos)[:, None], (Batch, Pos)),
            logits_at=first,
        )
        final = logits.rearrange((Batch, model.Vocab)).array
        new_tokens, logprobs = sample_next(_only_real_ids(final, vocab_size), params, steps)
        return (PagedKvCache(cache.keys, cache.values), new_tokens, pos + 1, steps + 1), (new_tokens, logprobs)

    (pool, _, _, _), (all_tokens, all_logprobs) = jax.lax.scan(
        step, (pool, tokens, pos, steps), jnp.arange(n_steps, dtype=jnp.int32)
    )
    return pool, all_tokens, all_logprobs


_NEW_POOL = named_jit(_new_pool)
_PAGED_STEPS = named_jit(
    _paged_steps, donate_args=(False, True, False, False, False, False, False, False, False, False, False)
)
_PAGED_STEP = named_jit(_paged_step, donate_args=(False, True, False, False, False, False, False, False, False, False))


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
