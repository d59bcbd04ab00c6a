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
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Generic, Protocol, TypeVar, runtime_checkable

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

# Blocks run through the package's ``scan``/``fold``/``vmap`` (looked up at call time, so they can be patched);
# the name is Haliax's, whose tests patch ``haliax.nn.scan.haliax.scan``.
import ponente.namedtensor as haliax

from ..axis import Axis
from ..core import NamedArray
from ..jax_utils import tree_checkpoint_name
from ..scan_checkpoint import ScanCheckpointPolicy, ScanCheckpointSpec
from ..state_dict import (
    ModuleWithStateDictSerialization,
    StateDict,
    from_state_dict,
    stack_state_dict,
    to_state_dict,
    unstack_state_dict,
    with_prefix,
)
from ..tree_util import LayerStack

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
Unroll = int | bool | None

# tags of a BlockSeq block's carry and extra arguments, for its checkpoint policy
_CARRY = "block_seq:carry"
_INPUTS = "block_seq:inputs"

# Haliax's private names for the state-dict helpers (its tests import them from here)
_stack_state_dict = stack_state_dict
_unstack_state_dict = unstack_state_dict


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


# ---------------------------------------------------------------------------------------------------


def _module_init(module: Any) -> Callable[..., Any]:
    return getattr(module, "init", module)


def _resolve_unroll(unroll: Unroll) -> int | bool:
    if unroll is None:
        return 1
    if isinstance(unroll, bool):
        return unroll
    if int(unroll) < 1:
        raise ValueError(f"unroll must be a bool or a positive int, got {unroll!r}")
    return int(unroll)


