"""The shared decoder (``ponente.models.decoder``): its families give the numbers pinned before they moved onto it
(when each family had its own block and decode path); its config checks.

The pins are float hex of a tiny model per family (CPU): the next-token loss of a batch, and the sum of the real
vocabulary's logits after a right-padded prefill and three one-token decode steps. They were bitwise equal on the
machine that recorded them; XLA's CPU kernels round differently on other instruction sets (AVX2 vs AVX-512), so
they are compared to 1e-5 relative here -- tight enough that a change of formula (a norm, a mask, a rope) fails.
"""

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
    Gemma2Config,
    Gemma3Config,
    GemmaConfig,
    LlamaConfig,
    LmExample,
    MistralConfig,
    MixtralConfig,
    Olmo2Config,
    Qwen3Config,
    QwenConfig,
    compute_next_token_loss,
)

_S: dict[str, Any] = {"seq_len": 16, "hidden_dim": 32, "intermediate_dim": 48, "num_layers": 3, "num_heads": 4}
_SLIDE = ("sliding_attention", "full_attention", "sliding_attention")
_G: dict[str, Any] = {k: v for k, v in _S.items() if k != "num_layers"} | {"num_kv_heads": 2, "head_dim": 8}
CONFIGS: dict[str, Callable[[], Any]] = {
    "llama": lambda: LlamaConfig(**_S, num_kv_heads=2, vocab_padding_multiple=16),
    "llama-tied-qk": lambda: LlamaConfig(**_S, num_kv_heads=2, tie_word_embeddings=True, qk_norm=True),
    "mistral": lambda: MistralConfig(**_S, num_kv_heads=2, sliding_window=4),
    "qwen-slide": lambda: QwenConfig(**_S, num_kv_heads=2, sliding_window=3, layer_types=_SLIDE),
    "qwen3": lambda: Qwen3Config(
        **_S, num_kv_heads=2, head_dim=8, attention_bias=True, sliding_window=3, layer_types=_SLIDE
    ),
    "olmo2": lambda: Olmo2Config(**_S, num_kv_heads=2, attention_bias=True),
    "mixtral": lambda: MixtralConfig(**_S, num_kv_heads=2, num_experts=4, num_experts_per_tok=2, sliding_window=5),
    "gemma-untied-pad": lambda: GemmaConfig(**_G, num_layers=2, tie_word_embeddings=False, vocab_padding_multiple=16),
    "gemma2": lambda: Gemma2Config(**_G, num_layers=3, sliding_window=4, query_pre_attn_scalar=12),
    "gemma2-pad-attn-cap": lambda: Gemma2Config(
        **_G,
        num_layers=3,
        sliding_window=5,
        tie_word_embeddings=False,
        vocab_padding_multiple=16,
        final_logit_softcapping=None,
        attn_logit_softcapping=20.0,
    ),
    "gemma3": lambda: Gemma3Config(**_G, num_layers=7, sliding_window=4),
    "gemma3-nowindow-cap": lambda: Gemma3Config(
        **_G, num_layers=3, sliding_window=None, layer_types=_SLIDE, final_logit_softcapping=10.0
    ),
}
# recorded from the commit before the shared decoder (each family's own block and decode)
PINNED: dict[str, tuple[str, str]] = {
    "llama": ("0x1.2176da0000000p+2", "0x1.75036dfc0a000p+3"),
    "llama-tied-qk": ("0x1.f8b67c0000000p+1", "0x1.889a5bb000000p+0"),
    "mistral": ("0x1.1d26a20000000p+2", "0x1.0ee7107e68000p+5"),
    "qwen-slide": ("0x1.1bc73c0000000p+2", "0x1.5baf118040000p+4"),
    "qwen3": ("0x1.1d769e0000000p+2", "0x1.d868959e80000p+4"),
    "olmo2": ("0x1.201a760000000p+2", "0x1.37442cc200000p+2"),
    "mixtral": ("0x1.2579e20000000p+2", "0x1.7d9ba36880000p+2"),
    # recorded from the commit before Gemma moved onto the shared decoder (its own block and decode)
    "gemma-untied-pad": ("0x1.25bbae0000000p+2", "0x1.f9187fc900000p+3"),
    "gemma2": ("0x1.f994a60000000p+1", "0x1.cc37a8e800000p-3"),
    "gemma2-pad-attn-cap": ("0x1.1e83360000000p+2", "0x1.46a3ba0a80000p+2"),
    "gemma3": ("0x1.fb3bda0000000p+1", "0x1.17a73f5140000p-2"),
    "gemma3-nowindow-cap": ("0x1.f7a2c00000000p+1", "0x1.c80d5b1080000p+0"),
}
V, B, P = hax.Axis("vocab", 53), hax.Axis("batch", 2), hax.Axis("position", 16)


@eqx.filter_jit
def _loss(model: Any, ids: hax.NamedArray) -> jax.Array:
    return compute_next_token_loss(model, LmExample.causal(ids), key=jax.random.key(1)).array


@eqx.filter_jit
def _decode(model: Any, tokens: Any, cache: Any, pos: Any, logits_at: Any = None) -> Any:
    return model.decode(tokens, cache, pos, logits_at=logits_at)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_loss_and_decoding_equal_the_pins(name: str) -> None:
    model = CONFIGS[name]().build(V, key=jax.random.key(0))
    ids = hax.named(jnp.asarray(np.random.RandomState(0).randint(0, 53, (2, 16)), jnp.int32), (B, P))
    cache = model.init_cache(B, 16).for_prefill()
    prefill_pos = hax.named(jnp.tile(jnp.arange(6), (2, 1)), (B, P.resize(6)))
    _, cache = _decode(model, ids["position", 0:6], cache, prefill_pos, hax.named(jnp.array([5, 3]), B))
    for s in range(3):
        pos = hax.named(jnp.array([[6 + s], [4 + s]]), (B, P.resize(1)))
        logits, cache = _decode(model, ids["position", 6 + s : 7 + s], cache, pos)
    loss_hex, step_hex = PINNED[name]
    loss = float(_loss(model, ids))
    step = float(np.asarray(logits.array)[..., :53].astype(np.float64).sum())
    assert loss == pytest.approx(float.fromhex(loss_hex), rel=1e-5, abs=0), f"{name}: loss {loss.hex()}"
    assert step == pytest.approx(float.fromhex(step_hex), rel=1e-5, abs=0), f"{name}: decoded logits {step.hex()}"


def test_sliding_layers_of_two_window_sizes_are_an_error() -> None:
    @dataclasses.dataclass(frozen=True)
    class TwoWindows(LlamaConfig):
        def attention_windows(self) -> tuple[int | None, ...]:
            return (2, 3, None)

    model = TwoWindows(**_S, num_kv_heads=2).build(V, key=jax.random.key(0))
    with pytest.raises(ValueError, match="TwoWindows: sliding layers need one window size, got \\[2, 3\\]"):
        model(hax.zeros({"position": 4}, dtype=jnp.int32))
