"""Sophia-H (``type: sophia-h``): clipped, diagonal-Hessian preconditioned momentum (Liu et al. 2023).

Every ``update_interval`` steps the Hessian diagonal is re-estimated with Hutchinson's estimator
``ĥ = u ⊙ (H u)`` (``u`` Rademacher, ``H u`` a forward-over-reverse product through the step's ``obj_fn``)
and folded into an exponential moving average; each step applies
``clip(m / max(gamma * h, epsilon), -clip_threshold, clip_threshold)``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from .config import OptimizerConfig

__all__ = ["SophiaHConfig", "SophiaHState", "hutchinson_diagonal", "scale_by_sophia_h"]


class SophiaHState(NamedTuple):
    """State of :func:`scale_by_sophia_h`.

    Attributes:
        num_updates: the number of updates so far.
        mu: the gradient EMA (``beta1``).
        hessian: the Hessian-diagonal EMA (``beta2``), refreshed every ``update_interval`` steps.
    """

    num_updates: jax.Array
    mu: Any
    hessian: Any


def hutchinson_diagonal(obj_fn: Callable[[Any], jax.Array], params: Any, key: jax.Array) -> Any:
    """One Hutchinson sample of the Hessian diagonal of ``obj_fn`` at ``params``: ``u ⊙ (∇²f · u)``.

    ``u`` has independent Rademacher (±1) entries, so the sample's expectation is the exact diagonal.

    Args:
        obj_fn: a scalar function of the parameter tree.
        params: the parameter tree (arrays, NamedArrays, None leaves).
        key: the PRNG key for ``u``.

    Returns:
        A tree like ``params``.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> h = hutchinson_diagonal(lambda p: jnp.sum(jnp.array([1.0, 3.0]) * p**2), jnp.ones(2), jax.random.key(0))
        >>> tuple(h.tolist())  # a diagonal Hessian is recovered exactly
        (2.0, 6.0)
    """
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(key, max(len(leaves), 1))
    probes = jax.tree.unflatten(
        treedef, [jax.random.rademacher(k, jnp.shape(x), dtype=jnp.result_type(x)) for k, x in zip(keys, leaves)]
    )
    _, hvp = jax.jvp(jax.grad(obj_fn), (params,), (probes,))
    return jax.tree.map(lambda u, hu: u * hu, probes, hvp)


def scale_by_sophia_h(
    *,
    b1: float = 0.965,
    b2: float = 0.99,
    gamma: float = 0.01,
    epsilon: float = 1e-12,
    clip_threshold: float = 1.0,
    update_interval: int = 10,
) -> optax.GradientTransformationExtraArgs:
    """Sophia-H's preconditioned, clipped direction (no learning rate, no weight decay).

    ``update`` needs ``params`` and the keyword arguments ``obj_fn`` (the loss as a function of the
    parameters) and ``key`` (a fresh PRNG key per step); the Hessian EMA is refreshed at steps
    ``0, update_interval, 2 * update_interval, ...`` before the step's direction is computed.

    Args:
        b1: gradient EMA decay.
        b2: Hessian EMA decay.
        gamma: the Hessian scale ``γ`` in ``m / max(γ h, ε)``.
        epsilon: the floor ``ε`` of the denominator.
        clip_threshold: the per-coordinate clip of the direction.
        update_interval: refresh the Hessian estimate every this many steps (``k``).

    Returns:
        The transformation; its state is a :class:`SophiaHState`.

    Raises:
        ValueError: (at update) if ``params``, ``obj_fn`` or ``key`` is missing.
    """
    if update_interval < 1:
        raise ValueError(f"sophia-h: update_interval must be >= 1, found {update_interval}")

    def init_fn(params: Any) -> SophiaHState:
        zeros = jax.tree.map(jnp.zeros_like, params)
        return SophiaHState(num_updates=jnp.zeros((), jnp.int32), mu=zeros, hessian=zeros)

    def update_fn(
        updates: Any,
        state: SophiaHState,
        params: Any = None,
        *,
        obj_fn: Callable[[Any], jax.Array] | None = None,
        key: jax.Array | None = None,
        **extra_args: Any,
    ) -> tuple[Any, SophiaHState]:
        if params is None or obj_fn is None or key is None:
            missing = [n for n, v in (("params", params), ("obj_fn", obj_fn), ("key", key)) if v is None]
            raise ValueError(
                f"sophia-h: update needs params, obj_fn and key to estimate the Hessian; missing {missing}"
            )
        mu = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, state.mu, updates)

        def refresh(hessian: Any) -> Any:
            estimate = hutchinson_diagonal(obj_fn, params, key)
            return jax.tree.map(lambda h, e: b2 * h + (1 - b2) * e.astype(h.dtype), hessian, estimate)

        hessian = jax.lax.cond(state.num_updates % update_interval == 0, refresh, lambda h: h, state.hessian)
        direction = jax.tree.map(
            lambda m, h: jnp.clip(m / jnp.maximum(gamma * h, epsilon), -clip_threshold, clip_threshold), mu, hessian
        )
        return direction, SophiaHState(num_updates=optax.safe_increment(state.num_updates), mu=mu, hessian=hessian)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


@OptimizerConfig.register_subclass("sophia-h")
@dataclasses.dataclass(frozen=True)
class SophiaHConfig(OptimizerConfig):
    """Sophia with the Hutchinson Hessian estimator: ``p -= lr * (clip(m / max(γ h, ε), ±c) + λ * mask * p)``.

    The training loop must pass ``obj_fn`` and ``key`` to ``update`` (it does). The Gauss-Newton-Bartlett
    estimator (Sophia-G) needs the model's logits and is not offered.

    Attributes:
        beta1: gradient EMA decay (0.965).
        beta2: Hessian EMA decay (0.99).
        epsilon: the denominator's floor (1e-12).
        gamma: the Hessian scale γ (0.01).
        clip_threshold: per-coordinate clip of the preconditioned direction (1.0).
        update_interval: the Hessian is re-estimated every this many steps (10).
    """

    learning_rate: float = 4e-4
    weight_decay: float = 0.2
    beta1: float = 0.965
    beta2: float = 0.99
    epsilon: float = 1e-12
    gamma: float = 0.01
    clip_threshold: float = 1.0
    update_interval: int = 10

    def _optimizer(self, learning_rate: Any) -> optax.GradientTransformation:
        return optax.chain(
            scale_by_sophia_h(
                b1=self.beta1,
                b2=self.beta2,
                gamma=self.gamma,
                epsilon=self.epsilon,
                clip_threshold=self.clip_threshold,
                update_interval=self.update_interval,
            ),
            optax.add_decayed_weights(self.weight_decay, self.build_weight_decay_mask()),
            optax.scale_by_learning_rate(learning_rate),
        )
