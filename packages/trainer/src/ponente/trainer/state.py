"""The training state: step, model, optimizer state and training key, as one pytree.

Everything a run needs to continue bitwise identically lives here, so a checkpoint of a
:class:`TrainerState` (plus the step-indexed data) is a complete resume point.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

from ponente.namedtensor.quantization import OverwriteWithGradient

__all__ = ["FilterTree", "TrainerState", "init_state", "overwrite_mask", "trainable_filter"]

FilterTree = bool | Callable[[Any], bool] | Any
"""Which parts of a model train: True (all floating arrays), a function of a leaf, or a pytree prefix of
the model whose leaves are bools or such functions (as ``equinox.partition`` accepts)."""


def _is_overwrite(x: Any) -> bool:
    return isinstance(x, OverwriteWithGradient)


def overwrite_mask(model: Any) -> Any:
    """A bool per leaf of ``model``: True for the arrays of modules that a step overwrites with their gradient.

    Those are the states of FP8 products (scales and amax histories, see
    :class:`ponente.namedtensor.quantization.OverwriteWithGradient`): their gradient is their new value, so they are
    never given to the optimizer.
    """

    def mark(node: Any) -> Any:
        return jax.tree_util.tree_map(lambda _: True, node) if _is_overwrite(node) else False

    return jax.tree_util.tree_map(mark, model, is_leaf=_is_overwrite)


def trainable_filter(model: Any, is_trainable: FilterTree = True) -> Any:
    """The boolean mask of the model's trainable leaves: floating-point arrays selected by ``is_trainable``, except
    the overwritten states of FP8 products (see :func:`overwrite_mask`).

    Args:
        model: the model (a pytree, e.g. an Equinox module).
        is_trainable: see :data:`FilterTree`.

    Returns:
        A pytree with the model's structure and a bool per leaf.

    Example:
        >>> import jax.numpy as jnp
        >>> trainable_filter({"w": jnp.ones(2), "n": jnp.arange(2)})
        {'n': False, 'w': True}
    """
    selected = eqx.filter(model, is_trainable, replace=_Missing())
    return jax.tree_util.tree_map(
        lambda leaf, sel, over: (not isinstance(sel, _Missing)) and eqx.is_inexact_array(leaf) and not over,
        model,
        selected,
        overwrite_mask(model),
    )


class _Missing:
    """Placeholder for filtered-out leaves (None would vanish from the tree)."""


class TrainerState(eqx.Module):
    """Step counter, model, optimizer state and training key of a run.

    Attributes:
        step: the number of completed steps (int32 scalar array).
        model: the model; its parameters are stored in the parameter dtype of the mixed-precision policy.
        opt_state: the optimizer state for the trainable parameters.
        training_key: PRNG key; every step splits it into its own key and the next state's key.
        is_trainable: which parts of the model train (static; see :data:`FilterTree`).
    """

    step: jax.Array
    model: Any
    opt_state: Any
    training_key: jax.Array
    is_trainable: FilterTree = eqx.field(static=True, default=True)

    @property
    def trainable_model(self) -> Any:
        """The trainable parameters: the model with every other leaf replaced by None.

        This is the ``params`` tree the optimizer sees: same structure as the model (modules stay
        nodes, NamedArrays keep their axes), non-trainable leaves None.
        """
        return eqx.filter(self.model, trainable_filter(self.model, self.is_trainable))

    def split_trainable(self) -> tuple[Any, Any]:
        """The model split into (trainable parameters, everything else); ``eqx.combine`` joins them.

        Returns:
            The two halves, each with the model's structure and None where the other has a leaf.
        """
        return eqx.partition(self.model, trainable_filter(self.model, self.is_trainable))

    def split_overwrites(self) -> tuple[Any, Any, Any]:
        """The model split into (trainable parameters, overwritten states, everything else).

        The overwritten states (FP8 scales and histories, see :func:`overwrite_mask`) are differentiated with the
        parameters but replaced by their gradient instead of being optimized. ``eqx.combine`` joins the three.
        """
        trainable, rest = self.split_trainable()
        overwrites, rest = eqx.partition(rest, overwrite_mask(rest))
        return trainable, overwrites, rest


def init_state(
    model: Any,
    optimizer: optax.GradientTransformation,
    key: jax.Array,
    *,
    is_trainable: FilterTree = True,
) -> TrainerState:
    """A fresh state at step 0: ``optimizer`` initialized on the trainable parameters of ``model``.

    Args:
        model: the initial model.
        optimizer: the optax optimizer.
        key: the training key (the state's ``training_key``).
        is_trainable: which parts of the model train (see :data:`FilterTree`).

    Returns:
        The state.

    Example:
        >>> import jax, jax.numpy as jnp, optax
        >>> state = init_state({"w": jnp.zeros(3)}, optax.sgd(0.1), jax.random.PRNGKey(0))
        >>> int(state.step), state.opt_state
        (0, (EmptyState(), EmptyState()))
    """
    params = eqx.filter(model, trainable_filter(model, is_trainable))
    return TrainerState(
        step=jnp.asarray(0, dtype=jnp.int32),
        model=model,
        opt_state=optimizer.init(params),
        training_key=key,
        is_trainable=is_trainable,
    )
