"""Scan over layers: :class:`Stacked` (one set of parameters with a layers axis, applied by ``scan``) and
:class:`BlockSeq` (the same interface, unrolled), with gradient-checkpointing policies.

``Stacked`` compiles the block once however many layers there are; ``BlockSeq`` keeps a Python list
of blocks (useful when layers differ in Python-level configuration, or to debug). Both are built by
``X.init(Layers, Block, gradient_checkpointing=...)(*args, key=keys)``, where arguments that carry
the layers axis (NamedArrays with it, plain arrays along their first dimension, e.g. a key per
layer) are split per layer and everything else is passed to every layer.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Generic, Literal, Protocol, TypeVar, runtime_checkable

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from ..axis import Axis
from ..core import NamedArray
from ..hof import scan as _hax_scan
from ..hof import vmap as _hax_vmap
from ..state_dict import (
    ModuleWithStateDictSerialization,
    StateDict,
    from_state_dict,
    stack_state_dict,
    to_state_dict,
    unstack_state_dict,
    with_prefix,
)

__all__ = [
    "BlockFoldable",
    "BlockSeq",
    "ScanCheckpointPolicy",
    "ScanCheckpointSpec",
    "Stacked",
    "tree_checkpoint_name",
]

M = TypeVar("M", bound=eqx.Module)
M_co = TypeVar("M_co", covariant=True)
Offload = bool | Literal["offload"]

_CARRY = "ponente_scan_carry"
_INPUTS = "ponente_scan_inputs"


def tree_checkpoint_name(tree: Any, name: str) -> Any:
    """Tag every array of ``tree`` (NamedArrays included) with ``name`` for checkpoint policies.

    Inside a block of :class:`Stacked`/:class:`BlockSeq`, a value tagged ``"y"`` is kept for the
    backward pass (instead of being recomputed) when the policy lists ``"y"`` in
    ``save_block_internals``.

    Args:
        tree: a NamedArray, array or pytree of them.
        name: the name.

    Returns:
        ``tree`` with tagged arrays (same values).

    Example:
        >>> import ponente.namedtensor as hax
        >>> tree_checkpoint_name(hax.ones({"embed": 2}), "h").shape
        {'embed': 2}
    """
    return jax.tree_util.tree_map(lambda x: checkpoint_name(x, name) if eqx.is_array(x) else x, tree)


@dataclasses.dataclass(frozen=True)
class ScanCheckpointPolicy:
    """What a scan over blocks keeps for the backward pass; the rest is recomputed.

    Attributes:
        save_carries: keep the carry entering each block (True), move it to host memory
            (``"offload"``), or recompute it (False; only meaningful with ``nested``).
        save_inputs: keep the other per-block inputs (extra arguments) (True, False or ``"offload"``).
        save_block_internals: True keeps everything (like no checkpointing); a list of names keeps
            the values tagged with :func:`tree_checkpoint_name` under those names.
        prevent_cse: stop XLA from merging recomputation with the forward pass (needed outside scans).
        disable: no checkpointing at all: every intermediate of every block is kept.
        simple: accepted for Haliax compatibility (a non-nested policy is always simple).
        nested: False, True (split the layers into about ``sqrt(N)`` groups) or the number of groups;
            only the carries between groups are kept, so memory is ``O(sqrt(N))`` carries.

    Example:
        >>> ScanCheckpointPolicy.from_bool_or_str("nested").nested
        True
    """

    save_carries: Offload = True
    save_inputs: Offload = False
    save_block_internals: bool | Sequence[str] = False
    prevent_cse: bool = False
    disable: bool = False
    simple: bool = False
    nested: bool | int = False

    def __post_init__(self) -> None:
        for field in ("save_carries", "save_inputs"):
            value = getattr(self, field)
            if value not in (True, False, "offload"):
                raise ValueError(f"ScanCheckpointPolicy.{field} must be True, False or 'offload', got {value!r}")
        internals = self.save_block_internals
        if isinstance(internals, str):
            raise ValueError(
                f"ScanCheckpointPolicy.save_block_internals must be a bool or a list of names, got the string "
                f"{internals!r}; write [{internals!r}]"
            )
        if not isinstance(internals, bool):
            object.__setattr__(self, "save_block_internals", tuple(internals))
        if not isinstance(self.nested, bool) and (not isinstance(self.nested, int) or self.nested < 1):
            raise ValueError(f"ScanCheckpointPolicy.nested must be a bool or a positive int, got {self.nested!r}")

    @staticmethod
    def from_bool_or_str(remat_config: ScanCheckpointSpec) -> ScanCheckpointPolicy:
        """Turn a shortcut into a policy.

        Shortcuts: ``False``/``None``/``"none"`` (no checkpointing), ``True``/``"full"``/``"recompute"``
        (keep each block's carry, recompute its internals), ``"save_carries"`` (the same, named
        explicitly), ``"save_inputs"`` (keep carries and the per-block extra inputs), ``"nested"``
        (sqrt-N nested checkpointing), ``"offload"`` (carries and inputs to host memory), ``"save_all"``
        (keep everything), a list of names (also keep those tagged internals), or a policy.

        Args:
            remat_config: the shortcut.

        Returns:
            The policy.

        Raises:
            ValueError: for an unknown string (the message lists the known ones).
            TypeError: for another type.
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

    def _jax_policy(self) -> Callable[..., Any]:
        if self.save_block_internals is True:
            return jax.checkpoint_policies.everything_saveable
        internals = () if self.save_block_internals is False else tuple(self.save_block_internals)
        saved = list(internals)
        offloaded: list[str] = []
        for value, name in ((self.save_carries, _CARRY), (self.save_inputs, _INPUTS)):
            if value == "offload":
                offloaded.append(name)
            elif value:
                saved.append(name)
        if offloaded:
            return jax.checkpoint_policies.save_and_offload_only_these_names(
                names_which_can_be_saved=saved,
                names_which_can_be_offloaded=offloaded,
                offload_src="device",
                offload_dst="pinned_host",
            )
        return jax.checkpoint_policies.save_only_these_names(*saved)

    def checkpoint(self, step: Callable[..., Any]) -> Callable[..., Any]:
        """Wrap a block step ``step(carry, block, *args, **kwargs)`` with this policy.

        The carry and the extra arguments are tagged so that ``save_carries``/``save_inputs`` apply;
        non-array arguments stay static.

        Args:
            step: the step function.

        Returns:
            The checkpointed step (``step`` itself when ``disable``).
        """
        if self.disable:
            return step

        def tagged(carry: Any, block: Any, *args: Any, **kwargs: Any) -> Any:
            carry = tree_checkpoint_name(carry, _CARRY)
            args, kwargs = tree_checkpoint_name((args, kwargs), _INPUTS)
            return step(carry, block, *args, **kwargs)

        return eqx.filter_checkpoint(tagged, prevent_cse=self.prevent_cse, policy=self._jax_policy())


