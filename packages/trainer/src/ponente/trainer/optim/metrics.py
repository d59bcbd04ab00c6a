"""Optimizer metrics for the training loop's tracker: gradient/update norms, learning rate, skipped steps."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from .skip_step import SkipStepState

__all__ = ["NormMetricsState", "optimizer_metrics", "track_norms"]

_HYPERPARAM_STATES = (optax.InjectHyperparamsState, optax.InjectStatefulHyperparamsState)


class NormMetricsState(NamedTuple):
    """State of :func:`track_norms`.

    Attributes:
        inner_state: the wrapped optimizer's state.
        grad_norm: the global norm of the last step's incoming gradients.
        update_norm: the global norm of the last step's final update.
    """

    inner_state: Any
    grad_norm: jax.Array
    update_norm: jax.Array


def track_norms(inner: optax.GradientTransformation) -> optax.GradientTransformationExtraArgs:
    """Wraps ``inner`` to record the global norms of the incoming gradients and of the outgoing update.

    Args:
        inner: the optimizer.

    Returns:
        The wrapped transformation; its state is a :class:`NormMetricsState`.

    Example:
        >>> import jax.numpy as jnp, optax
        >>> opt = track_norms(optax.sgd(0.5))
        >>> _, state = opt.update(jnp.array([3.0, 4.0]), opt.init(jnp.zeros(2)))
        >>> float(state.grad_norm), float(state.update_norm)
        (5.0, 2.5)
    """
    inner = optax.with_extra_args_support(inner)

    def init_fn(params: Any) -> NormMetricsState:
        zero = jnp.zeros((), jnp.float32)
        return NormMetricsState(inner.init(params), zero, zero)

    def update_fn(
        updates: Any, state: NormMetricsState, params: Any = None, **extra_args: Any
    ) -> tuple[Any, NormMetricsState]:
        grad_norm = optax.tree.norm(updates).astype(jnp.float32)
        new_updates, inner_state = inner.update(updates, state.inner_state, params, **extra_args)
        update_norm = optax.tree.norm(new_updates).astype(jnp.float32)
        return new_updates, NormMetricsState(inner_state, grad_norm, update_norm)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def optimizer_metrics(opt_state: Any) -> dict[str, jax.Array]:
    """The loggable metrics found in an optimizer state built by ``OptimizerConfig.build``.

    Keys (present when the state has them): ``optim/grad_norm``, ``optim/update_norm``,
    ``optim/skipped`` (1.0 if the last step was skipped), ``optim/num_skipped``, and ``optim/<name>`` for each
    injected hyperparameter, e.g. ``optim/learning_rate`` (the value used by the last update).

    Args:
        opt_state: the optimizer state (works inside and outside ``jit``).

    Returns:
        A dict of scalar arrays.

    Example:
        >>> import jax.numpy as jnp, optax
        >>> opt = track_norms(optax.inject_hyperparams(optax.sgd)(learning_rate=0.1))
        >>> _, state = opt.update(jnp.array([3.0, 4.0]), opt.init(jnp.zeros(2)))
        >>> sorted(optimizer_metrics(state))
        ['optim/grad_norm', 'optim/learning_rate', 'optim/update_norm']
    """
    metrics: dict[str, jax.Array] = {}

    def is_known(x: Any) -> bool:
        return isinstance(x, (NormMetricsState, SkipStepState, *_HYPERPARAM_STATES))

    def visit(state: Any) -> None:
        for node in jax.tree_util.tree_leaves(state, is_leaf=is_known):
            if isinstance(node, NormMetricsState):
                metrics["optim/grad_norm"] = node.grad_norm
                metrics["optim/update_norm"] = node.update_norm
                visit(node.inner_state)
            elif isinstance(node, SkipStepState):
                metrics["optim/skipped"] = node.skipped.astype(jnp.float32)
                metrics["optim/num_skipped"] = node.num_skipped
                visit(node.inner_state)
            elif isinstance(node, _HYPERPARAM_STATES):
                for name, value in node.hyperparams.items():
                    metrics[f"optim/{name}"] = jnp.asarray(value)
                visit(node.inner_state)

    visit(opt_state)
    return metrics
