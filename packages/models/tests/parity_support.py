"""Helpers shared by the parity tests: port a transformers model into ours, random ids, logits of both.

Importable from any test module (``from parity_support import port``): the package's pytest configuration
puts ``tests/`` on ``sys.path``. ``conftest.py`` exposes the same functions as fixtures.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import torch

import ponente.namedtensor as hax
from ponente.models import config_for_type


def port(hf_model: Any, **config_overrides: Any) -> Any:
    """Our model with the architecture, config and weights of a transformers model (in memory, no files)."""
    hf_config = hf_model.config.to_dict()
    config = config_for_type(hf_config["model_type"]).from_hf_config(hf_config)
    config = dataclasses.replace(config, **config_overrides)
    # a shape-only template: building random weights only to overwrite them is slow (compilation of init)
    vocab = hax.Axis("vocab", hf_config["vocab_size"])
    template = eqx.filter_eval_shape(lambda key: config.build(vocab, key=key), jax.random.key(0))
    state = {k: jnp.asarray(v.detach().numpy()) for k, v in hf_model.state_dict().items()}
    return template.from_hf_state_dict(state)


def hf_logits(hf_model: Any, ids: np.ndarray) -> np.ndarray:
    """Logits of a transformers model for a (batch, position) id array, as float32 NumPy."""
    with torch.no_grad():
        return hf_model(torch.tensor(ids)).logits.float().numpy()


def random_ids(seq: int = 16, batch: int = 2, vocab: int = 97, seed: int = 0) -> np.ndarray:
    """Reproducible random token ids of shape (batch, seq)."""
    return np.random.RandomState(seed).randint(0, vocab, size=(batch, seq))


@eqx.filter_jit
def _forward(model: Any, ids: hax.NamedArray, mask: Any) -> hax.NamedArray:
    return model(ids, mask)


def logits(model: Any, ids: np.ndarray, mask: Any = None) -> np.ndarray:
    """Our model's logits for a (batch, position) id array (``mask``: an AttentionMask or None for causal)."""
    return np.asarray(_forward(model, hax.named(jnp.asarray(ids), ("batch", "position")), mask).array)