_SHORTCUTS: dict[str, ScanCheckpointPolicy] = {
    "none": ScanCheckpointPolicy(disable=True),
    "full": ScanCheckpointPolicy(),
    "recompute": ScanCheckpointPolicy(),
    "save_carries": ScanCheckpointPolicy(save_carries=True, save_inputs=False),
    "save_inputs": ScanCheckpointPolicy(save_carries=True, save_inputs=True),
    "nested": ScanCheckpointPolicy(nested=True),
    "offload": ScanCheckpointPolicy(save_carries="offload", save_inputs="offload"),
    "save_all": ScanCheckpointPolicy(save_block_internals=True),
}

ScanCheckpointSpec = ScanCheckpointPolicy | bool | str | Sequence[str] | None
"""A policy, or a shortcut accepted by :meth:`ScanCheckpointPolicy.from_bool_or_str`."""


# ---------------------------------------------------------------------------------------------------
# per-layer slicing and stacking of pytrees (NamedArrays by the layers axis, plain arrays by dim 0)


def _is_named(x: Any) -> bool:
    return isinstance(x, NamedArray)


def _layer_dim(leaf: Any, name: str) -> int | None:
    if isinstance(leaf, NamedArray):
        names = [ax.name for ax in leaf.axes]
        return names.index(name) if name in names else None
    if isinstance(leaf, (jax.Array, np.ndarray)) and np.ndim(leaf) > 0:
        return 0
    return None


