"""Named internals of the transformer blocks, for selective gradient checkpointing.

Every block of the zoo tags a few of its intermediate values with a name (:func:`tag`, i.e.
:func:`jax.ad_checkpoint.checkpoint_name`). A model's ``gradient_checkpointing`` may then be a list of these names:
the layers are checkpointed (their other internals are recomputed in the backward pass) but the listed values are
kept, so the backward pass does not recompute the products that made them. This is the middle ground between no
checkpointing (every internal kept: the most memory) and full checkpointing (only each layer's input kept: one
more forward pass of compute). A :class:`~ponente.namedtensor.ScanCheckpointPolicy` may also move named values to
host memory (``offload_block_internals``).

The names (:data:`CHECKPOINT_NAMES`), in the order a block computes them:

- ``attn_qkv``: the queries, keys and values as they enter the attention kernel (after the projections, the
  QK norm and the rotary embedding). Kept, the backward pass does not recompute the three input projections.
- ``attn_context``: the attention kernel's output, before the output projection. Kept, the output projection's
  gradient does not need the kernel again; the kernel's own backward still does: the softmax probabilities (or a
  fused kernel's running maximum and sum) are not named values, so the kernel runs forward again for them.
- ``attn_out``: the attention sublayer's output (after the output projection, before the residual sum).
- ``mlp_in``: the MLP's input projections before the activation (gate and up of a gated MLP; ``c_fc``/``fc1`` of
  GPT-2 and Whisper; every expert's of a mixture of experts).
- ``mlp_out``: the MLP's output (after the down projection; a mixture of experts: the combined output).

Tags are identities outside a checkpointed block: they cost nothing when ``gradient_checkpointing`` is off.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

from ponente.namedtensor import ScanCheckpointPolicy
from ponente.namedtensor.nn import tree_checkpoint_name

__all__ = ["CHECKPOINT_NAMES", "check_gradient_checkpointing", "tag"]

T = TypeVar("T")

CHECKPOINT_NAMES: tuple[str, ...] = ("attn_qkv", "attn_context", "attn_out", "mlp_in", "mlp_out")
"""The internals every block tags, in the order it computes them (see the module's documentation)."""


def tag(tree: T, name: str) -> T:
    """Tag the arrays of ``tree`` with one of :data:`CHECKPOINT_NAMES` (an identity outside checkpointing).

    Args:
        tree: a NamedArray, array or pytree of them.
        name: one of :data:`CHECKPOINT_NAMES`.

    Returns:
        ``tree``, tagged.

    Raises:
        ValueError: for a name that is not in :data:`CHECKPOINT_NAMES`.
    """
    if name not in CHECKPOINT_NAMES:
        raise ValueError(f"unknown checkpoint name {name!r}; expected one of {CHECKPOINT_NAMES}")
    return tree_checkpoint_name(tree, name)


def check_gradient_checkpointing(value: Any, where: str) -> Any:
    """Validate a model's ``gradient_checkpointing`` and return it in a hashable form.

    Accepted: a bool, None, a shortcut string of :meth:`ScanCheckpointPolicy.from_bool_or_str` (``"full"``,
    ``"offload"``, ``"nested"``, ...), a list of :data:`CHECKPOINT_NAMES` (returned as a tuple) or a
    :class:`~ponente.namedtensor.ScanCheckpointPolicy` whose ``save_block_internals``/``offload_block_internals``
    name only those internals.

    Args:
        value: the setting.
        where: the config key, for messages (e.g. ``"LlamaConfig.gradient_checkpointing"``).

    Returns:
        ``value``, with a list turned into a tuple.

    Raises:
        ValueError: naming ``where`` for an unknown shortcut, an unknown internal name or another type.

    Example:
        >>> check_gradient_checkpointing(["attn_context", "attn_qkv"], "gradient_checkpointing")
        ('attn_context', 'attn_qkv')
    """
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, str):
        try:
            ScanCheckpointPolicy.from_bool_or_str(value)
        except ValueError as err:
            raise ValueError(f"{where}: {err}") from None
        return value
    if isinstance(value, ScanCheckpointPolicy):
        names: Sequence[str] = list(value.offload_block_internals)
        if not isinstance(value.save_block_internals, bool):
            names = [*value.save_block_internals, *names]
        _check_names(names, where)
        return value
    if isinstance(value, (list, tuple)) and all(isinstance(n, str) for n in value):
        _check_names(value, where)
        return tuple(value)
    raise ValueError(
        f"{where} must be a bool, a policy name (e.g. 'full', 'offload'), a list of the internals to keep "
        f"(of {list(CHECKPOINT_NAMES)}) or a ScanCheckpointPolicy; got {value!r}"
    )


def _check_names(names: Sequence[str], where: str) -> None:
    unknown = [n for n in names if n not in CHECKPOINT_NAMES]
    if unknown:
        raise ValueError(
            f"{where}: unknown internal name(s) {unknown}; the blocks tag {list(CHECKPOINT_NAMES)} "
            "(see ponente.models.remat)"
        )
