"""Selective gradient checkpointing: every block tags its internals (``ponente.models.remat.CHECKPOINT_NAMES``), a
list of those names as ``gradient_checkpointing`` keeps them, the gradients do not change, the backward pass
recomputes what the names do not cover, and a name the blocks do not tag is an error naming the key."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ponente.namedtensor as hax
from ponente.models import (
    CHECKPOINT_NAMES,
    Gemma2Config,
    Gpt2Config,
    LlamaConfig,
    LmExample,
    LmHeadModel,
    MixtralConfig,
    Qwen3Config,
    compute_next_token_loss,
)
from ponente.models.whisper import WhisperConfig
from ponente.namedtensor import ScanCheckpointPolicy

VOCAB = hax.Axis("vocab", 41)
SIZES: dict[str, Any] = {"seq_len": 16, "hidden_dim": 32, "intermediate_dim": 64, "num_layers": 2, "num_heads": 4}
CONFIGS: dict[str, Callable[..., Any]] = {
    "llama": lambda **kw: LlamaConfig(**SIZES, num_kv_heads=2, **kw),
    "qwen3": lambda **kw: Qwen3Config(**SIZES, num_kv_heads=2, head_dim=8, **kw),
    "gemma2": lambda **kw: Gemma2Config(
        **SIZES, num_kv_heads=2, head_dim=8, sliding_window=4, attn_logit_softcapping=3.0, **kw
    ),
    "gpt2": lambda **kw: Gpt2Config(**SIZES, num_kv_heads=4, **kw),
    "gpt2-upcast": lambda **kw: Gpt2Config(**SIZES, num_kv_heads=4, upcast_attn=True, **kw),
    "mixtral-dense": lambda **kw: MixtralConfig(**SIZES, num_kv_heads=2, num_experts=4, num_experts_per_tok=2, **kw),
    "mixtral-sorted": lambda **kw: MixtralConfig(
        **SIZES, num_kv_heads=2, num_experts=4, num_experts_per_tok=2, moe_dispatch="sorted", **kw
    ),
}
ALL = list(CHECKPOINT_NAMES)


def _example() -> LmExample:
    tokens = np.random.default_rng(0).integers(0, VOCAB.size, (2, SIZES["seq_len"]))
    return LmExample.causal(hax.named(jnp.asarray(tokens, jnp.int32), ("batch", "position")))


def _loss_fn(model: LmHeadModel) -> tuple[Callable[[Any], jax.Array], Any]:
    params, static = eqx.partition(model, eqx.is_inexact_array)
    example = _example()
    return (lambda p: compute_next_token_loss(eqx.combine(p, static), example, key=None).array), params


def _walk(jaxpr: Any) -> Any:
    """Every equation of ``jaxpr`` and of the jaxprs nested in it (scans, checkpoints, custom rules)."""
    for eqn in jaxpr.eqns:
        yield eqn
        for param in eqn.params.values():
            for sub in param if isinstance(param, (list, tuple)) else [param]:
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from _walk(inner)


def _tags(model: LmHeadModel) -> set[str]:
    loss, params = _loss_fn(model)
    return _block_tags(jax.make_jaxpr(loss)(params).jaxpr)


def _block_tags(jaxpr: Any) -> set[str]:
    """The checkpoint names in ``jaxpr``, less the layer loop's own (``scan(layers):carry``, ...)."""
    return {e.params["name"] for e in _walk(jaxpr) if e.primitive.name == "name" and ":" not in e.params["name"]}


def _products(model: LmHeadModel) -> int:
    """Matrix products in the program of the loss's gradient, each scanned layer body counted once."""
    loss, params = _loss_fn(model)
    return sum(e.primitive.name == "dot_general" for e in _walk(jax.make_jaxpr(jax.grad(loss))(params).jaxpr))


def _build(name: str, seed: int, **overrides: Any) -> Any:
    """The model ``name`` with the parameters of ``seed`` (the same for every ``gradient_checkpointing``)."""
    return CONFIGS[name](**overrides).build(VOCAB, key=jax.random.key(seed))


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_every_block_tags_every_internal(name: str) -> None:
    assert _tags(_build(name, 0)) == set(CHECKPOINT_NAMES)


def test_whisper_tags_every_internal() -> None:
    config = WhisperConfig.preset("tiny").scaled(d_model=16, layers=1, heads=2, max_source_positions=10)
    config = dataclasses.replace(config, vocab_size=50, decoder_start_token_id=48, eos_token_id=49, pad_token_id=49)
    model = config.build(key=jax.random.key(6))
    features = hax.named(jnp.ones((1, config.num_mel_bins, 20)), ("batch", "mel", "frame"))
    tokens = hax.named(jnp.zeros((1, 4), jnp.int32), ("batch", "position"))
    jaxpr = jax.make_jaxpr(lambda m: m(features, tokens).array)(model).jaxpr
    assert _block_tags(jaxpr) == set(CHECKPOINT_NAMES)