@runtime_checkable
class BlockFoldable(Protocol[M_co]):
    """What :class:`Stacked` and :class:`BlockSeq` have in common (use it in type annotations)."""

    Block: Axis

    def fold(self, init: Any, *args: Any, unroll: Unroll = None, **kwargs: Any) -> Any:
        """Apply the blocks in order, feeding each one's output to the next."""
        ...

    def scan(self, init: Any, *args: Any, unroll: Unroll = None, **kwargs: Any) -> tuple[Any, Any]:
        """Apply blocks that return ``(carry, output)``; outputs are stacked along the layers axis."""
        ...

    def fold_via(self, fn: Callable[..., Any], *, unroll: Unroll = None) -> Callable[..., Any]:
        """Fold with ``fn(block, carry, *args, **kwargs) -> carry`` instead of calling the block."""
        ...

    def scan_via(self, fn: Callable[..., Any], *, unroll: Unroll = None) -> Callable[..., tuple[Any, Any]]:
        """Scan with ``fn(block, carry, *args, **kwargs) -> (carry, output)``."""
        ...

    def vmap(self, init: Any, *args: Any, **kwargs: Any) -> Any:
        """Apply every block to the same input; outputs are stacked along the layers axis."""
        ...

    def vmap_via(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """Apply ``fn(block, *args, **kwargs)`` to every block; outputs are stacked along the layers axis."""
        ...

    def unstacked(self) -> Sequence[M_co]:
        """The blocks as a sequence of modules."""
        ...

    def get_layer(self, index: int) -> M_co:
        """Block ``index`` as a separate module."""
        ...


class _LayerSequence(ModuleWithStateDictSerialization, Generic[M]):
    """What `Stacked` and `BlockSeq` share: fold/scan/vmap are `fold_via`/`scan_via`/`vmap_via` of the block call."""

    def fold_via(self, fn: Callable[..., Any], *, unroll: Unroll = None) -> Callable[..., Any]:
        raise NotImplementedError

    def scan_via(self, fn: Callable[..., Any], *, unroll: Unroll = None) -> Callable[..., tuple[Any, Any]]:
        raise NotImplementedError

    def vmap_via(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        raise NotImplementedError

    def fold(self, init: Any, *args: Any, unroll: Unroll = None, **kwargs: Any) -> Any:
        """Apply the blocks in order: ``x = block_i(x, *args_i, **kwargs_i)`` for each layer ``i``.

        Arguments with the layers axis are split per layer; the rest go to every block.

        Args:
            init: the input of the first block.
            *args: extra positional arguments for each block.
            unroll: layers unrolled per loop iteration (True: all; ignored by :class:`BlockSeq`).
            **kwargs: extra keyword arguments for each block.

        Returns:
            The output of the last block.
        """
        return self.fold_via(_call_block, unroll=unroll)(init, *args, **kwargs)

    def scan(self, init: Any, *args: Any, unroll: Unroll = None, **kwargs: Any) -> tuple[Any, Any]:
        """Apply blocks that return ``(carry, output)``; outputs are stacked along the layers axis.

        Args:
            init: the input carry of the first block.
            *args: extra positional arguments for each block.
            unroll: layers unrolled per loop iteration (True: all; ignored by :class:`BlockSeq`).
            **kwargs: extra keyword arguments for each block.

        Returns:
            ``(last carry, outputs with the layers axis first)``.

        Raises:
            ValueError: if a block does not return a pair.
        """
        return self.scan_via(_call_block, unroll=unroll)(init, *args, **kwargs)

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
            stacked = haliax.vmap(factory, Block)(*args, **kwargs)
            return cls(stacked, Block, policy)

        return build

    def _remat(self, unroll: int | bool) -> ScanCheckpointSpec:
        """The checkpointing policy of a loop unrolled ``unroll`` steps per iteration.

        Unrolled over every layer, the loop is straight-line code, and XLA would merge the backward pass's
        recomputation with the forward pass it repeats (common subexpressions), keeping every internal and so
        undoing the checkpointing: there, the policy prevents that, as :class:`BlockSeq`'s does.
        """
        whole = unroll is True or (not isinstance(unroll, bool) and unroll >= self.Block.size)
        if not whole or self.gradient_checkpointing in (False, None, "none"):
            return self.gradient_checkpointing
        return _with_prevent_cse(self.gradient_checkpointing, True)

    def fold_via(self, fn: Callable[..., Any], *, unroll: Unroll = None) -> Callable[..., Any]:
        """Fold with ``fn(block, carry, *args, **kwargs) -> carry`` instead of calling the block.

        Same argument rules as :func:`ponente.namedtensor.fold` over the layers axis (one compiled block).

        Args:
            fn: e.g. an unbound method such as ``Block.decode``.
            unroll: layers unrolled per loop iteration (True: all).

        Returns:
            A function ``(init, *args, **kwargs) -> final carry``.
        """

        def step(carry: Any, block: M, *args: Any, **kwargs: Any) -> Any:
            return fn(block, carry, *args, **kwargs)

        def run(init: Any, *args: Any, **kwargs: Any) -> Any:
            steps = _resolve_unroll(unroll)
            fold = haliax.fold(step, self.Block, remat=self._remat(steps), unroll=steps)
            return fold(init, self.stacked, *args, **kwargs)

        return run

    def scan_via(self, fn: Callable[..., Any], *, unroll: Unroll = None) -> Callable[..., tuple[Any, Any]]:
        """Scan with ``fn(block, carry, *args, **kwargs) -> (carry, output)``.

        Same argument rules as :func:`ponente.namedtensor.scan` over the layers axis (one compiled block).

        Args:
            fn: the per-block function.
            unroll: layers unrolled per loop iteration (True: all).

        Returns:
            A function ``(init, *args, **kwargs) -> (final carry, outputs with the layers axis first)``.
        """

        def step(carry: Any, block: M, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
            return fn(block, carry, *args, **kwargs)

        def run(init: Any, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
            steps = _resolve_unroll(unroll)
            scan = haliax.scan(step, self.Block, remat=self._remat(steps), unroll=steps)
            return scan(init, self.stacked, *args, **kwargs)

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
            return haliax.vmap(fn, Block)(self.stacked, *args, **kwargs)

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


LayerStack.register(Stacked)  # scan_aware_tree_map maps a Stacked per layer


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

    def _unrolled(self, fn: Callable[..., Any], with_outputs: bool) -> Callable[..., tuple[Any, Any]]:
        # unrolled blocks are not inside a scan, so XLA could merge recomputation back into the forward pass
        policy = dataclasses.replace(
            ScanCheckpointPolicy.from_bool_or_str(self.gradient_checkpointing), nested=False, prevent_cse=True
        )

        def step(carry: Any, block: Any, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
            carry = tree_checkpoint_name(carry, _CARRY)
            args, kwargs = tree_checkpoint_name((args, kwargs), _INPUTS)
            out = fn(block, carry, *args, **kwargs)
            if not with_outputs:
                return out, None
            if not isinstance(out, (tuple, list)) or len(out) != 2:
                raise ValueError(
                    f"BlockSeq.scan: each block must return a pair (carry, output), got {type(out).__name__} "
                    "(use fold for blocks that return only the carry)"
                )
            return out[0], out[1]

        block_step = policy.checkpoint(step, _CARRY, _INPUTS)

        def run(init: Any, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
            carry = init
            outputs = []
            for i, block in enumerate(self.blocks):
                layer_args, layer_kwargs = _take_layer((args, kwargs), self.Block, i)
                carry, y = block_step(carry, block, *layer_args, **layer_kwargs)
                outputs.append(y)
            return carry, _stack_layers(self.Block, outputs)

        return run

    def fold_via(self, fn: Callable[..., Any], *, unroll: Unroll = None) -> Callable[..., Any]:
        """Fold with ``fn(block, carry, *args, **kwargs) -> carry``, one block after the other.

        Args:
            fn: the per-block function.
            unroll: accepted for :class:`Stacked`'s interface (a BlockSeq is always unrolled).

        Returns:
            A function ``(init, *args, **kwargs) -> final carry``.
        """
        run = self._unrolled(fn, with_outputs=False)
        return lambda init, *args, **kwargs: run(init, *args, **kwargs)[0]

    def scan_via(self, fn: Callable[..., Any], *, unroll: Unroll = None) -> Callable[..., tuple[Any, Any]]:
        """Scan with ``fn(block, carry, *args, **kwargs) -> (carry, output)``, one block after the other.

        Args:
            fn: the per-block function.
            unroll: accepted for :class:`Stacked`'s interface (a BlockSeq is always unrolled).

        Returns:
            A function ``(init, *args, **kwargs) -> (final carry, outputs with the layers axis first)``.
        """
        return self._unrolled(fn, with_outputs=True)

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
