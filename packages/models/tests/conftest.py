"""Shared helpers: tiny Hugging Face PyTorch models (transformers must be importable; tests fail without it), porting
them in memory, a short training loop, and no network (``HF_HUB_OFFLINE=1``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import parity_support
import pytest
import torch
import transformers

import ponente.namedtensor as hax
from ponente.models import LmExample, compute_next_token_loss


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs() -> Any:
    """Drop JAX's compiled programs after each test module.

    XLA:CPU maps memory for every executable it keeps; one process running the whole suite otherwise approaches the
    kernel's limit of memory mappings per process (``vm.max_map_count``, 65530 by default) and XLA crashes while
    compiling (seen as an abort or a segmentation fault in the last test modules).
    """
    yield
    jax.clear_caches()


@pytest.fixture(autouse=True)
def _torch_seed() -> None:
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _hub_offline(monkeypatch: pytest.MonkeyPatch) -> None:
    """No test may reach the Hugging Face Hub."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def _tiny_gpt2(**overrides: Any) -> Any:
    """A random transformers GPT-2 with a tiny config."""
    kwargs: dict[str, Any] = {"vocab_size": 97, "n_positions": 16, "n_embd": 32, "n_layer": 2, "n_head": 4}
    kwargs.update(overrides)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(**kwargs)).eval()


def _tiny_llama(**overrides: Any) -> Any:
    """A random transformers Llama with a tiny config."""
    kwargs: dict[str, Any] = {
        "vocab_size": 97,
        "max_position_embeddings": 16,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    }
    kwargs.update(overrides)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**kwargs)).eval()


@pytest.fixture
def hf_logits() -> Callable[[Any, np.ndarray], np.ndarray]:
    """``hf_logits(model, ids)``: logits of a transformers model as float32 NumPy."""
    return parity_support.hf_logits


@pytest.fixture
def tiny_gpt2() -> Callable[..., Any]:
    """``tiny_gpt2(**overrides)``: a random transformers GPT-2 (vocab 97, 2 layers, width 32, 4 heads)."""
    return _tiny_gpt2


@pytest.fixture
def tiny_llama() -> Callable[..., Any]:
    """``tiny_llama(**overrides)``: a random transformers Llama (vocab 97, 2 layers, width 32, 4 heads, 2 kv heads)."""
    return _tiny_llama


@pytest.fixture
def port() -> Callable[..., Any]:
    """``port(hf_model, **config_overrides)``: our model with the config and weights of a transformers model."""
    return parity_support.port


def _train_losses(model: Any, ids: np.ndarray, steps: int = 5, lr: float = 1e-2) -> list[float]:
    """The loss before and after each of ``steps`` optax.adamw steps on one fixed (batch, position) id array."""
    example = LmExample.causal(hax.named(jnp.asarray(ids), ("batch", "position")))
    opt = optax.adamw(lr)
    params = eqx.filter(model, eqx.is_inexact_array)
    state = opt.init(params)

    @eqx.filter_jit
    def step(model: Any, state: Any) -> tuple[Any, Any, jax.Array]:
        loss, grads = eqx.filter_value_and_grad(lambda m: compute_next_token_loss(m, example).scalar())(model)
        updates, state = opt.update(grads, state, eqx.filter(model, eqx.is_inexact_array))
        return eqx.apply_updates(model, updates), state, loss

    losses = []
    for _ in range(steps + 1):
        model, state, loss = step(model, state)
        losses.append(float(loss))
    return losses


@pytest.fixture
def train_losses() -> Callable[..., list[float]]:
    """``train_losses(model, ids, steps=5, lr=1e-2)``: losses of a few optax.adamw steps on one batch."""
    return _train_losses
