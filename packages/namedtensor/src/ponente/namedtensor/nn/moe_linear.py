"""``MoELinear``: one linear map per expert, applied to contiguous groups of tokens (a grouped matmul)."""

from __future__ import annotations

import math

import equinox as eqx
import jax

from .. import random as hrandom
from ..axis import Axis, replace_axis
from ..core import NamedArray
from ..creation import zeros
from ..jax_utils import named_call
from ..partitioning import auto_sharded

__all__ = ["MoELinear"]


class MoELinear(eqx.Module):
    """A linear layer with one weight per expert, for tokens already sorted by expert.

    The tokens (every axis of the input but ``In``, flattened in order) come in contiguous groups: the
    first ``group_sizes[0]`` go through expert 0, the next ``group_sizes[1]`` through expert 1, and so on.
    Each group is multiplied by its expert's weight in one grouped matrix product
    (``jax.lax.ragged_dot_general``), so no token is padded or multiplied by another expert's weight.

    Attributes:
        weight: the weights, axes ``(Experts, In, Out)``, or ``(Experts, Out, In)`` when ``out_first``.
        bias: a bias over ``Out`` shared by all experts, or None.
        Experts: the expert axis (static).
        In: the input axis (static).
        Out: the output axis (static).
        use_gmm: accepted for Haliax compatibility, where it selects a Pallas TPU kernel; here the product
            is always ``jax.lax.ragged_dot_general``, which XLA lowers to a grouped matmul on every backend.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> import ponente.namedtensor as hax
        >>> Tokens, E, In, Out = hax.make_axes(tokens=5, experts=2, embed=4, mlp=3)
        >>> moe = MoELinear.init(E, In, Out, key=jax.random.key(0))
        >>> x = hax.ones((Tokens, In))  # tokens 0-2 for expert 0, tokens 3-4 for expert 1
        >>> moe(x, hax.named(jnp.array([3, 2]), E)).axes == (Tokens, Out)
        True
    """

    weight: NamedArray
    bias: NamedArray | None
    Experts: Axis = eqx.field(static=True)
    In: Axis = eqx.field(static=True)
    Out: Axis = eqx.field(static=True)
    use_gmm: bool = eqx.field(static=True, default=False)

    @staticmethod
    def init(
        Experts: Axis,
        In: Axis,
        Out: Axis,
        *,
        key: jax.Array,
        use_bias: bool = True,
        out_first: bool = False,
        init_scale: float = 1.0,
        use_gmm: bool = False,
    ) -> MoELinear:
        """Creates the layer with weights from a truncated normal (±3σ), σ = ``init_scale / sqrt(In.size)``.

        Args:
            Experts: the expert axis.
            In: the input axis (contracted).
            Out: the output axis.
            key: the PRNG key for the weights.
            use_bias: whether to add a (zero-initialized) bias over ``Out``.
            out_first: store the weight as ``(Experts, Out, In)`` instead of ``(Experts, In, Out)``.
            init_scale: multiplies the standard deviation.
            use_gmm: see the class attribute (kept for Haliax compatibility).

        Returns:
            The layer.
        """
        axes = (Experts, Out, In) if out_first else (Experts, In, Out)
        weight = hrandom.truncated_normal(key, axes, -3.0, 3.0) * (init_scale / math.sqrt(In.size))
        bias = zeros(Out) if use_bias else None
        return MoELinear(weight, bias, Experts, In, Out, use_gmm=use_gmm)

    @named_call
    def __call__(self, inputs: NamedArray, group_sizes: NamedArray, *, key: jax.Array | None = None) -> NamedArray:
        """Multiplies each group of tokens by its expert's weight.

        Args:
            inputs: the tokens, with the ``In`` axis; all other axes are token axes (flattened in order).
            group_sizes: integer counts over ``Experts``, summing to at most the number of tokens
                (tokens after the last group give zeros, plus the bias).
            key: unused; accepted for a uniform layer interface.

        Returns:
            ``inputs`` with ``In`` replaced by ``Out`` (in the same position).

        Raises:
            ValueError: if ``inputs`` lacks ``In`` or ``group_sizes`` is not over ``Experts`` alone.
        """
        del key
        if not inputs.has_axis(self.In.name):
            raise ValueError(f"MoELinear: the input {inputs.axis_names} lacks the axis {self.In.name!r}")
        if group_sizes.axis_names != (self.Experts.name,):
            raise ValueError(
                f"MoELinear: group_sizes must have exactly the axis {self.Experts.name!r}, "
                f"got {group_sizes.axis_names}"
            )
        tokens_last = inputs.rearrange((..., self.In.name))
        token_axes = tokens_last.axes[:-1]
        flat = tokens_last.array.reshape(-1, self.In.size)
        w = self.weight
        dims = jax.lax.RaggedDotDimensionNumbers(
            dot_dimension_numbers=(((1,), (w.axis_indices(self.In),)), ((), ())),
            lhs_ragged_dimensions=(0,),
            rhs_group_dimensions=(w.axis_indices(self.Experts),),
        )
        out = jax.lax.ragged_dot_general(flat, w.array, group_sizes.array, dims)
        result = NamedArray(out.reshape(*(ax.size for ax in token_axes), self.Out.size), (*token_axes, self.Out))
        result = result.rearrange(replace_axis(inputs.axes, self.In.name, self.Out))
        if self.bias is not None:
            result = result + self.bias
        return auto_sharded(result)

    @property
    def out_first(self) -> bool:
        """Whether the weight is stored ``(Experts, Out, In)``."""
        return self.weight.axis_names.index(self.Out.name) < self.weight.axis_names.index(self.In.name)
