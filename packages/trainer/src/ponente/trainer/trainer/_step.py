"""The computation of one step, as the :class:`Trainer` compiles it: loss and gradients (accumulated over
microbatches), the optimizer update and the step's metrics; and the weighted loss of an evaluation batch."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

import ponente.namedtensor as hax
from ponente.namedtensor import NamedArray
from ponente.namedtensor.partitioning import ResourceMapping

from ..state import TrainerState, overwrite_mask
from ._batch import BatchLayout, split_microbatches


def _scalar(x: Any) -> jax.Array:
    array = x.array if isinstance(x, NamedArray) else jnp.asarray(x)
    if array.ndim != 0:
        raise ValueError(f"loss_fn must return a scalar, got an array of shape {array.shape}")
    return array.astype(jnp.float32)


def _extra(x: Any) -> Any:
    """An extra output of the loss function: scalars as float32 arrays, larger NamedArrays kept (float32)."""
    if isinstance(x, NamedArray) and x.ndim > 0:
        return x.astype(jnp.float32)
    return _scalar(x)


def _loss_and_metrics(out: Any) -> tuple[jax.Array, dict[str, Any]]:
    """A loss function's result: a scalar, or ``(scalar, {name: value})`` with extra outputs: scalars are metrics to
    log, NamedArrays with axes (e.g. a mixture of experts' load per expert) go to ``after_update`` only."""
    if isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], Mapping):
        return _scalar(out[0]), {str(k): _extra(v) for k, v in out[1].items()}
    return _scalar(out), {}


def _scalars(extra: Mapping[str, Any]) -> dict[str, jax.Array]:
    return {k: v for k, v in extra.items() if not isinstance(v, NamedArray)}


def _update_if_finite(finite: jax.Array, update: Callable[[], TrainerState], old: TrainerState) -> TrainerState:
    """``update()`` where ``finite`` is true, else ``old``: the optimizer update runs inside a ``lax.cond``.

    Not an element-wise select of the new and the old state: XLA then recomputes the new optimizer moments in the
    fusion that writes the parameters, which reads the old moments after their buffers were updated in place, so it
    copies every donated moment (two copies of the parameters' size per step; none with the ``cond``). The new leaves
    keep the dtypes of the old ones, as ``optax.apply_updates`` keeps the parameters'.
    """
    old_arrays, static = eqx.partition(old, eqx.is_array)

    def apply(_: None) -> Any:
        new_arrays = eqx.partition(update(), eqx.is_array)[0]
        return jax.tree_util.tree_map(
            lambda n, o: n if n.dtype == o.dtype else n.astype(o.dtype), new_arrays, old_arrays
        )

    arrays = jax.lax.cond(finite, apply, lambda _: old_arrays, None)
    kept: TrainerState = eqx.combine(arrays, static)
    return kept


def _used_states(new: Any, old: Any) -> Any:
    """The new FP8 states, except where a layer took no part in the differentiated loss.

    The "gradient" of an overwritten state is its new value only when the layer's product was differentiated; a layer
    that was not (unused, or used under ``stop_gradient`` like a frozen DPO reference) gets a zero cotangent. A new
    state of all zeros is never a real one (scales are > 0), so there the old state is kept.
    """
    return jax.tree_util.tree_map(lambda n, o: jnp.where(jnp.any(n != 0), n, o), new, old)


