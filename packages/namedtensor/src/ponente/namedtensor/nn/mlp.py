"""``MLP``: a stack of :class:`Linear` layers with an activation between them."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax

from ..axis import Axis, AxisSpec
from ..core import NamedArray
from ..dot_general import DotGeneralOp
from ..jax_utils import maybe_rng_split
from .activations import relu
from .linear import Linear

__all__ = ["MLP"]


class MLP(eqx.Module):
    """A multi-layer perceptron: ``depth`` hidden layers of size ``width``, activation between layers.

    Hidden layers alternate between the axes ``mlp`` and ``mlp2`` (a Linear cannot map an axis to itself).

    Attributes:
        activation: the activation applied after every layer but the last (static).
        layers: the Linear layers.

    Example:
        >>> import jax
        >>> import ponente.namedtensor as hax
        >>> In, Out = hax.Axis("in", 3), hax.Axis("out", 2)
        >>> mlp = MLP.init(In, Out, width=8, depth=2, key=jax.random.key(0))
        >>> mlp(hax.ones({"b": 5, "in": 3})).shape
        {'b': 5, 'out': 2}
    """

    activation: Callable[[Any], Any] = eqx.field(static=True)
    layers: Sequence[Linear]

    @staticmethod
    def init(
        Input: AxisSpec,
        Output: AxisSpec,
        width: int | Axis,
        depth: int,
        activation: Callable[[Any], Any] = relu,
        *,
        out_first: bool = True,
        use_bias: bool = True,
        use_final_bias: bool = True,
        key: jax.Array,
        dot_general: DotGeneralOp | None = None,
        init_scale: float = 1.0,
    ) -> MLP:
        """Creates the MLP.

        Args:
            Input: the input axes.
            Output: the output axes.
            width: the hidden size (an int names the axis ``"mlp"``) or the hidden axis.
            depth: the number of hidden layers (0 gives a single Linear).
            activation: the activation function.
            out_first: weight layout of every Linear.
            use_bias: whether the hidden layers have biases.
            use_final_bias: whether the last layer has a bias.
            key: the PRNG key.
            dot_general: the contraction operator for every Linear.
            init_scale: passed to every Linear.

        Returns:
            The MLP.

        Raises:
            ValueError: if ``depth`` is negative.
        """
        if depth < 0:
            raise ValueError(f"MLP.init: depth must be >= 0, got {depth}")
        Width = width if isinstance(width, Axis) else Axis("mlp", width)
        Width2 = Width.alias(Width.name + "2")
        keys = jax.random.split(key, depth + 1)
        common: dict[str, Any] = {"out_first": out_first, "dot_general": dot_general, "init_scale": init_scale}
        layers: list[Linear] = []
        if depth == 0:
            layers.append(Linear.init(Input, Output, key=keys[0], use_bias=use_final_bias, **common))
        else:
            layers.append(Linear.init(Input, Width, key=keys[0], use_bias=use_bias, **common))
            current = Width
            for i in range(1, depth):
                nxt = Width2 if current == Width else Width
                layers.append(Linear.init(current, nxt, key=keys[i], use_bias=use_bias, **common))
                current = nxt
            layers.append(Linear.init(current, Output, key=keys[-1], use_bias=use_final_bias, **common))
        return MLP(activation, tuple(layers))

    def __call__(self, x: NamedArray, *, key: jax.Array | None = None) -> NamedArray:
        """Applies the layers, with the activation after each but the last.

        Args:
            x: the input, with the ``Input`` axes.
            key: optional PRNG key, split among the layers.

        Returns:
            The output, with the ``Output`` axes.
        """
        keys = maybe_rng_split(key, len(self.layers))
        for layer, k in zip(self.layers[:-1], keys[:-1], strict=True):
            x = self.activation(layer(x, key=k))
        return self.layers[-1](x, key=keys[-1])
