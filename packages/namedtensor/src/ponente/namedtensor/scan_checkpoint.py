"""Gradient checkpointing for scans: :class:`ScanCheckpointPolicy` says what a scan body keeps for the backward pass.

A scan body (one layer of ``nn.Stacked``, one step of ``hax.scan``) takes a *carry* and *inputs* (the slices of the
scanned arguments) and computes *internals*. Without checkpointing, the backward pass keeps every internal of every
step. A policy keeps only some of them (the carries, the inputs, internals tagged with
:func:`~ponente.namedtensor.jax_utils.tree_checkpoint_name`) and recomputes the rest, or moves them to host memory
(``"offload"``). ``nested`` splits the steps into about ``sqrt(N)`` groups and keeps only the carries between
groups. ``hax.scan``/``hax.fold``/``hax.map`` take a policy as ``remat=`` and ``nn.Stacked``/``nn.BlockSeq`` as
``gradient_checkpointing=``; both also accept the shortcuts of :meth:`ScanCheckpointPolicy.from_bool_or_str`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any, Literal

import equinox as eqx
import jax

__all__ = ["ScanCheckpointPolicy", "ScanCheckpointSpec"]

Offload = bool | Literal["offload"]


@dataclasses.dataclass(frozen=True)
class ScanCheckpointPolicy:
    """What a scan over blocks keeps for the backward pass; the rest is recomputed.

    Attributes:
        save_carries: keep the carry entering each step (True), move it to host memory (``"offload"``), or
            recompute it (False).
        save_inputs: keep the step's slices of the scanned arguments (True, False or ``"offload"``).
        save_block_internals: True keeps every internal (only the names excluded by ``save_carries=False`` or
            ``save_inputs=False`` are recomputed); a list of names keeps the values tagged with
            :func:`~ponente.namedtensor.jax_utils.tree_checkpoint_name` under those names.
        offload_block_internals: names of tagged internals to keep in host memory.
        prevent_cse: stop XLA from merging recomputation with the forward pass (needed outside scans).
        disable: no checkpointing at all: every intermediate of every step is kept.
        simple: plain checkpointing: keep only what enters the step (the other fields are ignored).
        nested: False, True (split the steps into about ``sqrt(N)`` groups) or the number of groups (it must
            divide ``N``); only the carries between groups are kept, so memory is ``O(sqrt(N))`` carries.

    Example:
        >>> policy = ScanCheckpointPolicy(save_block_internals=["attn_out"])
        >>> policy.save_block_internals, ScanCheckpointPolicy.from_bool_or_str("nested").nested
        (('attn_out',), True)
    """

    save_carries: Offload = True
    save_inputs: Offload = False
    save_block_internals: bool | Sequence[str] = False
    offload_block_internals: Sequence[str] = ()
    prevent_cse: bool = False
    disable: bool = False
    simple: bool = False
    nested: bool | int = False

    def __post_init__(self) -> None:
        for field in ("save_carries", "save_inputs"):
            value = getattr(self, field)
            if value not in (True, False, "offload"):
                raise ValueError(f"ScanCheckpointPolicy.{field} must be True, False or 'offload', got {value!r}")
        for field in ("save_block_internals", "offload_block_internals"):
            value = getattr(self, field)
            if isinstance(value, str):
                raise ValueError(
                    f"ScanCheckpointPolicy.{field} must be a list of names, got the string {value!r}; "
                    f"write [{value!r}]"
                )
            if not isinstance(value, bool):
                object.__setattr__(self, field, tuple(value))
        if self.save_block_internals is True and self._offloaded():
            raise ValueError(
                "ScanCheckpointPolicy: save_block_internals=True keeps every internal on the device, so nothing can "
                "be offloaded; list the internals to keep instead"
            )
        if not isinstance(self.nested, bool) and (not isinstance(self.nested, int) or self.nested < 1):
            raise ValueError(f"ScanCheckpointPolicy.nested must be a bool or a positive int, got {self.nested!r}")

    def _offloaded(self, carry_name: str = "carry", input_name: str = "inputs") -> list[str]:
        names = [n for v, n in ((self.save_carries, carry_name), (self.save_inputs, input_name)) if v == "offload"]
        return names + list(self.offload_block_internals)

    @staticmethod
    def from_bool_or_str(remat_config: ScanCheckpointSpec) -> ScanCheckpointPolicy:
        """Turn a shortcut into a policy.

        Shortcuts: ``False``/``None``/``"none"`` (no checkpointing), ``True``/``"full"``/``"recompute"``
        (keep each step's carry, recompute its internals), ``"save_carries"`` (the same, named explicitly),
        ``"save_inputs"`` (keep carries and inputs), ``"nested"`` (sqrt-N nested checkpointing), ``"offload"``
        (carries and inputs to host memory), ``"save_all"`` (keep everything), a list of names (also keep those
        tagged internals), or a policy (returned as is).

        Args:
            remat_config: the shortcut.

        Returns:
            The policy.

        Raises:
            ValueError: for an unknown string (the message lists the known ones).
            TypeError: for another type.

        Example:
            >>> ScanCheckpointPolicy.from_bool_or_str("offload").save_carries
            'offload'
        """
        if isinstance(remat_config, ScanCheckpointPolicy):
            return remat_config
        if remat_config is None or remat_config is False:
            return ScanCheckpointPolicy(disable=True)
        if remat_config is True:
            return ScanCheckpointPolicy()
        if isinstance(remat_config, str):
            if remat_config not in _SHORTCUTS:
                raise ValueError(
                    f"unknown gradient checkpointing policy {remat_config!r}; expected one of {sorted(_SHORTCUTS)}, "
                    "a bool, a list of internal names, or a ScanCheckpointPolicy"
                )
            return _SHORTCUTS[remat_config]
        if isinstance(remat_config, (list, tuple)) and all(isinstance(n, str) for n in remat_config):
            return ScanCheckpointPolicy(save_block_internals=tuple(remat_config))
        raise TypeError(
            f"gradient checkpointing must be a bool, a string, a list of names or a policy, got {remat_config!r}"
        )

    def jax_policy(self, carry_name: str, input_name: str) -> Callable[..., Any] | None:
        """The :mod:`jax.checkpoint_policies` policy for a step whose carry and inputs are tagged with these names.

        Args:
            carry_name: the tag of the step's carry.
            input_name: the tag of the step's inputs.

        Returns:
            The policy, or None for "keep only what enters the step" (``simple``).
        """
        if self.simple:
            return None
        recomputed = [n for v, n in ((self.save_carries, carry_name), (self.save_inputs, input_name)) if v is False]
        if self.save_block_internals is True:
            if not recomputed:
                return jax.checkpoint_policies.everything_saveable
            return jax.checkpoint_policies.save_anything_except_these_names(*recomputed)
        saved = [n for v, n in ((self.save_carries, carry_name), (self.save_inputs, input_name)) if v is True]
        saved += list(self.save_block_internals or ())
        offloaded = self._offloaded(carry_name, input_name)
        if offloaded:
            return jax.checkpoint_policies.save_and_offload_only_these_names(
                names_which_can_be_saved=saved,
                names_which_can_be_offloaded=offloaded,
                offload_src="device",
                offload_dst="pinned_host",
            )
        return jax.checkpoint_policies.save_only_these_names(*saved)

    def checkpoint(self, step: Callable[..., Any], carry_name: str, input_name: str) -> Callable[..., Any]:
        """Wrap ``step`` with this policy (``step`` itself when ``disable``).

        ``step`` should tag its carry and inputs with ``carry_name`` and ``input_name``
        (:func:`~ponente.namedtensor.jax_utils.tree_checkpoint_name`) so that ``save_carries`` and ``save_inputs``
        apply; non-array arguments stay static.

        Args:
            step: the function to checkpoint.
            carry_name: the tag of its carry.
            input_name: the tag of its inputs.

        Returns:
            The checkpointed function.
        """
        if self.disable:
            return step
        return eqx.filter_checkpoint(
            step, prevent_cse=self.prevent_cse, policy=self.jax_policy(carry_name, input_name)
        )

    def nested_groups(self, length: int) -> int | None:
        """The number of groups a nested scan of ``length`` steps uses (None: not nested).

        Args:
            length: the number of steps.

        Returns:
            The divisor of ``length`` nearest ``sqrt(length)`` when ``nested`` is True, ``nested`` when it is an
            int, None otherwise.

        Raises:
            ValueError: if ``nested`` is an int that does not divide ``length``.

        Example:
            >>> ScanCheckpointPolicy(nested=True).nested_groups(12)
            3
        """
        if self.disable or self.nested is False:
            return None
        if self.nested is True:
            target = math.isqrt(length)
            return min((d for d in range(1, length + 1) if length % d == 0), key=lambda d: (abs(d - target), d))
        if length % self.nested != 0:
            raise ValueError(
                f"nested checkpointing: {self.nested} groups do not divide {length} layers; "
                f"choose a divisor of {length}"
            )
        return int(self.nested)


_SHORTCUTS: dict[str, ScanCheckpointPolicy] = {
    "none": ScanCheckpointPolicy(disable=True),
    "full": ScanCheckpointPolicy(),
    "recompute": ScanCheckpointPolicy(),
    "save_carries": ScanCheckpointPolicy(save_carries=True, save_inputs=False),
    "save_inputs": ScanCheckpointPolicy(save_carries=True, save_inputs=True),
    "nested": ScanCheckpointPolicy(nested=True),
    "offload": ScanCheckpointPolicy(save_carries="offload", save_inputs="offload"),
    "save_all": ScanCheckpointPolicy(save_carries=True, save_inputs=True, save_block_internals=True),
}

ScanCheckpointSpec = ScanCheckpointPolicy | bool | str | Sequence[str] | None
"""A policy, or a shortcut accepted by :meth:`ScanCheckpointPolicy.from_bool_or_str`."""
