"""Skip-step: drop the update of a step whose loss or gradient norm is non-finite or spikes.

A spike is a value above ``mean + sigma * std`` of the last ``window`` finite values (after ``warmup``
observed steps). A skipped step applies a zero update and leaves the wrapped optimizer's state untouched
(moments, counts, learning-rate schedule); only the rolling statistics and counters advance.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

__all__ = ["SkipStepState", "skip_bad_steps"]


class SkipStepState(NamedTuple):
    """State of :func:`skip_bad_steps`.

    Attributes:
        inner_state: the wrapped optimizer's state.
        losses: ring buffer of the last ``window`` finite losses.
        grad_norms: ring buffer of the last ``window`` finite gradient norms.
        num_observed: how many finite steps entered the buffers (the next write is at ``num_observed % window``).
        num_skipped: how many steps were skipped so far.
        skipped: whether the last step was skipped.
    """

    inner_state: Any
    losses: jax.Array
    grad_norms: jax.Array
    num_observed: jax.Array
    num_skipped: jax.Array
    skipped: jax.Array


def _rolling_mean_std(buffer: jax.Array, count: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Mean and (population) standard deviation of the first ``min(count, len(buffer))`` entries."""
    n = jnp.minimum(count, buffer.shape[0])
    valid = jnp.arange(buffer.shape[0]) < n
    denom = jnp.maximum(n, 1).astype(buffer.dtype)
    mean = jnp.sum(jnp.where(valid, buffer, 0.0)) / denom
    var = jnp.sum(jnp.where(valid, (buffer - mean) ** 2, 0.0)) / denom
    return mean, jnp.sqrt(var)


def skip_bad_steps(
    inner: optax.GradientTransformation, *, window: int = 100, sigma: float = 6.0, warmup: int = 10
) -> optax.GradientTransformationExtraArgs:
    """Wraps ``inner`` so that steps with non-finite or spiking loss/gradient norm are skipped.

    The update takes the step's loss as the keyword argument ``loss`` (the training loop passes it);
    without it only the gradient norm is checked.

    Args:
        inner: the optimizer to protect.
        window: how many recent finite steps the rolling mean and standard deviation cover.
        sigma: a value above ``mean + sigma * std`` is a spike.
        warmup: how many finite steps to observe before spikes are detected (non-finite steps are
            always skipped).

    Returns:
        The wrapped transformation; its state is a :class:`SkipStepState`.

    Raises:
        ValueError: if ``window`` or ``warmup`` is not positive, or ``sigma`` is negative.

    Example:
        >>> import jax.numpy as jnp, optax
        >>> opt = skip_bad_steps(optax.sgd(1.0), window=4, warmup=1)
        >>> state = opt.init(jnp.zeros(2))
        >>> upd, state = opt.update(jnp.ones(2), state, loss=jnp.nan)
        >>> tuple(upd.tolist()), bool(state.skipped)
        ((0.0, 0.0), True)
    """
    if window < 1 or warmup < 1 or sigma < 0:
        raise ValueError(
            f"skip_bad_steps: expected skip_step_window >= 1, skip_step_warmup >= 1 and skip_step_sigma >= 0, "
            f"found window={window}, warmup={warmup}, sigma={sigma}"
        )
    inner = optax.with_extra_args_support(inner)

    def init_fn(params: Any) -> SkipStepState:
        zeros = jnp.zeros((window,), jnp.float32)
        return SkipStepState(
            inner_state=inner.init(params),
            losses=zeros,
            grad_norms=zeros,
            num_observed=jnp.zeros((), jnp.int32),
            num_skipped=jnp.zeros((), jnp.int32),
            skipped=jnp.zeros((), jnp.bool_),
        )

    def update_fn(
        updates: Any, state: SkipStepState, params: Any = None, **extra_args: Any
    ) -> tuple[Any, SkipStepState]:
        loss_arg = extra_args.get("loss")
        has_loss = loss_arg is not None
        loss = jnp.asarray(loss_arg if has_loss else 0.0, jnp.float32)
        grad_norm = optax.tree.norm(updates).astype(jnp.float32)
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)

        loss_mean, loss_std = _rolling_mean_std(state.losses, state.num_observed)
        gn_mean, gn_std = _rolling_mean_std(state.grad_norms, state.num_observed)
        spike = grad_norm > gn_mean + sigma * gn_std
        if has_loss:
            spike = spike | (loss > loss_mean + sigma * loss_std)
        skip = ~finite | ((state.num_observed >= warmup) & spike)

        # a conditional, not a select of the new and the old state: with the select, XLA copies every donated
        # moment of the inner optimizer each step (see ``Trainer``'s non-finite guard)
        def step(_: None) -> tuple[Any, Any]:
            return inner.update(updates, state.inner_state, params, **extra_args)

        def keep(_: None) -> tuple[Any, Any]:
            shapes = jax.eval_shape(step, None)[0]
            return jax.tree.map(lambda u: jnp.zeros(u.shape, u.dtype), shapes), state.inner_state

        new_updates, new_inner = jax.lax.cond(skip, keep, step, None)

        # finite values (spikes included, so that a lasting level shift is absorbed) enter the statistics
        slot = state.num_observed % window
        losses = jnp.where(finite, state.losses.at[slot].set(loss), state.losses)
        grad_norms = jnp.where(finite, state.grad_norms.at[slot].set(grad_norm), state.grad_norms)
        return new_updates, SkipStepState(
            inner_state=new_inner,
            losses=losses,
            grad_norms=grad_norms,
            num_observed=state.num_observed + finite.astype(jnp.int32),
            num_skipped=state.num_skipped + skip.astype(jnp.int32),
            skipped=skip,
        )

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
