"""``scan_layers: false``: the layers unrolled in the compiled program (no loop), with the same parameters, loss and
gradients as the scanned layers, for every family; decoding through the cache; the key checked and carried by
Hugging Face loading."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
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
    Gpt2Config,
    LlamaConfig,
    LmExample,
    LmHeadModel,
    MixtralConfig,
    QwenConfig,
    compute_next_token_loss,
)
from ponente.models.hf import load_pretrained, save_pretrained
from ponente.models.whisper import WhisperConfig

VOCAB = hax.Axis("vocab", 37)
SIZES: dict[str, Any] = {"seq_len": 12, "hidden_dim": 32, "intermediate_dim": 48, "num_layers": 3, "num_heads": 4}
CONFIGS: dict[str, Callable[[], Any]] = {
    "llama": lambda: LlamaConfig(**SIZES, num_kv_heads=2),
    "gpt2": lambda: Gpt2Config(**SIZES, num_kv_heads=4),
    "gemma2": lambda: Gemma2Config(**SIZES, num_kv_heads=2, head_dim=8, sliding_window=4, attn_logit_softcapping=3.0),
    "qwen-sliding": lambda: QwenConfig(
        **SIZES,
        num_kv_heads=2,
        sliding_window=3,
        layer_types=("sliding_attention", "full_attention", "full_attention"),
    ),
    "mixtral": lambda: MixtralConfig(**SIZES, num_kv_heads=2, num_experts=4, num_experts_per_tok=2),
}


def _unrolled(model: Any) -> Any:
    """The same parameters under a config with ``scan_layers=False``."""
    return dataclasses.replace(model, config=dataclasses.replace(model.config, scan_layers=False))


def _example(seed: int = 0) -> LmExample:
    tokens = np.random.default_rng(seed).integers(0, VOCAB.size, (2, SIZES["seq_len"]))
    segments = np.array([[0] * 5 + [1] * 7, [0] * 12])  # a packed row: no attention across the boundary
    return LmExample.causal(
        hax.named(jnp.asarray(tokens, jnp.int32), ("batch", "position")),
        segment_ids=hax.named(jnp.asarray(segments, jnp.int32), ("batch", "position")),
    )


def _loss_and_grads(model: LmHeadModel, example: LmExample) -> tuple[jax.Array, Any]:
    params, static = eqx.partition(model, eqx.is_inexact_array)

    def loss(p: Any) -> jax.Array:
        return compute_next_token_loss(eqx.combine(p, static), example, key=None).array

    return jax.jit(jax.value_and_grad(loss))(params)


def _parameter_shapes(model: Any) -> dict[str, tuple[int, ...]]:
    leaves = jax.tree_util.tree_leaves_with_path(eqx.filter(model, eqx.is_array))
    return {jax.tree_util.keystr(path): leaf.shape for path, leaf in leaves}


def _while_loops(model: Any, example: LmExample) -> int:
    """``while`` loops in the lowered program of the loss and its gradient."""
    params, static = eqx.partition(model, eqx.is_inexact_array)

    def loss(p: Any) -> jax.Array:
        return compute_next_token_loss(eqx.combine(p, static), example, key=None).array

    return jax.jit(jax.grad(loss)).lower(params).as_text().count("stablehlo.while")


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_unrolled_layers_give_the_scanned_loss_and_gradients(name: str) -> None:
    model = CONFIGS[name]().build(VOCAB, key=jax.random.key(1))
    unrolled = _unrolled(model)
    example = _example()
    loss, grads = _loss_and_grads(model, example)
    loss_u, grads_u = _loss_and_grads(unrolled, example)
    np.testing.assert_allclose(loss_u, loss, rtol=1e-6)
    flat, flat_u = jax.tree_util.tree_leaves_with_path(grads), jax.tree_util.tree_leaves(grads_u)
    assert len(flat) == len(flat_u)
    for (path, g), g_u in zip(flat, flat_u, strict=True):
        np.testing.assert_allclose(g_u, g, rtol=1e-4, atol=1e-5, err_msg=f"{name}: {jax.tree_util.keystr(path)}")
    # the parameters are the same pytree (stacked), the program is not: no loop over the layers once unrolled
    assert _parameter_shapes(model) == _parameter_shapes(unrolled)
    assert any(shape[0] == SIZES["num_layers"] for shape in _parameter_shapes(unrolled).values())
    assert _while_loops(model, example) >= 1
    assert _while_loops(unrolled, example) == 0


def test_unrolled_layers_equal_a_python_loop_over_the_layers() -> None:
    # an independent reference: each layer applied by hand, its parameters sliced out of the stack
    model = CONFIGS["llama"]().build(VOCAB, key=jax.random.key(2))
    tokens = hax.named(jnp.asarray(np.random.default_rng(3).integers(0, VOCAB.size, (2, 12)), jnp.int32),
                       ("batch", "position"))  # fmt: skip
    x = model.transformer.embed_tokens.embed(tokens)
    for layer in model.transformer.layers.unstacked():
        x, _, _ = layer(x, AttentionMask.causal())
    expected = model.transformer.norm(x)
    got = eqx.filter_jit(lambda m, t: m.activations(t))(_unrolled(model), tokens)
    np.testing.assert_allclose(got.rearrange(expected.axes).array, expected.array, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["llama", "gpt2", "gemma2"])
def test_unrolled_layers_decode_through_the_cache_like_the_forward(name: str) -> None:
    model = CONFIGS[name]().build(VOCAB, key=jax.random.key(4))
    unrolled = _unrolled(model)
    rows = np.random.default_rng(5).integers(0, VOCAB.size, (2, 9))
    full = eqx.filter_jit(lambda m, t: m(t))(model, hax.named(jnp.asarray(rows, jnp.int32), ("batch", "position")))
    Batch = hax.Axis("batch", 2)
    cache = unrolled.init_cache(Batch, 12).for_prefill(True)
    decode = eqx.filter_jit(lambda m, t, c, p: m.decode(t, c, p))
    prompt, positions = rows[:, :6], np.tile(np.arange(6), (2, 1))
    logits, cache = decode(unrolled, hax.named(jnp.asarray(prompt, jnp.int32), ("batch", "position")), cache,
                           hax.named(jnp.asarray(positions, jnp.int32), ("batch", "position")))  # fmt: skip
    steps = [logits]
    for i in range(6, 9):
        token = hax.named(jnp.asarray(rows[:, i : i + 1], jnp.int32), ("batch", "position"))
        logits, cache = decode(
            unrolled, token, cache, hax.named(jnp.full((2, 1), i, jnp.int32), ("batch", "position"))
        )
        steps.append(logits)
    cached = hax.concatenate("position", steps)
    np.testing.assert_allclose(cached.rearrange(full.axes).array, full.array, rtol=0, atol=1e-5)


def test_whisper_unrolled_layers_give_the_scanned_logits_and_gradients() -> None:
    config = WhisperConfig.preset("tiny").scaled(d_model=16, layers=2, heads=2, max_source_positions=10)
    config = dataclasses.replace(config, vocab_size=50, decoder_start_token_id=48, eos_token_id=49, pad_token_id=49)
    model = config.build(key=jax.random.key(6))
    unrolled = dataclasses.replace(model, config=dataclasses.replace(config, scan_layers=False))
    rng = np.random.default_rng(7)
    features = hax.named(jnp.asarray(rng.standard_normal((2, config.num_mel_bins, 20)), jnp.float32),
                         ("batch", "mel", "frame"))  # fmt: skip
    tokens = hax.named(jnp.asarray(rng.integers(0, 48, (2, 5)), jnp.int32), ("batch", "position"))

    def loss(m: Any) -> jax.Array:
        return jnp.mean(jnp.square(m(features, tokens).array))

    def both(m: Any) -> tuple[jax.Array, Any]:
        params, static = eqx.partition(m, eqx.is_inexact_array)
        return jax.jit(jax.value_and_grad(lambda p: loss(eqx.combine(p, static))))(params)

    (value, grads), (value_u, grads_u) = both(model), both(unrolled)
    np.testing.assert_allclose(value_u, value, rtol=1e-6)
    for g, g_u in zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(grads_u), strict=True):
        np.testing.assert_allclose(g_u, g, rtol=1e-4, atol=1e-6)
    params, static = eqx.partition(unrolled, eqx.is_inexact_array)
    lowered = jax.jit(jax.grad(lambda p: loss(eqx.combine(p, static)))).lower(params).as_text()
    assert "stablehlo.while" not in lowered


@pytest.mark.parametrize("make", [lambda: LlamaConfig(scan_layers="no"), lambda: WhisperConfig(scan_layers=0)])
def test_scan_layers_must_be_a_bool(make: Callable[[], Any]) -> None:
    with pytest.raises(ValueError, match="scan_layers must be true or false"):
        make()


def test_scan_layers_is_a_config_override_of_hugging_face_loading(tmp_path: Path) -> None:
    model = CONFIGS["llama"]().build(VOCAB, key=jax.random.key(8))
    save_pretrained(model, tmp_path)
    loaded = load_pretrained(tmp_path, config_overrides={"scan_layers": False})
    assert loaded.config.scan_layers is False
    assert "scan_layers" not in loaded.config.to_hf_config(VOCAB.size)  # a Ponente setting, not a checkpoint property
    example = _example(9)
    np.testing.assert_allclose(_loss_and_grads(loaded, example)[0], _loss_and_grads(model, example)[0], rtol=1e-6)
