"""The key/value cache: prefill + one-token decode steps equal the full forward pass, for every architecture, and
greedy decoding through the cache equals transformers' ``generate``."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import parity_support
import pytest
import torch
import transformers

import ponente.namedtensor as hax
from ponente.models import (
    Gemma2Config,
    Gemma3Config,
    GemmaConfig,
    Gpt2Config,
    LlamaConfig,
    LmHeadModel,
    LoraConfig,
    MistralConfig,
    MixtralConfig,
    Olmo2Config,
    Qwen3Config,
    QwenConfig,
    RotaryConfig,
)
from ponente.models.attention.kv_cache import CACHE_POSITION, KvCache, cached_attention
from ponente.models.lora import loraize
from ponente.namedtensor.nn import BlockSeq

TOL = 1e-5
VOCAB = hax.Axis("vocab", 53)
Batch = hax.Axis("batch", 2)
SLIDE = ("sliding_attention", "full_attention")
_SIZES: dict[str, Any] = {"seq_len": 16, "hidden_dim": 32, "intermediate_dim": 48, "num_layers": 2, "num_heads": 4}

# one tiny config per architecture and per attention path (GQA, MQA, windows shorter than the sequences, local/global
# layers, soft caps, MoE, learned positions, a padded vocabulary)
CONFIGS: dict[str, Callable[[], Any]] = {
    "gpt2": lambda: Gpt2Config(**_SIZES, num_kv_heads=4, initializer_range=0.5, scale_attn_by_inverse_layer_idx=True),
    "llama": lambda: LlamaConfig(**_SIZES, num_kv_heads=2, initializer_range=0.5, vocab_padding_multiple=16),
    "llama-mqa-yarn": lambda: LlamaConfig(
        **_SIZES,
        num_kv_heads=1,
        initializer_range=0.5,
        rope=RotaryConfig(rope_type="yarn", factor=2.0, original_max_position_embeddings=8),
    ),
    "mistral": lambda: MistralConfig(**_SIZES, num_kv_heads=2, sliding_window=4, initializer_range=0.5),
    "mixtral": lambda: MixtralConfig(
        **_SIZES, num_kv_heads=2, num_experts=4, num_experts_per_tok=2, sliding_window=5, initializer_range=0.5
    ),
    "qwen": lambda: QwenConfig(**_SIZES, num_kv_heads=2, sliding_window=None, initializer_range=0.5),
    "qwen-sliding": lambda: QwenConfig(
        **_SIZES, num_kv_heads=2, sliding_window=3, layer_types=SLIDE, initializer_range=0.5
    ),
    "qwen3": lambda: Qwen3Config(**_SIZES, num_kv_heads=2, head_dim=8, initializer_range=0.5),
    "olmo2": lambda: Olmo2Config(**_SIZES, num_kv_heads=2, initializer_range=0.5),
    "gemma": lambda: GemmaConfig(**_SIZES, num_kv_heads=1, head_dim=8, initializer_range=0.5),
    "gemma2": lambda: Gemma2Config(
        **_SIZES, num_kv_heads=2, head_dim=8, sliding_window=4, attn_logit_softcapping=2.0, initializer_range=0.5
    ),
    "gemma3": lambda: Gemma3Config(
        **_SIZES, num_kv_heads=2, head_dim=8, sliding_window=4, layer_types=SLIDE, initializer_range=0.5
    ),
}

PROMPT_LENGTHS = (6, 3)  # right-padded to 6: the second row's padding writes slots 3..5 with garbage
TOTAL = 13  # tokens per row after the decode steps (prompt + generated)


@functools.cache
def _build(name: str) -> LmHeadModel:
    model: LmHeadModel = CONFIGS[name]().build(VOCAB, key=jax.random.key(0))
    return model


def _named(a: np.ndarray, axes: tuple[str, ...] = ("batch", "position")) -> hax.NamedArray:
    return hax.named(jnp.asarray(a, dtype=jnp.int32), axes)


@eqx.filter_jit
def _full(model: LmHeadModel, tokens: hax.NamedArray) -> hax.NamedArray:
    return model(tokens)


@eqx.filter_jit
def _decode(
    model: LmHeadModel, tokens: hax.NamedArray, cache: KvCache, pos_ids: hax.NamedArray
) -> tuple[hax.NamedArray, KvCache]:
    return model.decode(tokens, cache, pos_ids)


def _cached_logits(
    model: LmHeadModel, rows: np.ndarray, lengths: tuple[int, ...], max_len: int, *, prefill: bool = True
) -> list[np.ndarray]:
    """Per row, the logits of positions ``0 .. TOTAL - 1``: a right-padded prefill, then one token per step.

    ``rows`` holds every row's whole sequence; prompts are its first ``lengths[b]`` tokens, the rest is fed back one
    token per step (teacher forcing), each row at its own position. ``prefill``: mark the cache for the prefill
    (``KvCache.for_prefill``, as the engine does), else the prompt attends over the cache's slots like any step.
    """
    width = max(lengths)
    prompt = rows[:, :width].copy()
    for b, n in enumerate(lengths):
        prompt[b, n:] = 1 + b  # padding tokens (garbage the cache must never show)
    cache = model.init_cache(Batch, max_len).for_prefill(prefill)
    logits, cache = _decode(model, _named(prompt), cache, _named(np.tile(np.arange(width), (len(lengths), 1))))
    assert not cache.prefill  # decode returns the cache ready for one-token steps
    out = [[np.asarray(logits.array[b, i]) for i in range(n)] for b, n in enumerate(lengths)]
    lengths_now = np.array(lengths)
    while lengths_now.min() < TOTAL:
        pos = np.minimum(lengths_now, TOTAL - 1)
        tokens = rows[np.arange(len(lengths)), pos][:, None]
        logits, cache = _decode(model, _named(tokens), cache, _named(pos[:, None]))
        for b in range(len(lengths)):
            if lengths_now[b] < TOTAL:
                out[b].append(np.asarray(logits.array[b, 0]))
        lengths_now = lengths_now + 1
    return [np.stack(o) for o in out]


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_prefill_and_decode_equal_the_full_forward(name: str) -> None:
    model = _build(name)
    rows = np.random.RandomState(0).randint(3, VOCAB.size, size=(Batch.size, TOTAL))
    full = np.asarray(_full(model, _named(rows)).array)
    cached = _cached_logits(model, rows, PROMPT_LENGTHS, max_len=16)
    for b in range(Batch.size):
        np.testing.assert_allclose(cached[b], full[b], atol=TOL, rtol=0, err_msg=f"{name}, row {b}")


@pytest.mark.parametrize("name", ["gpt2", "gemma3", "llama", "qwen-sliding"])
def test_unmarked_prefill_attends_over_the_slots_like_the_forward(name: str) -> None:
    model = _build(name)
    rows = np.random.RandomState(5).randint(3, VOCAB.size, size=(Batch.size, TOTAL))
    full = np.asarray(_full(model, _named(rows)).array)
    cached = _cached_logits(model, rows, PROMPT_LENGTHS, max_len=16, prefill=False)
    for b in range(Batch.size):
        np.testing.assert_allclose(cached[b], full[b], atol=TOL, rtol=0, err_msg=f"{name}, row {b}")


@pytest.mark.parametrize("name", ["gemma3", "gpt2", "mistral"])
def test_prefill_through_the_flash_backend_equals_the_full_forward(name: str) -> None:
    # the prefill attends with the forward's backend: blockwise flash here (tiles of 2, windows, local/global layers)
    config = dataclasses.replace(CONFIGS[name](), attn_backend="flash", flash_attention_block_size=2)
    model = config.build(VOCAB, key=jax.random.key(0))
    rows = np.random.RandomState(6).randint(3, VOCAB.size, size=(Batch.size, TOTAL))
    full = np.asarray(_full(_build(name), _named(rows)).array)  # the reference backend's forward
    cached = _cached_logits(model, rows, PROMPT_LENGTHS, max_len=16)
    for b in range(Batch.size):
        np.testing.assert_allclose(cached[b], full[b], atol=TOL, rtol=0, err_msg=f"{name}, row {b}")


def test_marked_prefill_reads_only_the_slots_it_writes() -> None:
    # NaN in every slot: attending over the slots (even masked ones, as weight 0 * NaN) poisons the logits; the
    # marked prefill attends over the keys it has just written and never reads the others
    model = _build("llama")
    rows = np.random.RandomState(7).randint(3, VOCAB.size, size=(Batch.size, 6))
    empty = model.init_cache(Batch, 16)
    poisoned = KvCache(empty.keys, hax.full_like(empty.values, jnp.nan))
    pos = _named(np.tile(np.arange(6), (Batch.size, 1)))
    marked, cache = _decode(model, _named(rows), poisoned.for_prefill(), pos)
    np.testing.assert_allclose(
        np.asarray(marked.array), np.asarray(_full(model, _named(rows)).array), atol=TOL, rtol=0
    )
    assert np.isnan(np.asarray(cache.values.array[:, :, :, 6:])).all()  # the other slots were left alone
    unmarked, _ = _decode(model, _named(rows), poisoned, pos)
    assert np.isnan(np.asarray(unmarked.array)[..., : VOCAB.size]).all()  # (padded vocabulary entries are masked)


@pytest.mark.parametrize("name", ["gemma2", "gpt2", "mixtral"])
def test_logits_at_gives_each_rows_chosen_position(name: str) -> None:
    model = _build(name)
    rows = np.random.RandomState(8).randint(3, VOCAB.size, size=(Batch.size, 6))
    pos = _named(np.tile(np.arange(6), (Batch.size, 1)))
    cache = model.init_cache(Batch, 8).for_prefill()
    at = hax.named(jnp.array([5, 2]), "batch")
    chosen, chosen_cache = eqx.filter_jit(lambda m, c: m.decode(_named(rows), c, pos, logits_at=at))(model, cache)
    every, every_cache = _decode(model, _named(rows), cache, pos)
    assert chosen.axis_names == ("batch", "vocab")
    np.testing.assert_allclose(np.asarray(chosen.array), np.asarray(every.array)[[0, 1], [5, 2]], atol=TOL, rtol=0)
    np.testing.assert_array_equal(np.asarray(chosen_cache.keys.array), np.asarray(every_cache.keys.array))


def test_prefill_longer_than_the_cache_is_refused() -> None:
    model = _build("llama")
    with pytest.raises(ValueError, match="decode_attention: a prefill of 6 tokens does not fit 4 cache slots"):
        _decode(
            model, _named(np.ones((Batch.size, 6))), model.init_cache(Batch, 4).for_prefill(), _named(np.ones((2, 6)))
        )


def test_unrolled_layers_decode_like_stacked() -> None:
    model = _build("qwen-sliding")
    layers = model.transformer.layers  # type: ignore[attr-defined]
    unrolled = eqx.tree_at(lambda m: m.transformer.layers, model, BlockSeq(tuple(layers.unstacked()), layers.Block))
    rows = np.random.RandomState(1).randint(3, VOCAB.size, size=(Batch.size, TOTAL))
    full = np.asarray(_full(model, _named(rows)).array)
    cached = _cached_logits(unrolled, rows, (4, 5), max_len=TOTAL)
    for b in range(Batch.size):
        np.testing.assert_allclose(cached[b], full[b], atol=TOL, rtol=0)


def test_shared_pos_ids_broadcast_over_the_batch() -> None:
    model = _build("llama")
    rows = np.random.RandomState(2).randint(3, VOCAB.size, size=(Batch.size, 5))
    cache = model.init_cache(Batch, 8)
    logits, _ = _decode(model, _named(rows), cache, _named(np.arange(5), ("position",)))
    np.testing.assert_allclose(
        np.asarray(logits.array), np.asarray(_full(model, _named(rows)).array), atol=TOL, rtol=0
    )


def test_lora_adapted_model_decodes_like_its_forward() -> None:
    base = _build("qwen3")
    lora = LoraConfig(r=2, alpha=4.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    model = loraize(base, lora, key=jax.random.key(1))
    # nonzero B, so that the adapters change the logits
    model = jax.tree_util.tree_map(lambda x: x + 0.1 if eqx.is_inexact_array(x) else x, model)
    rows = np.random.RandomState(4).randint(3, VOCAB.size, size=(Batch.size, TOTAL))
    full = np.asarray(_full(model, _named(rows)).array)
    assert not np.allclose(full, np.asarray(_full(base, _named(rows)).array), atol=1e-3)
    cached = _cached_logits(model, rows, (5, 2), max_len=TOTAL)
    for b in range(Batch.size):
        np.testing.assert_allclose(cached[b], full[b], atol=TOL, rtol=0)


def test_init_cache_axes_and_dtype() -> None:
    cache = _build("mixtral").init_cache(Batch, 7, dtype=jnp.bfloat16)
    assert cache.keys.axes == hax.make_axes(layers=2, batch=2, kv_heads=2, cache_position=7, head_size=8)
    assert cache.values.dtype == jnp.bfloat16
    assert cache.max_len == 7
    assert _build("gpt2").init_cache(Batch, 16).keys.axis_names == (
        "layers",
        "batch",
        "heads",
        CACHE_POSITION,
        "head_size",
    )


def test_gpt2_cache_longer_than_its_positions_is_refused() -> None:
    with pytest.raises(ValueError, match="max_len=17 is more than seq_len=16"):
        _build("gpt2").init_cache(Batch, 17)


def test_cache_update_writes_each_row_at_its_positions_and_drops_overflow() -> None:
    B, Pos, H, Hd = hax.make_axes(batch=2, position=2, kv_heads=1, head_size=1)
    cache = KvCache.init((B, H), Hd, max_len=4)
    k = hax.named(jnp.array([[1.0, 2.0], [3.0, 4.0]]).reshape(2, 2, 1, 1), (B, Pos, H, Hd))
    pos = _named(np.array([[0, 1], [3, 4]]))  # row 1's second token is past the cache: dropped
    new = cache.update(k, -k, pos)
    assert new.keys.array[:, 0, :, 0].tolist() == [[1.0, 2.0, 0.0, 0.0], [0.0, 0.0, 0.0, 3.0]]
    assert new.values.array[:, 0, :, 0].tolist() == [[-1.0, -2.0, 0.0, 0.0], [0.0, 0.0, 0.0, -3.0]]


def test_attention_mask_window() -> None:
    cache = KvCache.init(Batch, hax.Axis("head_size", 1), max_len=6)
    mask = cache.attention_mask(_named(np.array([[4], [1]])), window=2)
    assert mask.array[:, 0].astype(int).tolist() == [[0, 0, 0, 1, 1, 0], [1, 1, 0, 0, 0, 0]]


def test_cached_attention_equals_a_numpy_softmax() -> None:
    rng = np.random.RandomState(3)
    B, Pos, H, Hd = hax.make_axes(batch=1, position=1, kv_heads=1, head_size=4)
    keys, values, q = rng.randn(5, 4), rng.randn(5, 4), rng.randn(4)
    cache = KvCache(
        hax.named(jnp.asarray(keys)[None, None], (B, H, hax.Axis(CACHE_POSITION, 5), Hd)),
        hax.named(jnp.asarray(values)[None, None], (B, H, hax.Axis(CACHE_POSITION, 5), Hd)),
    )
    out = cached_attention(
        Hd, hax.named(jnp.asarray(q)[None, None, None], (B, Pos, H, Hd)), cache, _named(np.array([[3]]))
    )
    scores = keys[:4] @ q / 2.0
    expected = np.exp(scores - scores.max()) / np.exp(scores - scores.max()).sum() @ values[:4]
    np.testing.assert_allclose(np.asarray(out.array).ravel(), expected, atol=1e-6)


def test_update_needs_a_position_axis() -> None:
    cache = KvCache.init(Batch, hax.Axis("head_size", 1), max_len=2)
    with pytest.raises(ValueError, match="pos_ids needs a 'position' axis"):
        cache.update(cache.keys, cache.values, hax.zeros(Batch, dtype=jnp.int32))


def test_model_without_decode_says_so() -> None:
    class NoCache(LmHeadModel):
        config: Any = None

        @property
        def Vocab(self) -> hax.Axis:
            return VOCAB

        def __call__(self, input_ids: Any, attn_mask: Any = None, *, key: Any = None, pos_ids: Any = None) -> Any:
            return input_ids

    with pytest.raises(NotImplementedError, match="NoCache does not implement init_cache"):
        NoCache().init_cache(Batch, 4)


# --- greedy decoding through the cache == transformers' generate ----------------------------------------------------

HF_VOCAB = 61
_HF_SIZES: dict[str, Any] = {
    "vocab_size": HF_VOCAB,
    "max_position_embeddings": 32,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "initializer_range": 0.3,
    "attn_implementation": "eager",
}
HF_MODELS: dict[str, Callable[[], Any]] = {
    "llama": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(**_HF_SIZES)),
    "qwen3": lambda: transformers.Qwen3ForCausalLM(
        transformers.Qwen3Config(
            **_HF_SIZES, head_dim=8, use_sliding_window=True, sliding_window=4, layer_types=list(SLIDE)
        )
    ),
    "gemma2": lambda: transformers.Gemma2ForCausalLM(
        transformers.Gemma2Config(
            **_HF_SIZES,
            head_dim=8,
            sliding_window=4,
            query_pre_attn_scalar=8,
            attn_logit_softcapping=5.0,
            final_logit_softcapping=3.0,
        )
    ),
    "mixtral": lambda: transformers.MixtralForCausalLM(
        transformers.MixtralConfig(**_HF_SIZES, num_local_experts=4, num_experts_per_tok=2)
    ),
    "gpt2": lambda: transformers.GPT2LMHeadModel(
        transformers.GPT2Config(
            vocab_size=HF_VOCAB,
            n_positions=32,
            n_embd=32,
            n_inner=48,
            n_layer=2,
            n_head=4,
            initializer_range=0.3,
            scale_attn_by_inverse_layer_idx=True,
            embd_pdrop=0.0,
            resid_pdrop=0.0,
            attn_pdrop=0.0,
            attn_implementation="eager",
        )
    ),
}
NEW_TOKENS = 12


def _greedy(model: LmHeadModel, prompts: np.ndarray, new_tokens: int) -> np.ndarray:
    """Greedy decoding through the cache: prefill the (equal-length) prompts, then one token per step."""
    B = hax.Axis("batch", prompts.shape[0])
    n = prompts.shape[1]
    cache = model.init_cache(B, n + new_tokens)
    logits, cache = _decode(model, _named(prompts), cache, _named(np.arange(n), ("position",)))
    out = []
    token = np.asarray(jnp.argmax(logits.array[:, -1], axis=-1))
    for step in range(new_tokens):
        out.append(token)
        if step == new_tokens - 1:
            break
        logits, cache = _decode(model, _named(token[:, None]), cache, _named(np.array([n + step]), ("position",)))
        token = np.asarray(jnp.argmax(logits.array[:, 0], axis=-1))
    return np.stack(out, axis=1)


@pytest.mark.parametrize("name", sorted(HF_MODELS))
def test_greedy_decoding_equals_transformers_generate(name: str) -> None:
    torch.manual_seed(0)
    hf = HF_MODELS[name]().eval()
    model = parity_support.port(hf)
    prompts = np.random.RandomState(0).randint(0, HF_VOCAB, size=(2, 5))
    hf.generation_config.eos_token_id = None  # no early stop, and no EOS suppression (min_new_tokens) either
    with torch.no_grad():
        expected = hf.generate(
            torch.tensor(prompts),
            attention_mask=torch.ones(prompts.shape, dtype=torch.long),
            do_sample=False,
            max_new_tokens=NEW_TOKENS,
            pad_token_id=0,
        )[:, prompts.shape[1] :].numpy()
    np.testing.assert_array_equal(_greedy(model, prompts, NEW_TOKENS), expected)


@eqx.filter_jit
def _paged_decode(
    model: LmHeadModel, tokens: hax.NamedArray, cache: Any, pos_ids: hax.NamedArray
) -> tuple[hax.NamedArray, Any]:
    return model.decode(tokens, cache, pos_ids)


@pytest.mark.parametrize("name", ["gemma2", "gpt2", "qwen-sliding"])
def test_paged_cache_in_chunks_equals_the_full_forward(name: str) -> None:
    """Two sequences in a pool of pages of 3 (scattered page tables), fed in chunks of up to 4 tokens, one token per
    row (as a continuous-batching engine feeds them: each row has its own position and its sequence's pages, padding
    rows are not written); every position's logits equal the full forward's."""
    from ponente.models import PagedKvCache

    model = _build(name)
    rows = np.random.RandomState(1).randint(3, VOCAB.size, size=(2, TOTAL))
    full = np.asarray(_full(model, _named(rows)).array)
    pool = PagedKvCache.like(model.init_cache(Batch, 1), pages=12, page_size=3)
    tables = np.array([[7, 2, 10, 0, 5], [1, 11, 3, 8, 4]])  # 5 pages of 3 hold the 13 tokens of each sequence
    done, out = [0, 0], [[], []]
    chunks = [(0, 4), (1, 2)]  # (sequence, tokens) per step, round-robin until both are done
    while min(done) < TOTAL:
        feed = [(s, min(n, TOTAL - done[s])) for s, n in chunks if done[s] < TOTAL]
        width = 8  # rows of the step: the tokens fed, then padding
        tokens, pos = np.zeros((width, 1), np.int32), np.zeros((width, 1), np.int32)
        write, table = np.zeros((width, 1), bool), np.zeros((width, tables.shape[1]), np.int32)
        r = 0
        for s, n in feed:
            tokens[r : r + n, 0] = rows[s, done[s] : done[s] + n]
            pos[r : r + n, 0] = np.arange(done[s], done[s] + n)
            write[r : r + n, 0], table[r : r + n] = True, tables[s]
            r += n
        Rows = hax.Axis("batch", width)
        cache = pool.with_pages(
            hax.named(jnp.asarray(table), (Rows, "seq_page")), hax.named(jnp.asarray(write), (Rows, "position"))
        )
        logits, cache = _paged_decode(model, _named(tokens), cache, _named(pos))
        pool = PagedKvCache(cache.keys, cache.values)
        r = 0
        for s, n in feed:
            out[s].extend(np.asarray(logits.array[r : r + n, 0]))
            done[s] += n
            r += n
    for s in range(2):
        np.testing.assert_allclose(np.stack(out[s]), full[s], atol=TOL * 10, rtol=TOL * 10)


def test_paged_cache_needs_a_page_table_and_valid_sizes() -> None:
    from ponente.models import PagedKvCache

    Hd = hax.Axis("head_size", 2)
    with pytest.raises(ValueError, match="page_size must be >= 1"):
        PagedKvCache.init((), Hd, pages=2, page_size=0)
    with pytest.raises(ValueError, match="pages must be >= 1"):
        PagedKvCache.init((), Hd, pages=0, page_size=2)
    k = hax.ones((Batch, hax.Axis("position", 1), Hd))
    with pytest.raises(ValueError, match="no page table"):
        PagedKvCache.init((), Hd, pages=2, page_size=2).update(k, k, _named(np.zeros((2, 1))))