class TrainStep:
    """The functions a :class:`Trainer` compiles: :meth:`train` (one optimizer step) and :meth:`eval` (one batch).

    Both take a batch as its plain arrays plus its static :class:`BatchLayout` and shard it by the compute
    mapping. The loss is the mean over the batch, computed in ``num_microbatches`` microbatches (scanned)
    when more than one, each weighted by ``loss_weight_fn``; the model is cast to the compute dtype of
    ``mp`` inside the step, while parameters and gradients keep the parameter dtype.

    Args:
        loss_fn: ``loss_fn(model, batch, *, key)`` (see ``LossFn``).
        optimizer: the optax transformation, accepting the extra ``update`` arguments ``loss``, ``obj_fn``, ``key``.
        mp: the jmp mixed-precision policy.
        batch_axis: the name of the batch axis.
        num_microbatches: microbatches per step (1: no accumulation).
        compute_axis_mapping: logical -> mesh axes while computing.
        loss_weight_fn: the weight of a (micro)batch.
        optimizer_metrics_fn: metrics read from the new optimizer state.
        lr_schedule: the learning-rate schedule for the ``learning_rate`` metric (None: read it from the state).
        on_nonfinite_loss: ``"skip"``: a step whose loss or gradient norm is not finite keeps the parameters and
            optimizer state (the step counter and the training key advance); ``"stop"``: such a step returns
            the state it was given, unchanged.
        after_update: ``after_update(model, extra) -> model``, applied to the updated model inside the step, outside
            the gradient (e.g. a mixture of experts' balancing bias); ``extra`` holds the loss function's extra
            outputs, averaged over microbatches (None: nothing).
    """

    def __init__(
        self,
        *,
        loss_fn: Callable[..., Any],
        optimizer: optax.GradientTransformationExtraArgs,
        mp: Any,
        batch_axis: str,
        num_microbatches: int,
        compute_axis_mapping: ResourceMapping,
        loss_weight_fn: Callable[[Any], Any],
        optimizer_metrics_fn: Callable[[Any], Mapping[str, Any]],
        lr_schedule: optax.Schedule | None,
        on_nonfinite_loss: str = "skip",
        after_update: Callable[[Any, Mapping[str, Any]], Any] | None = None,
    ):
        self.loss_fn = loss_fn
        self.optimizer = optimizer
        self.mp = mp
        self.batch_axis = batch_axis
        self.num_microbatches = num_microbatches
        self.compute_axis_mapping = compute_axis_mapping
        self.loss_weight_fn = loss_weight_fn
        self.optimizer_metrics_fn = optimizer_metrics_fn
        self.lr_schedule = lr_schedule
        self.on_nonfinite_loss = on_nonfinite_loss
        self.after_update = after_update

    def _loss_and_grad(
        self, params: tuple[Any, Any], rest: Any, batch: Any, key: jax.Array, *, cast: bool = True
    ) -> tuple[jax.Array, dict[str, jax.Array], tuple[Any, Any]]:
        """The loss, its extra metrics and the gradient wrt ``params`` = ``(trainable, overwrites)``: the second
        half's "gradient" is the new value of those states (FP8 scales, see ``TrainerState.split_overwrites``).
        ``cast=False``: the parameters are already in the compute dtype (the gradient is then in it too); the
        overwritten states are never cast."""

        def loss_of(params: tuple[Any, Any]) -> tuple[jax.Array, dict[str, jax.Array]]:
            trainable, overwrites = params
            model = eqx.combine(trainable, rest)
            if cast:
                model = self.mp.cast_to_compute(model)
            model = eqx.combine(model, overwrites)
            return _loss_and_metrics(self.loss_fn(model, batch, key=key))

        (loss, extra), grads = jax.value_and_grad(loss_of, has_aux=True)(params)
        return loss, extra, grads

    def _accumulate(
        self, params: tuple[Any, Any], rest: Any, batch: Any, key: jax.Array
    ) -> tuple[jax.Array, dict[str, jax.Array], tuple[Any, Any]]:
        n = self.num_microbatches
        stacked, unstack = split_microbatches(batch, self.batch_axis, n)
        scanned = [s for s in stacked if s is not None]
        where = [s is not None for s in stacked]
        # the model is cast to the compute dtype once for all microbatches, not in each: the gradient wrt the cast
        # parameters, converted to the parameter dtype, is the same number as the gradient wrt the parameters (the
        # derivative of a cast is the cast back), and the conversion is added into the float32 sum below
        trainable, overwrites = params
        compute_params = (self.mp.cast_to_compute(trainable), overwrites)
        compute_rest = self.mp.cast_to_compute(rest)

        def micro_grads(index: jax.Array, slices: Any) -> tuple[Any, ...]:
            it = iter(slices)
            micro = hax.auto_sharded(unstack([next(it) if w else None for w in where]))
            loss, extra, grads = self._loss_and_grad(
                compute_params, compute_rest, micro, jax.random.fold_in(key, index), cast=False
            )
            return loss, extra, grads, jnp.asarray(self.loss_weight_fn(micro), jnp.float32)

        def body(carry: Any, xs: Any) -> Any:
            (grad_sum, new_states), loss_sum, extra_sum, weight_sum = carry
            loss, extra, (grads, states), weight = micro_grads(*xs)
            grad_sum = jax.tree_util.tree_map(lambda acc, g: acc + weight * g.astype(acc.dtype), grad_sum, grads)
            # every microbatch starts from the same FP8 state, so the new scales agree and the newest amax of the
            # batch is the largest of the microbatches' (all these values are >= 0)
            new_states = jax.tree_util.tree_map(jnp.maximum, new_states, states)
            extra_sum = {k: extra_sum[k] + weight * v for k, v in extra.items()}
            return ((grad_sum, new_states), loss_sum + weight * loss, extra_sum, weight_sum + weight), None

        # the extra metrics' names are only known from tracing the loss once
        extra_shapes = jax.eval_shape(micro_grads, jnp.zeros((), jnp.int32), [s[0] for s in scanned])[1]
        zeros = jax.tree_util.tree_map(jnp.zeros_like, params)
        scalar_zero = jnp.zeros((), jnp.float32)
        extra_zeros = jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, jnp.float32), extra_shapes)
        init = (zeros, scalar_zero, extra_zeros, scalar_zero)
        ((grad_sum, new_states), loss_sum, extra_sum, weight_sum), _ = jax.lax.scan(
            body, init, (jnp.arange(n), scanned)
        )
        total = jnp.maximum(weight_sum, jnp.finfo(jnp.float32).tiny)
        grads = jax.tree_util.tree_map(lambda g: (g / total).astype(g.dtype), grad_sum)
        return loss_sum / total, {k: v / total for k, v in extra_sum.items()}, (grads, new_states)

    def train(
        self, state: TrainerState, arrays: list[Any], layout: BatchLayout
    ) -> tuple[TrainerState, dict[str, jax.Array]]:
        """One optimizer step: the next state and the metrics ``loss``, ``grad_norm``, ``learning_rate`` (when
        known) and those of ``optimizer_metrics_fn``, plus the loss function's own (see ``LossFn``)."""
        batch = hax.shard(layout.restore(arrays), self.compute_axis_mapping)
        next_key, step_key = jax.random.split(state.training_key)
        loss_key, opt_key = jax.random.split(step_key)
        trainable, overwrites, rest = state.split_overwrites()
        if self.num_microbatches == 1:
            loss, extra, (grads, new_states) = self._loss_and_grad((trainable, overwrites), rest, batch, loss_key)
        else:
            loss, extra, (grads, new_states) = self._accumulate((trainable, overwrites), rest, batch, loss_key)

        def obj_fn(params: Any) -> jax.Array:
            model = eqx.combine(self.mp.cast_to_compute(eqx.combine(params, rest)), overwrites)
            return _loss_and_metrics(self.loss_fn(model, batch, key=loss_key))[0]

        grad_norm = optax.tree.norm(grads)
        # a NaN/Inf loss or gradient never reaches the parameters: the update is dropped here, inside the step
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        if self.on_nonfinite_loss == "skip":
            unchanged = dataclasses.replace(state, step=state.step + 1, training_key=next_key)
        else:
            unchanged = state

        def update() -> TrainerState:
            updates, opt_state = self.optimizer.update(
                grads, state.opt_state, trainable, loss=loss, obj_fn=obj_fn, key=opt_key
            )
            model = eqx.combine(eqx.apply_updates(trainable, updates), _used_states(new_states, overwrites), rest)
            if self.after_update is not None:
                model = self.after_update(model, extra)
            return dataclasses.replace(
                state, step=state.step + 1, model=model, opt_state=opt_state, training_key=next_key
            )

        new_state = _update_if_finite(finite, update, unchanged)
        metrics = {
            **_scalars(extra),
            "loss": loss,
            "grad_norm": grad_norm,
            **self.optimizer_metrics_fn(new_state.opt_state),
        }
        lr = self._learning_rate(state)
        if lr is not None:
            metrics["learning_rate"] = jnp.asarray(lr, jnp.float32)
        return new_state, metrics

    def _learning_rate(self, state: TrainerState) -> Any:
        if self.lr_schedule is not None:
            return self.lr_schedule(state.step)
        try:
            return optax.tree_utils.tree_get(state.opt_state, "learning_rate")
        except KeyError:  # several learning rates in the state: none is "the" learning rate
            return None

    def eval(self, model: Any, arrays: list[Any], layout: BatchLayout) -> tuple[dict[str, jax.Array], jax.Array]:
        """The loss of ``model`` on one batch and the loss function's own metrics, each times the batch's weight
        (``{"loss": ..., name: ...}``), and the weight."""
        batch = hax.shard(layout.restore(arrays), self.compute_axis_mapping)
        states, rest = eqx.partition(model, overwrite_mask(model))
        loss, extra = _loss_and_metrics(
            self.loss_fn(eqx.combine(self.mp.cast_to_compute(rest), states), batch, key=None)
        )
        weight = jnp.asarray(self.loss_weight_fn(batch), jnp.float32)
        return {name: value * weight for name, value in {**_scalars(extra), "loss": loss}.items()}, weight