def _take_layer(tree: Any, Block: Axis, i: int) -> Any:
    """Layer ``i`` of ``tree``: leaves with the layers axis are indexed, others are returned whole."""

    def one(leaf: Any) -> Any:
        dim = _layer_dim(leaf, Block.name)
        if dim is None:
            return leaf
        if isinstance(leaf, NamedArray):
            return NamedArray(jnp.take(leaf.array, i, axis=dim), leaf.axes[:dim] + leaf.axes[dim + 1 :])
        if leaf.shape[0] != Block.size:
            raise ValueError(
                f"an array argument has leading dimension {leaf.shape[0]}, but it is split over the layers axis "
                f"{Block}; pass one entry per layer (e.g. jax.random.split(key, {Block.size}))"
            )
        return leaf[i]

    return jax.tree_util.tree_map(one, tree, is_leaf=_is_named)


def _stack_layers(Block: Axis, trees: Sequence[Any]) -> Any:
    """Stack per-layer pytrees of identical structure: NamedArrays get ``Block`` first, arrays a dim 0."""
    if len(trees) != Block.size:
        raise ValueError(f"expected {Block.size} layers for axis {Block}, got {len(trees)}")

    def one(*leaves: Any) -> Any:
        first = leaves[0]
        if isinstance(first, NamedArray):
            return NamedArray(jnp.stack([leaf.array for leaf in leaves]), (Block, *first.axes))
        if eqx.is_array(first):
            return jnp.stack(leaves)
        return first

    return jax.tree_util.tree_map(one, *trees, is_leaf=_is_named)


def _split_layers(tree: Any, Block: Axis, Outer: Axis, Inner: Axis) -> Any:
    """Reshape the layers axis ``Block`` into ``(Outer, Inner)`` (``Inner`` keeps ``Block``'s name)."""

    def one(leaf: Any) -> Any:
        dim = _layer_dim(leaf, Block.name)
        if dim is None:
            return leaf
        if isinstance(leaf, NamedArray):
            shape = (*leaf.array.shape[:dim], Outer.size, Inner.size, *leaf.array.shape[dim + 1 :])
            axes = (*leaf.axes[:dim], Outer, Inner, *leaf.axes[dim + 1 :])
            return NamedArray(jnp.reshape(leaf.array, shape), axes)
        return jnp.reshape(leaf, (Outer.size, Inner.size, *tuple(leaf.shape[1:])))

    return jax.tree_util.tree_map(one, tree, is_leaf=_is_named)


def _merge_layers(tree: Any, Block: Axis, Outer: Axis) -> Any:
    """Inverse of :func:`_split_layers` for scan outputs, whose two leading dims are ``(Outer, Inner)``."""

    def one(leaf: Any) -> Any:
        if isinstance(leaf, NamedArray):
            if not leaf.axes or leaf.axes[0].name != Outer.name:
                return leaf
            return NamedArray(jnp.reshape(leaf.array, (Block.size, *leaf.array.shape[2:])), (Block, *leaf.axes[2:]))
        if eqx.is_array(leaf):
            return jnp.reshape(leaf, (Block.size, *leaf.shape[2:]))
        return leaf

    return jax.tree_util.tree_map(one, tree, is_leaf=_is_named)


def _nested_groups(n: int, nested: bool | int) -> int:
    if nested is True:
        target = math.isqrt(n)
        return min((d for d in range(1, n + 1) if n % d == 0), key=lambda d: (abs(d - target), d))
    groups = int(nested)
    if n % groups != 0:
        raise ValueError(f"nested checkpointing: {groups} groups do not divide {n} layers; choose a divisor of {n}")
    return groups


