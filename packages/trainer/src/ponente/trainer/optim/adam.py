"""AdamW (``type: adam``): Adam with decoupled, masked weight decay (optax's ``adamw``)."""

from __future__ import annotations

import dataclasses
from typing import Any

import optax

from .config import OptimizerConfig

__all__ = ["AdamConfig"]


@OptimizerConfig.register_subclass("adam")
@dataclasses.dataclass(frozen=True)
class AdamConfig(OptimizerConfig):
    """AdamW (Loshchilov & Hutter): ``p -= lr * (m̂ / (sqrt(v̂) + epsilon) + weight_decay * mask * p)``.

    Uses the shared fields of :class:`OptimizerConfig` (``beta1=0.9``, ``beta2=0.95``, ``epsilon=1e-8``,
    ``max_grad_norm=1.0``); moments are bias-corrected.

    Example:
        >>> import jax.numpy as jnp
        >>> opt = AdamConfig(learning_rate=0.1, warmup=0.0, lr_schedule="constant").build(10)
        >>> state = opt.init({"w": jnp.ones(2)})
        >>> upd, state = opt.update({"w": jnp.array([1.0, -1.0])}, state, {"w": jnp.ones(2)})
        >>> tuple(round(x, 3) for x in upd["w"].tolist())
        (-0.11, 0.09)
    """

    def _optimizer(self, learning_rate: Any) -> optax.GradientTransformation:
        return optax.adamw(
            learning_rate,
            b1=self.beta1,
            b2=self.beta2,
            eps=self.epsilon,
            weight_decay=self.weight_decay,
            mask=self.build_weight_decay_mask(),
        )
