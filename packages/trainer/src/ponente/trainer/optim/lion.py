"""Lion (``type: lion``): sign of an interpolated momentum, with decoupled, masked weight decay (optax's ``lion``)."""

from __future__ import annotations

import dataclasses
from typing import Any

import optax

from .config import OptimizerConfig

__all__ = ["LionConfig"]


@OptimizerConfig.register_subclass("lion")
@dataclasses.dataclass(frozen=True)
class LionConfig(OptimizerConfig):
    """Lion (Chen et al. 2023): ``u = sign(beta1 * m + (1 - beta1) * g)``, ``m = beta2 * m + (1 - beta2) * g``.

    The step is ``p -= lr * (u + weight_decay * mask * p)``. Lion's updates have unit magnitude per
    coordinate, so it wants a learning rate 3-10x smaller and a weight decay 3-10x larger than AdamW.

    Attributes:
        beta1: interpolation between momentum and gradient for the update's sign (0.9).
        beta2: momentum decay (0.99).

    Example:
        >>> import jax.numpy as jnp
        >>> opt = LionConfig(learning_rate=0.1, weight_decay=0.0, warmup=0.0, lr_schedule="constant").build(10)
        >>> upd, _ = opt.update(jnp.array([2.0, -3.0]), opt.init(jnp.zeros(2)), jnp.zeros(2))
        >>> tuple(round(x, 6) for x in upd.tolist())
        (-0.1, 0.1)
    """

    learning_rate: float = 1e-4
    weight_decay: float = 1.0
    beta1: float = 0.9
    beta2: float = 0.99

    def _optimizer(self, learning_rate: Any) -> optax.GradientTransformation:
        return optax.lion(
            learning_rate,
            b1=self.beta1,
            b2=self.beta2,
            weight_decay=self.weight_decay,
            mask=self.build_weight_decay_mask(),
        )
