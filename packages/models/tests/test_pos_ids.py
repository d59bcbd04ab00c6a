"""Restartable positions (``pos_ids``): a packed row equals its examples run alone, for every architecture."""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ponente.namedtensor as hax
from ponente.models import (
    AttentionMask,
    Gemma2Config,
    Gemma3Config,
    GemmaConfig,
    Gpt2Config,
    Gpt2LMHeadModel,
    LlamaConfig,
    LmExample,
    LmHeadModel,
    MistralConfig,
    MixtralConfig,
    Olmo2Config,
    Qwen3Config,
    QwenConfig,
    RotaryConfig,
    apply_rotary,
    compute_next_token_loss,
)

TOL = 1e-5
VOCAB = hax.Axis("vocab", 53)
LENGTHS = (7, 9)  # two examples packed into one row of 16 positions
SLIDE = ("sliding_attention", "full_attention")
_SIZES: dict[str, Any] = {"seq_len": 16, "hidden_dim": 32, "intermediate_dim": 48, "num_layers": 2, "num_heads": 4}

# one tiny config per architecture (and the variants with their own rotary/mask paths); windows shorter than an
# example, so the sliding mask inside a segment is exercised too
CONFIGS: dict[str, Callable[[], Any]] = {
    "gpt2": lambda: Gpt2Config(**_SIZES, num_kv_heads=4, initializer_range=0.5),
    "llama": lambda: LlamaConfig(**_SIZES, num_kv_heads=2, initializer_range=0.5),
    "llama-flash-yarn": lambda: LlamaConfig(
        **_SIZES,
        num_kv_heads=2,
        initializer_range=0.5,
        attn_backend="flash",
        flash_attention_block_size=4,
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
    "gemma2": lambda: Gemma2Config(**_SIZES, num_kv_heads=2, head_dim=8, sliding_window=4, initializer_range=0.5),
    "gemma3": lambda: Gemma3Config(
        **_SIZES, num_kv_heads=2, head_dim=8, sliding_window=4, layer_types=SLIDE, initializer_range=0.5
    ),
}


ROTARY = sorted(name for name in CONFIGS if name != "gpt2")


@functools.cache
def _build(name: str) -> LmHeadModel:
    model: LmHeadModel = CONFIGS[name]().build(VOCAB, key=jax.random.key(0))
    return model


@pytest.fixture(params=sorted(CONFIGS))
def model(request: pytest.FixtureRequest) -> LmHeadModel:
    return _build(request.param)


@eqx.filter_jit
def _forward(
    model: LmHeadModel,
    tokens: hax.NamedArray,
    mask: AttentionMask | None = None,
    pos_ids: hax.NamedArray | None = None,
) -> hax.NamedArray:
    return model(tokens, mask, pos_ids=pos_ids)


def _logits(
    model: LmHeadModel,
    tokens: hax.NamedArray,
    mask: AttentionMask | None = None,
    pos_ids: hax.NamedArray | None = None,
) -> np.ndarray:
    return np.asarray(_forward(model, tokens, mask, pos_ids).array)


def _examples() -> list[np.ndarray]:
    rng = np.random.RandomState(0)
    return [rng.randint(1, VOCAB.size, size=n).astype(np.int32) for n in LENGTHS]


def _packed_batch(examples: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[list[slice]]]:
    """Two rows: the examples in order and reversed; their tokens, segment ids, restarting positions and spans."""
    tokens, segments, positions, spans = [], [], [], []
    for order in (examples, examples[::-1]):
        tokens.append(np.concatenate(order))
        segments.append(np.concatenate([np.full(len(ex), i) for i, ex in enumerate(order)]))
        positions.append(np.concatenate([np.arange(len(ex)) for ex in order]))
        starts = np.cumsum([0, *(len(ex) for ex in order)])
        spans.append([slice(int(a), int(b)) for a, b in itertools.pairwise(starts)])
    return np.stack(tokens), np.stack(segments), np.stack(positions), spans


def _named(a: np.ndarray, axes: tuple[str, ...] = ("batch", "position")) -> hax.NamedArray:
    return hax.named(jnp.asarray(a, dtype=jnp.int32), axes)


def _alone_logits(model: LmHeadModel, example: np.ndarray) -> np.ndarray:
    """The logits of one example run alone, unpadded, with the default positions (no pos_ids, no segments)."""
    return _logits(model, _named(example, ("position",)))


def test_packed_logits_equal_examples_alone(model: LmHeadModel) -> None:
    examples = _examples()
    tokens, segments, positions, spans = _packed_batch(examples)
    mask = AttentionMask.causal().with_segment_ids(_named(segments))
    packed = _logits(model, _named(tokens), mask, _named(positions))
    alone = [_alone_logits(model, ex) for ex in examples]
    for row, order in enumerate((alone, alone[::-1])):
        for span, ref in zip(spans[row], order, strict=True):
            np.testing.assert_allclose(packed[row, span], ref, rtol=TOL, atol=TOL)
    if isinstance(model, Gpt2LMHeadModel):
        # control: without restarting positions the second example of a row gets other (absolute) position
        # embeddings, so it differs; rotary models only see relative positions, which a shift keeps
        shifted = _logits(model, _named(tokens), mask)
        assert np.abs(shifted[0, spans[0][1]] - alone[1]).max() > 1e-3


def _doubled_rope(config: Any) -> Any:
    """``config`` with every default rotary embedding turning twice as fast (linear scaling by 1/2), or None.

    Positions ``2 * i`` under the original frequencies are positions ``i`` under these: an independent check
    that ``pos_ids`` reach the rotary embedding of every layer (Gemma 3's local one included).
    """
    ropes = {
        f: getattr(config, f) for f in ("rope", "rope_local") if isinstance(getattr(config, f, None), RotaryConfig)
    }
    if not ropes or any(r.rope_type != "default" for r in ropes.values()):
        return None
    return dataclasses.replace(
        config, **{f: RotaryConfig(theta=r.theta, rope_type="linear", factor=0.5) for f, r in ropes.items()}
    )


@pytest.mark.parametrize("name", ROTARY)
def test_pos_ids_reach_every_rotary_embedding(name: str) -> None:
    model = _build(name)
    tokens = _named(_packed_batch(_examples())[0])
    Pos = tokens.resolve_axis("position")
    doubled = _logits(model, tokens, pos_ids=2 * hax.arange(Pos, dtype=jnp.int32))
    assert np.abs(doubled - _logits(model, tokens)).max() > 1e-3
    faster = _doubled_rope(model.config)
    if faster is not None:  # same key and shapes: the same weights, only the static rotary settings differ
        reference = _logits(faster.build(VOCAB, key=jax.random.key(0)), tokens)
        np.testing.assert_allclose(doubled, reference, rtol=TOL, atol=TOL)


def test_pos_ids_select_gpt2_position_embeddings() -> None:
    """GPT-2 at positions ``p`` equals GPT-2 whose learned position table has row ``p[i]`` moved to row ``i``."""
    model = _build("gpt2")
    assert isinstance(model, Gpt2LMHeadModel)
    tokens = _named(_packed_batch(_examples())[0])
    perm = np.arange(tokens.resolve_axis("position").size)[::-1].copy()
    table = model.transformer.wpe.weight
    moved = eqx.tree_at(lambda m: m.transformer.wpe.weight, model, hax.named(table.array[perm], table.axes))
    out = _logits(model, tokens, pos_ids=_named(perm, ("position",)))
    np.testing.assert_allclose(out, _logits(moved, tokens), rtol=TOL, atol=TOL)
    assert np.abs(out - _logits(model, tokens)).max() > 1e-3


def _per_example_losses(
    model: LmHeadModel, example: LmExample, block_size: int | None
) -> tuple[np.ndarray, np.ndarray]:
    per = eqx.filter_jit(compute_next_token_loss)(model, example, reduction="none", block_size=block_size)
    return np.asarray(per.array), np.asarray(example.loss_mask.array)


def _block_sizes(model: LmHeadModel) -> list[int | None]:
    """The plain loss, and the blockwise one (through ``activations_and_aux``) where the model supports it."""
    return [None] if model.blockwise_loss_support() is not None else [None, 16]


def test_packed_loss_equals_padded_examples_alone(model: LmHeadModel) -> None:
    for block_size in _block_sizes(model):
        _check_packed_loss(model, block_size)


def _check_packed_loss(model: LmHeadModel, block_size: int | None) -> None:
    examples = _examples()
    tokens, segments, positions, spans = _packed_batch(examples)
    packed = LmExample.causal(_named(tokens), segment_ids=_named(segments), pos_ids=_named(positions))
    loss, weight = _per_example_losses(model, packed, block_size)
    # each example alone: left-aligned in a row of the same length, padded with its own segment and no loss (the
    # default positions 0 .. n - 1 are the example's own)
    n = tokens.shape[1]
    padded = np.zeros((len(examples), n), np.int32)
    pad_segments = np.ones((len(examples), n), np.int32)
    for i, ex in enumerate(examples):
        padded[i, : len(ex)], pad_segments[i, : len(ex)] = ex, 0
    alone = LmExample.causal(_named(padded), segment_ids=_named(pad_segments), loss_mask=_named(pad_segments == 0))
    ref_loss, ref_weight = _per_example_losses(model, alone, block_size)
    for row, order in enumerate(((0, 1), (1, 0))):
        for span, i in zip(spans[row], order, strict=True):
            width = span.stop - span.start
            np.testing.assert_array_equal(weight[row, span], ref_weight[i, :width])
            np.testing.assert_allclose(loss[row, span], ref_loss[i, :width], rtol=TOL, atol=TOL)
            mean = loss[row, span].sum() / weight[row, span].sum()
            np.testing.assert_allclose(mean, ref_loss[i].sum() / ref_weight[i].sum(), rtol=TOL)


def test_arange_pos_ids_equal_none(model: LmHeadModel) -> None:
    tokens = _packed_batch(_examples())[0]
    Pos = hax.Axis("position", tokens.shape[1])
    default = _logits(model, _named(tokens))
    for pos_ids in (hax.arange(Pos, dtype=jnp.int32), _named(np.tile(np.arange(Pos.size), (2, 1)))):
        np.testing.assert_array_equal(_logits(model, _named(tokens), pos_ids=pos_ids), default)


def test_aux_entry_points_take_pos_ids(model: LmHeadModel) -> None:
    """``logits_and_aux`` / ``activations_and_aux`` / ``activations`` see the positions like ``__call__``."""
    tokens, segments, positions, _ = _packed_batch(_examples())
    mask = AttentionMask.causal().with_segment_ids(_named(segments))
    pos = _named(positions)
    logits = _logits(model, _named(tokens), mask, pos)
    aux_logits = np.asarray(model.logits_and_aux(_named(tokens), mask, pos_ids=pos)[0].array)
    np.testing.assert_allclose(aux_logits, logits, rtol=TOL, atol=TOL)
    if model.blockwise_loss_support() is None:
        hidden = model.activations_and_aux(_named(tokens), mask, pos_ids=pos)[0]
        np.testing.assert_allclose(
            np.asarray(model.activations(_named(tokens), mask, pos_ids=pos).array), np.asarray(hidden.array)
        )
        head_logits = np.asarray(hax.dot(hidden, model.get_lm_head(), axis="embed").array)
        np.testing.assert_allclose(head_logits, logits[..., : head_logits.shape[-1]], rtol=1e-4, atol=1e-4)


def test_apply_rotary_positions_match_a_naive_rotation() -> None:
    """Each token is rotated by the angle of its own position (a NumPy loop as the reference)."""
    Batch, Pos, Hd = hax.make_axes(batch=2, position=5, head_size=4)
    x = hax.random.normal(jax.random.key(1), (Batch, Pos, Hd))
    pos = np.array([[0, 1, 2, 0, 1], [3, 0, 1, 2, 7]])
    rot = RotaryConfig(theta=100.0)
    out = np.asarray(apply_rotary(x, Pos, Hd, rot, _named(pos)).array)
    inv = rot.inv_freq(Hd.size)
    xs = np.asarray(x.array, dtype=np.float64)
    for b in range(Batch.size):
        for p in range(Pos.size):
            angle = pos[b, p] * inv
            c = xs[b, p, :2] + 1j * xs[b, p, 2:]  # "rotate half": dims i and i + d/2 form a complex pair
            r = c * np.exp(1j * angle)
            np.testing.assert_allclose(out[b, p], np.concatenate([r.real, r.imag]), rtol=1e-5, atol=1e-5)


def test_pos_ids_axes_are_checked() -> None:
    Pos, Hd, Other = hax.make_axes(position=4, head_size=2, other=3)
    x = hax.ones((Pos, Hd))
    with pytest.raises(ValueError, match="pos_ids"):
        apply_rotary(x, Pos, Hd, RotaryConfig(), hax.arange(Other))
    with pytest.raises(ValueError, match="pos_ids"):
        LmExample.causal(hax.zeros(Pos, dtype=jnp.int32), pos_ids=hax.zeros((Pos, Other), dtype=jnp.int32))
    ex = LmExample.causal(hax.zeros(Pos, dtype=jnp.int32), pos_ids=hax.arange(Pos))
    assert ex.pos_ids is not None
    assert LmExample.causal(hax.zeros(Pos, dtype=jnp.int32)).pos_ids is None