# ---------------------------------------------------------------------------------------------------


def _module_init(module: Any) -> Callable[..., Any]:
    return getattr(module, "init", module)


@runtime_checkable
class BlockFoldable(Protocol[M_co]):
    """What :class:`Stacked` and :class:`BlockSeq` have in common (use it in type annotations)."""

    Block: Axis

    def fold(self, init: Any, *args: Any, **kwargs: Any) -> Any:
        """Apply the blocks in order, feeding each one's output to the next."""
        ...

    def scan(self, init: Any, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
        """Apply blocks that return ``(carry, output)``; outputs are stacked along the layers axis."""
        ...

    def vmap(self, init: Any, *args: Any, **kwargs: Any) -> Any:
        """Apply every block to the same input; outputs are stacked along the layers axis."""
        ...

    def unstacked(self) -> Sequence[M_co]:
        """The blocks as a sequence of modules."""
        ...


class _LayerSequence(ModuleWithStateDictSerialization, Generic[M]):
    """What `Stacked` and `BlockSeq` share: fold/scan/vmap are defined by each one's `_run` and `vmap_via`."""

    def _run(self, fn: Callable[..., Any], with_outputs: bool) -> Callable[..., tuple[Any, Any]]:
        raise NotImplementedError

    def vmap_via(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        raise NotImplementedError

    def fold(self, init: Any, *args: Any, **kwargs: Any) -> Any:
        """Apply the blocks in order: ``x = block_i(x, *args_i, **kwargs_i)`` for each layer ``i``.

        Arguments with the layers axis are split per layer; the rest go to every block.

        Args:
            init: the input of the first block.
            *args: extra positional arguments for each block.
            **kwargs: extra keyword arguments for each block.

        Returns:
            The output of the last block.
        """
        return self.fold_via(_call_block)(init, *args, **kwargs)

    def scan(self, init: Any, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
        """Apply blocks that return ``(carry, output)``; outputs are stacked along the layers axis.

        Args:
            init: the input carry of the first block.
            *args: extra positional arguments for each block.
            **kwargs: extra keyword arguments for each block.

        Returns:
            ``(last carry, outputs with the layers axis first)``.
        """
        return self.scan_via(_call_block)(init, *args, **kwargs)

    def vmap(self, init: Any, *args: Any, **kwargs: Any) -> Any:
        """Apply every block to the same ``init`` in parallel; outputs are stacked along the layers axis.

        Args:
            init: the input given to every block.
            *args: extra positional arguments (split per layer where they have the layers axis).
            **kwargs: extra keyword arguments (likewise).

        Returns:
            The outputs, with the layers axis first.
        """
        return self.vmap_via(_call_block)(init, *args, **kwargs)

    def fold_via(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """Fold with ``fn(block, carry, *args, **kwargs) -> carry`` instead of calling the block.

        Args:
            fn: e.g. an unbound method such as ``Block.decode``.

        Returns:
            A function ``(init, *args, **kwargs) -> final carry``.
        """
        run = self._run(fn, with_outputs=False)
        return lambda init, *args, **kwargs: run(init, *args, **kwargs)[0]

    def scan_via(self, fn: Callable[..., Any]) -> Callable[..., tuple[Any, Any]]:
        """Scan with ``fn(block, carry, *args, **kwargs) -> (carry, output)``.

        Args:
            fn: the per-block function.

        Returns:
            A function ``(init, *args, **kwargs) -> (final carry, stacked outputs)``.
        """
        return self._run(fn, with_outputs=True)


class Stacked(_LayerSequence[M]):
    """A stack of identical blocks whose parameters share a leading layers axis, applied by a scan.

    Every NamedArray in ``stacked`` has the ``Block`` axis and every plain array a leading dimension
    of that size (as if the layers had been stacked with :func:`ponente.namedtensor.stack`). ``fold``
    and ``scan`` run one compiled copy of the block ``Block.size`` times with ``jax.lax.scan``;
    ``gradient_checkpointing`` chooses what the backward pass keeps (see :class:`ScanCheckpointPolicy`).
    State dicts use numbered per-layer keys (``layers.0.…``), like PyTorch's ``ModuleList``.

    Attributes:
        stacked: one block whose arrays carry the layers axis.
        Block: the layers axis.
        gradient_checkpointing: the checkpointing policy or shortcut.

    Example:
        >>> import jax, equinox as eqx
        >>> import ponente.namedtensor as hax
        >>> class Scale(eqx.Module):
        ...     w: hax.NamedArray
        ...
        ...     @staticmethod
        ...     def init(Embed, *, key):
        ...         return Scale(hax.random.normal(key, Embed))
        ...
        ...     def __call__(self, x):
        ...         return x * self.w
        >>> Layers, Embed = hax.Axis("layers", 3), hax.Axis("embed", 4)
        >>> blocks = Stacked.init(Layers, Scale)(Embed, key=jax.random.split(jax.random.key(0), 3))
        >>> blocks.fold(hax.ones(Embed)).shape
        {'embed': 4}
    """

    stacked: M
    Block: Axis = eqx.field(static=True)
    gradient_checkpointing: ScanCheckpointSpec = eqx.field(static=True, default=False)

    @classmethod
    def init(
        cls,
        Block: Axis,
        module: type[M] | Callable[..., M],
        *,
        gradient_checkpointing: ScanCheckpointSpec = False,
        prevent_cse: bool = False,
    ) -> Callable[..., Stacked[M]]:
        """Return a constructor that builds ``Block.size`` blocks with ``module.init`` (or ``module``) and stacks them.

        The constructor's arguments are split per layer where they carry the layers axis (NamedArrays
        with ``Block``, plain arrays along dimension 0, e.g. ``key=jax.random.split(key, n)``) and are
        passed whole otherwise. The block is traced once (``vmap``), not ``n`` times.

        Args:
            Block: the layers axis.
            module: the block class (its ``init`` is used if it has one) or a factory function.
            gradient_checkpointing: the policy or shortcut (see :class:`ScanCheckpointPolicy`).
            prevent_cse: sets ``prevent_cse`` on a policy given as a shortcut.

        Returns:
            A function ``(*args, **kwargs) -> Stacked``.
        """
        policy = _with_prevent_cse(gradient_checkpointing, prevent_cse)
        factory = _module_init(module)

        @functools.wraps(factory)
        def build(*args: Any, **kwargs: Any) -> Stacked[M]:
            stacked = _hax_vmap(factory, Block)(*args, **kwargs)
            return cls(stacked, Block, policy)

        return build

    @property
    def _policy(self) -> ScanCheckpointPolicy:
        return ScanCheckpointPolicy.from_bool_or_str(self.gradient_checkpointing)

    def _run(self, fn: Callable[..., Any], with_outputs: bool) -> Callable[..., Any]:
        policy = self._policy

        def step(carry: Any, block: Any, *args: Any, **kwargs: Any) -> Any:
            out = fn(block, carry, *args, **kwargs)
            return out if with_outputs else (out, None)

        block_step = policy.checkpoint(step)

        def run(init: Any, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
            if not policy.nested or policy.disable:
                return _hax_scan(block_step, self.Block)(init, self.stacked, *args, **kwargs)
            groups = _nested_groups(self.Block.size, policy.nested)
            Outer = Axis(f"{self.Block.name}__group", groups)
            Inner = Axis(self.Block.name, self.Block.size // groups)
            inner_scan = _hax_scan(block_step, Inner)

            @functools.partial(eqx.filter_checkpoint, prevent_cse=policy.prevent_cse)
            def group_step(carry: Any, group: Any, *group_args: Any, **group_kwargs: Any) -> Any:
                return inner_scan(carry, group, *group_args, **group_kwargs)

            split = _split_layers((self.stacked, args, kwargs), self.Block, Outer, Inner)
            carry, ys = _hax_scan(group_step, Outer)(init, split[0], *split[1], **split[2])
            return carry, _merge_layers(ys, self.Block, Outer)

        return run

    def vmap_via(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """Apply ``fn(block, *args, **kwargs)`` to every block in parallel (``vmap`` over the layers axis).

        Args:
            fn: the per-block function.

        Returns:
            A function ``(*args, **kwargs) -> outputs with the layers axis first``.
        """
        Block = self.Block

        def run(*args: Any, **kwargs: Any) -> Any:
            return _hax_vmap(fn, Block)(self.stacked, *args, **kwargs)

        return run

    def unstacked(self) -> Sequence[M]:
        """The blocks as separate modules (layer ``i`` is the ``i``-th slice of every array).

        Returns:
            A tuple of ``Block.size`` modules.
        """
        return tuple(_take_layer(self.stacked, self.Block, i) for i in range(self.Block.size))

    def get_layer(self, index: int) -> M:
        """Block ``index`` as a separate module.

        Args:
            index: the layer index.

        Returns:
            The module.

        Raises:
            IndexError: if ``index`` is out of range.
        """
        if not -self.Block.size <= index < self.Block.size:
            raise IndexError(f"layer {index} out of range for axis {self.Block}")
        return _take_layer(self.stacked, self.Block, index % self.Block.size)

    @classmethod
    def from_layers(
        cls, Block: Axis, layers: Sequence[M], gradient_checkpointing: ScanCheckpointSpec = False
    ) -> Stacked[M]:
        """Stack separately built blocks of identical structure into one :class:`Stacked`.

        Args:
            Block: the layers axis (its size must be ``len(layers)``).
            layers: the blocks.
            gradient_checkpointing: the policy or shortcut.

        Returns:
            The stack.

        Raises:
            ValueError: if the number of layers differs from ``Block.size``.
        """
        return cls(_stack_layers(Block, layers), Block, gradient_checkpointing)

    def to_state_dict(self, prefix: str | None = None) -> StateDict:
        """Numbered per-layer keys: ``{prefix}.{i}.{key}`` holds layer ``i`` of ``{prefix}.{key}``."""
        return unstack_state_dict(to_state_dict(self.stacked, prefix), prefix, self.Block.size)

    def from_state_dict(self, state_dict: Mapping[str, Any], prefix: str | None = None) -> Stacked[M]:
        """Read numbered per-layer keys (``{prefix}.{i}.…``) back into the stacked block."""
        stacked = stack_state_dict(state_dict, prefix, self.Block.size)
        return dataclasses.replace(self, stacked=from_state_dict(self.stacked, stacked, prefix))


def _call_block(block: Any, carry: Any, *args: Any, **kwargs: Any) -> Any:
    return block(carry, *args, **kwargs)


def _with_prevent_cse(spec: ScanCheckpointSpec, prevent_cse: bool) -> ScanCheckpointSpec:
    if not prevent_cse:
        return spec
    return dataclasses.replace(ScanCheckpointPolicy.from_bool_or_str(spec), prevent_cse=True)


class BlockSeq(_LayerSequence[M]):
    """A sequence of blocks applied one after the other in Python (unrolled), with :class:`Stacked`'s interface.

    Compiles every block separately (slower to compile than :class:`Stacked`, identical results);
    blocks may differ in static configuration. State dict keys are numbered like :class:`Stacked`'s.

    Attributes:
        blocks: the blocks.
        Block: the layers axis (its size is the number of blocks).
        gradient_checkpointing: the checkpointing policy or shortcut, applied to each block (``nested``
            is treated as plain per-block checkpointing, and ``prevent_cse`` is always on).
    """

    blocks: Sequence[M]
    Block: Axis = eqx.field(static=True)
    gradient_checkpointing: ScanCheckpointSpec = eqx.field(static=True, default=False)

    @classmethod
    def init(
        cls,
        Block: Axis,
        module: type[M] | Callable[..., M],
        *,
        gradient_checkpointing: ScanCheckpointSpec = False,
        prevent_cse: bool = False,
    ) -> Callable[..., BlockSeq[M]]:
        """Return a constructor that builds ``Block.size`` blocks, splitting arguments as :meth:`Stacked.init` does.

        Args:
            Block: the layers axis.
            module: the block class (its ``init`` is used if it has one) or a factory function.
            gradient_checkpointing: the policy or shortcut.
            prevent_cse: sets ``prevent_cse`` on a policy given as a shortcut.

        Returns:
            A function ``(*args, **kwargs) -> BlockSeq``.
        """
        policy = _with_prevent_cse(gradient_checkpointing, prevent_cse)
        factory = _module_init(module)

        @functools.wraps(factory)
        def build(*args: Any, **kwargs: Any) -> BlockSeq[M]:
            blocks = []
            for i in range(Block.size):
                layer_args, layer_kwargs = _take_layer((args, kwargs), Block, i)
                blocks.append(factory(*layer_args, **layer_kwargs))
            return cls(tuple(blocks), Block, policy)

        return build

    def _run(self, fn: Callable[..., Any], with_outputs: bool) -> Callable[..., tuple[Any, Any]]:
        policy = self._policy

        def step(carry: Any, block: Any, *args: Any, **kwargs: Any) -> Any:
            out = fn(block, carry, *args, **kwargs)
            return out if with_outputs else (out, None)

        block_step = policy.checkpoint(step)

        def run(init: Any, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
            carry = init
            outputs = []
            for i, block in enumerate(self.blocks):
                layer_args, layer_kwargs = _take_layer((args, kwargs), self.Block, i)
                carry, y = block_step(carry, block, *layer_args, **layer_kwargs)
                outputs.append(y)
            return carry, _stack_layers(self.Block, outputs)

        return run

    @property
    def _policy(self) -> ScanCheckpointPolicy:
        # unrolled blocks are not inside a scan, so XLA could merge recomputation back into the forward pass
        policy = ScanCheckpointPolicy.from_bool_or_str(self.gradient_checkpointing)
        return dataclasses.replace(policy, nested=False, prevent_cse=True)

    def vmap_via(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """Apply ``fn(block, *args, **kwargs)`` to every block; outputs stacked along the layers axis.

        Args:
            fn: the per-block function.

        Returns:
            A function ``(*args, **kwargs) -> outputs with the layers axis first``.
        """

        def run(*args: Any, **kwargs: Any) -> Any:
            outputs = []
            for i, block in enumerate(self.blocks):
                layer_args, layer_kwargs = _take_layer((args, kwargs), self.Block, i)
                outputs.append(fn(block, *layer_args, **layer_kwargs))
            return _stack_layers(self.Block, outputs)

        return run

    def unstacked(self) -> Sequence[M]:
        """The blocks.

        Returns:
            A tuple of the blocks.
        """
        return tuple(self.blocks)

    def get_layer(self, index: int) -> M:
        """Block ``index``.

        Args:
            index: the layer index.

        Returns:
            The module.
        """
        return self.blocks[index]

    def to_state_dict(self, prefix: str | None = None) -> StateDict:
        """Numbered per-layer keys: ``{prefix}.{i}.…`` for block ``i``."""
        out: StateDict = {}
        for i, block in enumerate(self.blocks):
            out.update(to_state_dict(block, with_prefix(prefix, str(i))))
        return out

    def from_state_dict(self, state_dict: Mapping[str, Any], prefix: str | None = None) -> BlockSeq[M]:
        """Read numbered per-layer keys (``{prefix}.{i}.…``) into the blocks."""
        blocks = tuple(from_state_dict(b, state_dict, with_prefix(prefix, str(i))) for i, b in enumerate(self.blocks))
        return dataclasses.replace(self, blocks=blocks)