@pytest.mark.parametrize("name", ["llama", "gemma2", "gpt2-upcast", "mixtral-sorted"])
@pytest.mark.parametrize("policy", [["attn_qkv", "mlp_in"], ALL])
def test_selective_checkpointing_keeps_the_gradients(name: str, policy: list[str]) -> None:
    loss, params = _loss_fn(_build(name, 1))
    value, grads = jax.jit(jax.value_and_grad(loss))(params)
    loss_c, params_c = _loss_fn(_build(name, 1, gradient_checkpointing=policy))
    assert _products(_build(name, 1, gradient_checkpointing=policy)) > _products(_build(name, 1))  # it recomputes
    value_c, grads_c = jax.jit(jax.value_and_grad(loss_c))(params_c)
    np.testing.assert_allclose(value_c, value, rtol=1e-6)
    for g, g_c in zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(grads_c), strict=True):
        np.testing.assert_allclose(g_c, g, rtol=1e-4, atol=1e-6)


def test_the_backward_pass_recomputes_only_what_the_names_do_not_keep() -> None:
    # a Llama layer makes 9 products: q, k, v, the scores, scores x values, o, gate, up, down. Without
    # checkpointing the backward pass recomputes none; fully checkpointed it recomputes every one whose output the
    # backward pass needs (all but the down projection's: 8); keeping attn_qkv spares the three input projections;
    # keeping every name leaves only the scores (the softmax's backward needs the probabilities, which no name keeps)
    def products(gradient_checkpointing: Any) -> int:
        return _products(_build("llama", 2, attn_backend="reference", gradient_checkpointing=gradient_checkpointing))

    none = products(False)
    assert products(True) == none + 8
    assert products(["attn_qkv"]) == none + 5
    assert products(["mlp_in"]) == none + 6
    assert products(ALL) == none + 1


def test_selective_checkpointing_memory_lies_between_none_and_full() -> None:
    def scratch(gradient_checkpointing: Any) -> int:
        model = _build("llama", 3, attn_backend="reference", gradient_checkpointing=gradient_checkpointing)
        loss, params = _loss_fn(model)
        return jax.jit(jax.grad(loss)).lower(params).compile().memory_analysis().temp_size_in_bytes

    none, full, selective = scratch(False), scratch(True), scratch(ALL)
    assert full < selective < none


def test_names_in_a_policy_offload_block_internals() -> None:
    policy = ScanCheckpointPolicy(save_block_internals=["attn_qkv"], offload_block_internals=["mlp_in"])
    assert CONFIGS["llama"](gradient_checkpointing=policy).gradient_checkpointing is policy
    loss, params = _loss_fn(_build("llama", 4))
    grads = jax.jit(jax.grad(loss))(params)
    loss_o, params_o = _loss_fn(_build("llama", 4, gradient_checkpointing=policy))
    grads_o = jax.jit(jax.grad(loss_o))(params_o)  # the MLP's projections go to host memory and back
    for g, g_o in zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(grads_o), strict=True):
        np.testing.assert_allclose(g_o, g, rtol=1e-4, atol=1e-6)


def test_a_list_becomes_a_hashable_tuple() -> None:
    config = CONFIGS["llama"](gradient_checkpointing=["attn_context", "mlp_out"])
    assert config.gradient_checkpointing == ("attn_context", "mlp_out")
    # equal configs hash alike, so a model (which holds its config as a static field) compiles once
    assert hash(config) == hash(CONFIGS["llama"](gradient_checkpointing=("attn_context", "mlp_out")))


@pytest.mark.parametrize(
    ("value", "match"),
    [
        (["attn_qkv", "mlp_hid"], r"LlamaConfig\.gradient_checkpointing: unknown internal name\(s\) \['mlp_hid'\]"),
        ("sometimes", r"LlamaConfig\.gradient_checkpointing: unknown gradient checkpointing policy 'sometimes'"),
        (3, r"LlamaConfig\.gradient_checkpointing must be a bool, a policy name"),
        (ScanCheckpointPolicy(save_block_internals=["q"]), r"unknown internal name\(s\) \['q'\]"),
        (ScanCheckpointPolicy(offload_block_internals=["mlp"]), r"unknown internal name\(s\) \['mlp'\]"),
    ],
)
def test_a_bad_setting_names_the_key(value: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        CONFIGS["llama"](gradient_checkpointing=value)


def test_whisper_checks_its_names() -> None:
    with pytest.raises(ValueError, match=r"WhisperConfig\.gradient_checkpointing: unknown internal name"):
        WhisperConfig(gradient_checkpointing=["attention"])
    assert WhisperConfig(gradient_checkpointing=["attn_context"]).gradient_checkpointing == ("attn_context",)
