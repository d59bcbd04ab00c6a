"""LoRA: low-rank adapters on the linear layers of any model of the zoo, PEFT-compatible.

:func:`loraize` replaces the selected :class:`~ponente.namedtensor.nn.Linear` layers of a model by
:class:`LoraLinear` layers, which compute ``base(x) + scale * (dropout(x) · A) · B`` with the base layer
frozen, ``A`` over ``(In, lora_r)`` and ``B`` over ``(lora_r, Out)``, ``scale = alpha / r``. ``B`` starts at
zero, so a freshly adapted model computes exactly what the base model does. Stacked (scanned) layers get one
adapter per layer: the adapter arrays carry the layers axis like the base weights.

Layers are chosen by :attr:`LoraConfig.target_modules`, matched (as PEFT does) against Hugging Face module
paths such as ``model.layers.0.self_attn.q_proj``, and also against Ponente attribute paths such as
``transformer.layers.stacked.self_attn.q_proj``. Train only the adapters by passing
:func:`lora_trainable_filter` as ``is_trainable`` to the trainer; fold them into the weights with
:func:`merge_lora`; exchange them with PEFT through :func:`ponente.models.hf.save_peft_pretrained` and
:func:`ponente.models.hf.load_peft_pretrained`.

Example:
    >>> import jax, ponente.namedtensor as hax
    >>> from ponente.models import LlamaConfig
    >>> cfg = LlamaConfig(seq_len=8, hidden_dim=16, intermediate_dim=32, num_layers=2, num_heads=4, num_kv_heads=2)
    >>> model = cfg.build(hax.Axis("vocab", 11), key=jax.random.key(0))
    >>> lora = loraize(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]), key=jax.random.key(1))
    >>> lora.transformer.layers.stacked.self_attn.q_proj.lora_a.axes
    (Axis(name='layers', size=2), Axis(name='embed', size=16), Axis(name='lora_r', size=4))
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import equinox as eqx
import jax
import numpy as np

import ponente.namedtensor as hax
from ponente.namedtensor import Axis, NamedArray
from ponente.namedtensor.nn import Linear
from ponente.namedtensor.state_dict import ModuleWithStateDictSerialization, StateDict, to_state_dict

__all__ = [
    "LORA_R",
    "LoraConfig",
    "LoraLinear",
    "LoraSite",
    "adapters_only",
    "has_lora",
    "lora_sites",
    "lora_trainable_filter",
    "loraize",
    "merge_lora",
    "unwrap",
    "with_dropout_keys",
]

LORA_R = "lora_r"
"""The name of the adapters' rank axis."""

# the names of the merged input and output axes in PyTorch exports (those of ``Linear.flatten_for_export``)
_FLAT_IN = "__IN__"
_FLAT_OUT = "__OUT__"

T = TypeVar("T")
_DROPOUT_SALT = 104  # any constant; keeps the adapters' dropout keys apart from the caller's


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """Which linear layers get adapters, and their shape (Levanter's ``lora:`` keys).

    Attributes:
        r: the rank of the adapters.
        alpha: the adapters' output is scaled by ``alpha / r`` (PEFT's ``lora_alpha``).
        dropout: dropout probability on the adapters' input (applied only when a PRNG key reaches the layer, see
            :func:`with_dropout_keys`).
        target_modules: the layers to adapt. None: every linear layer of attention and MLP (not a mixture-of-experts
            router; the output projection ``lm_head`` can never be adapted). Mixtral's experts are not linear layers
            and cannot be adapted. A string: a regular expression that must match a whole
            module path (Hugging Face's, e.g. ``model.layers.0.self_attn.q_proj``, or Ponente's, e.g.
            ``transformer.layers.stacked.self_attn.q_proj``). A list of names: a module matches a name equal to its
            path or to the end of its path after a dot (``q_proj``, ``mlp.down_proj``), as in PEFT.

    Raises:
        ValueError: for a rank below 1 (``lora.r``), a dropout outside ``[0, 1)`` (``lora.dropout``), or
            ``target_modules`` that is an empty list or holds a non-string (``lora.target_modules``).

    Example:
        >>> LoraConfig(r=16, alpha=32.0, target_modules=["q_proj", "v_proj"]).scale
        2.0
    """

    r: int = 8
    alpha: float = 8.0
    dropout: float = 0.0
    target_modules: list[str] | str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.r, bool) or not isinstance(self.r, int) or self.r < 1:
            raise ValueError(f"lora.r must be a positive integer, got {self.r!r}")
        if not 0.0 <= float(self.dropout) < 1.0:
            raise ValueError(f"lora.dropout must be in [0, 1), got {self.dropout!r}")
        targets = self.target_modules
        if isinstance(targets, (list, tuple)):
            if not targets or not all(isinstance(t, str) and t for t in targets):
                raise ValueError(
                    f"lora.target_modules must be None, a regular expression or a non-empty list of module names, "
                    f"got {targets!r}"
                )
        elif targets is not None and not isinstance(targets, str):
            raise ValueError(f"lora.target_modules must be None, a string or a list of strings, got {targets!r}")

    @property
    def scale(self) -> float:
        """The factor ``alpha / r`` applied to the adapters' output."""
        return float(self.alpha) / self.r


def _axes(spec: Any) -> tuple[Axis, ...]:
    if isinstance(spec, Axis):
        return (spec,)
    if isinstance(spec, Mapping):
        return tuple(Axis(k, v) for k, v in spec.items())
    return tuple(spec)


def _extra_axes(array: NamedArray, *specs: Any) -> tuple[Axis, ...]:
    """The axes of ``array`` that are in none of ``specs`` (the layers axis of a stacked layer), in order."""
    names = {ax.name for spec in specs for ax in _axes(spec)}
    return tuple(ax for ax in array.axes if ax.name not in names)


class LoraLinear(ModuleWithStateDictSerialization):
    """A frozen :class:`~ponente.namedtensor.nn.Linear` plus a low-rank update: ``base(x) + scale * (x · A) · B``.

    Called like the layer it wraps (``layer(x)``), and exposes its ``weight``, ``bias``, ``In`` and ``Out``, so
    model code does not change. Its state-dict keys are the base layer's (``weight``, ``bias``) plus PEFT's
    ``lora_A.weight`` (PyTorch layout ``[r, in]``) and ``lora_B.weight`` (``[out, r]``).

    Attributes:
        base: the wrapped layer (frozen by :func:`lora_trainable_filter`).
        lora_a: ``A``, axes ``(In, lora_r)`` (after the layers axis for stacked layers).
        lora_b: ``B``, axes ``(lora_r, Out)`` (after the layers axis for stacked layers).
        scale: ``alpha / r`` (static).
        dropout: dropout probability on the adapter's input (static).
        dropout_key: a PRNG key (one per layer for stacked layers) set by :func:`with_dropout_keys`; None outside a
            training step.

    Example:
        >>> import jax, ponente.namedtensor as hax
        >>> lin = Linear.init(hax.Axis("embed", 8), hax.Axis("mlp", 16), key=jax.random.key(0))
        >>> lora = LoraLinear.init(lin, r=2, alpha=4.0, key=jax.random.key(1))
        >>> x = hax.ones({"position": 3, "embed": 8})
        >>> bool((lora(x) == lin(x)).all())  # B starts at zero
        True
    """

    base: Linear
    lora_a: NamedArray
    lora_b: NamedArray
    scale: float = eqx.field(static=True)
    dropout: float = eqx.field(static=True, default=0.0)
    dropout_key: jax.Array | None = None

    def _state_dict_key_map(self) -> dict[str, str | None]:
        return {"base": None, "lora_a": "lora_A.weight", "lora_b": "lora_B.weight"}

    @staticmethod
    def init(base: Linear, r: int, *, alpha: float, dropout: float = 0.0, key: jax.Array) -> LoraLinear:
        """Wrap ``base`` with a rank-``r`` adapter initialized as PEFT does.

        ``A`` is drawn from ``U(-1/sqrt(fan_in), 1/sqrt(fan_in))`` (PyTorch's Kaiming-uniform initialization
        with ``a = sqrt(5)``), ``B`` is zero. A ``base`` whose weight has axes besides ``In`` and ``Out`` (the
        layers axis of a stacked layer) gets an independent adapter per entry of those axes.

        Args:
            base: the layer to adapt.
            r: the rank.
            alpha: the scale numerator (the update is multiplied by ``alpha / r``).
            dropout: dropout probability on the adapter's input.
            key: the PRNG key for ``A``.

        Returns:
            The layer.

        Raises:
            ValueError: if ``r`` is below 1 or larger than the layer's input or output size (``lora.r``).
        """
        ins, outs = _axes(base.In), _axes(base.Out)
        fan_in, fan_out = math.prod(ax.size for ax in ins), math.prod(ax.size for ax in outs)
        if not 1 <= r <= min(fan_in, fan_out):
            raise ValueError(
                f"lora.r: rank {r} must be between 1 and the layer's smaller dimension (in {fan_in}, out {fan_out})"
            )
        extra = _extra_axes(base.weight, ins, outs)
        R = Axis(LORA_R, r)
        dtype = base.weight.dtype
        bound = 1.0 / math.sqrt(fan_in)
        lora_a = hax.random.uniform(key, (*extra, *ins, R), minval=-bound, maxval=bound).astype(dtype)
        lora_b = hax.zeros((*extra, R, *outs), dtype=dtype)
        return LoraLinear(base, lora_a, lora_b, scale=float(alpha) / r, dropout=float(dropout))

    @property
    def weight(self) -> NamedArray:
        """The base layer's weight."""
        return self.base.weight

    @property
    def bias(self) -> NamedArray | None:
        """The base layer's bias."""
        return self.base.bias

    @property
    def In(self) -> Any:
        """The input axes."""
        return self.base.In

    @property
    def Out(self) -> Any:
        """The output axes."""
        return self.base.Out

    @property
    def r(self) -> int:
        """The adapter's rank."""
        return self.lora_a.axis_size(LORA_R)

    def __call__(self, inputs: NamedArray, *, key: jax.Array | None = None) -> NamedArray:
        """Applies the layer: ``base(x) + scale * (dropout(x) · A) · B``.

        Args:
            inputs: a NamedArray with the ``In`` axes (and any others, which pass through).
            key: PRNG key for the adapter's dropout (None: ``dropout_key``, and no dropout if that is None too).

        Returns:
            The output: the input's other axes followed by ``Out``.
        """
        out = self.base(inputs)
        key = self.dropout_key if key is None else key
        x = inputs
        if self.dropout > 0.0 and key is not None:
            x = hax.nn.dropout(x, self.dropout, inference=False, key=key)
        in_names = tuple(ax.name for ax in _axes(self.In))
        low = hax.dot(x, self.lora_a.astype(x.dtype), axis=in_names)
        delta = hax.dot(low, self.lora_b.astype(x.dtype), axis=LORA_R)
        return out + (delta * self.scale).astype(out.dtype)

    def merged(self) -> Linear:
        """The base layer with the update folded in: ``W + scale * A B`` (in the base weight's layout and dtype)."""
        delta = hax.dot(self.lora_a, self.lora_b, axis=LORA_R) * self.scale
        # the base weight is multiplied by its parameterization's ``active_scale`` in the forward pass
        active = self.base.reparam.active_scale
        if active != 1:
            delta = delta / active
        weight = self.base.weight
        new = weight + delta.rearrange(weight.axes).astype(weight.dtype)
        return dataclasses.replace(self.base, weight=new)

    def flatten_for_export(self) -> LoraLinear:
        """The adapter in PyTorch's layout: ``lora_a`` as ``(lora_r, __IN__)``, ``lora_b`` as ``(__OUT__, lora_r)``.

        The base layer is flattened separately (see
        :func:`~ponente.namedtensor.state_dict.flatten_modules_for_export`).

        Returns:
            The flattened layer (only for export).
        """
        ins, outs = _axes(self.In), _axes(self.Out)
        lora_a, lora_b = self.lora_a, self.lora_b
        if lora_a is not None:
            flat_in = Axis(_FLAT_IN, math.prod(ax.size for ax in ins))
            lora_a = lora_a.rearrange((..., LORA_R, *ins)).flatten_axes(ins, flat_in)
        if lora_b is not None:
            flat_out = Axis(_FLAT_OUT, math.prod(ax.size for ax in outs))
            lora_b = lora_b.rearrange((..., *outs, LORA_R)).flatten_axes(outs, flat_out)
        return dataclasses.replace(self, lora_a=lora_a, lora_b=lora_b)

    def unflatten_from_export(self, template: LoraLinear) -> LoraLinear:
        """Inverse of :meth:`flatten_for_export`: this adapter with ``template``'s axes.

        Args:
            template: a layer with the original axes (its values are ignored).

        Returns:
            The layer in ``template``'s layout.
        """
        ins, outs = _axes(template.In), _axes(template.Out)
        lora_a, lora_b = self.lora_a, self.lora_b
        if lora_a is not None and lora_a.has_axis(_FLAT_IN):
            lora_a = lora_a.unflatten_axis(_FLAT_IN, ins)
            if template.lora_a is not None:
                lora_a = lora_a.rearrange(template.lora_a.axes)
        if lora_b is not None and lora_b.has_axis(_FLAT_OUT):
            lora_b = lora_b.unflatten_axis(_FLAT_OUT, outs)
            if template.lora_b is not None:
                lora_b = lora_b.rearrange(template.lora_b.axes)
        return dataclasses.replace(self, lora_a=lora_a, lora_b=lora_b)


# ---------------------------------------------------------------------------------------------------
# finding the linear layers of a model, with their Ponente and Hugging Face paths


@dataclasses.dataclass(frozen=True)
class LoraSite:
    """A linear layer of a model that can carry an adapter (or does), with its names.

    Attributes:
        index: its position among the model's linear layers (in pytree order).
        path: the Ponente attribute path (``transformer.layers.stacked.self_attn.q_proj``).
        hf_paths: the Hugging Face module paths, one per layer of a stack (``model.layers.0.self_attn.q_proj``, ...).
        in_size: the layer's input size (its ``In`` axes flattened).
        out_size: the layer's output size (its ``Out`` axes flattened).
    """

    index: int
    path: str
    hf_paths: tuple[str, ...]
    in_size: int
    out_size: int

    @property
    def is_router(self) -> bool:
        """Whether this is a mixture-of-experts router (``MoeMlp.router``), which default targets leave out."""
        return self.path.rsplit(".", 1)[-1] == "router"

    @property
    def is_output(self) -> bool:
        """Whether this is the output projection (``lm_head``), which default targets leave out."""
        return self.path == "lm_head"

    @property
    def short_names(self) -> tuple[str, ...]:
        """The last component of each Hugging Face path (``q_proj``), without repeats."""
        return tuple(dict.fromkeys(p.rsplit(".", 1)[-1] for p in self.hf_paths))


def _is_linear(x: Any) -> bool:
    return isinstance(x, (Linear, LoraLinear))


def _is_named(x: Any) -> bool:
    return isinstance(x, NamedArray)


def _is_lora(x: Any) -> bool:
    return isinstance(x, LoraLinear)


def _key_str(entry: Any) -> str:
    for attr in ("name", "key", "idx"):
        if hasattr(entry, attr):
            return str(getattr(entry, attr))
    return str(entry)


class _PathProbe(ModuleWithStateDictSerialization):
    """Stands in for a linear layer to learn its state-dict key (its Hugging Face module path) per layer."""

    index: int = eqx.field(static=True)
    shape: tuple[int, ...] = eqx.field(static=True)

    def to_state_dict(self, prefix: str | None = None) -> StateDict:
        if prefix is None:
            raise ValueError("lora: a linear layer at the root of a model has no module path")
        return {prefix: np.full(self.shape, self.index, dtype=np.int64)}


def lora_sites(model: Any, *, adapted: bool = False) -> list[LoraSite]:
    """The linear layers of ``model`` (or only those with adapters), with their Ponente and Hugging Face paths.

    Args:
        model: any model of the zoo (an :class:`~ponente.models.LmHeadModel`), adapted or not.
        adapted: list only the :class:`LoraLinear` layers.

    Returns:
        The layers in pytree order.

    Example:
        >>> import jax, ponente.namedtensor as hax
        >>> from ponente.models import LlamaConfig
        >>> cfg = LlamaConfig(seq_len=8, hidden_dim=16, intermediate_dim=32, num_layers=2, num_heads=4, num_kv_heads=2)
        >>> site = lora_sites(cfg.build(hax.Axis("vocab", 11), key=jax.random.key(0)))[0]
        >>> site.path
        'transformer.layers.stacked.self_attn.q_proj'
        >>> site.hf_paths
        ('model.layers.0.self_attn.q_proj', 'model.layers.1.self_attn.q_proj')
    """
    # NamedArrays are leaves here so that everything but the probes becomes None (no key, nothing copied)
    flat, treedef = jax.tree_util.tree_flatten_with_path(model, is_leaf=lambda x: _is_linear(x) or _is_named(x))
    probes: list[Any] = []
    found: list[tuple[str, Linear | LoraLinear]] = []
    for path, leaf in flat:
        if _is_linear(leaf) and (not adapted or _is_lora(leaf)):
            weight = leaf.weight
            extra = _extra_axes(weight, leaf.In, leaf.Out)
            probes.append(_PathProbe(len(found), tuple(ax.size for ax in extra)))
            found.append((".".join(_key_str(k) for k in path), leaf))
        else:
            probes.append(None)
    keys = to_state_dict(jax.tree_util.tree_unflatten(treedef, probes))
    hf_paths: dict[int, list[str]] = {}
    for name, value in keys.items():
        hf_paths.setdefault(int(np.asarray(value)), []).append(name)
    sites = []
    for i, (attr_path, leaf) in enumerate(found):
        ins, outs = _axes(leaf.In), _axes(leaf.Out)
        sites.append(
            LoraSite(
                index=i,
                path=attr_path,
                hf_paths=tuple(sorted(hf_paths.get(i, []), key=_natural_key)),
                in_size=math.prod(ax.size for ax in ins),
                out_size=math.prod(ax.size for ax in outs),
            )
        )
    return sites


def _natural_key(path: str) -> tuple[Any, ...]:
    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in path.split("."))


def _available(sites: Sequence[LoraSite]) -> str:
    sites = [s for s in sites if not s.is_output]
    names = sorted({n for s in sites for n in s.short_names})
    example = sites[0].hf_paths[0] if sites and sites[0].hf_paths else None
    paths = f" (Hugging Face paths like {example!r}, Ponente paths like {sites[0].path!r})" if example else ""
    return f"available module names: {names}{paths}"


def _matches(pattern: str, path: str, *, regex: bool) -> bool:
    if regex:
        return re.fullmatch(pattern, path) is not None
    return path == pattern or path.endswith("." + pattern)


def _select(sites: Sequence[LoraSite], targets: list[str] | str | None) -> list[LoraSite]:
    """The sites ``targets`` selects (see :attr:`LoraConfig.target_modules`)."""
    if targets is None:
        chosen = [s for s in sites if not s.is_router and not s.is_output]
        if not chosen:
            raise ValueError(f"lora.target_modules: the model has no linear layer to adapt; {_available(sites)}")
        return chosen
    regex = isinstance(targets, str)
    patterns = [targets] if isinstance(targets, str) else list(targets)
    chosen_ids: set[int] = set()
    for pattern in patterns:
        hit = False
        for site in sites:
            per_layer = [_matches(pattern, p, regex=regex) for p in site.hf_paths]
            if _matches(pattern, site.path, regex=regex) or (per_layer and all(per_layer)):
                chosen_ids.add(site.index)
                hit = True
            elif any(per_layer):
                some = [p for p, m in zip(site.hf_paths, per_layer, strict=True) if m]
                raise ValueError(
                    f"lora.target_modules: {pattern!r} matches {some} but not the other layers of the same stack "
                    f"({site.path}); stacked layers are adapted all together, so target every layer or none"
                )
        if not hit:
            raise ValueError(f"lora.target_modules: {pattern!r} matches no linear layer; {_available(sites)}")
    chosen = [s for s in sites if s.index in chosen_ids]
    output = [s.path for s in chosen if s.is_output]
    if output:
        # the blockwise loss multiplies by the output weight itself (``get_lm_head``): an adapter there would be
        # silently skipped
        raise ValueError(
            f"lora.target_modules: {patterns!r} selects the output projection {output[0]!r}, which cannot carry an "
            "adapter; target the attention and MLP layers"
        )
    return chosen


# ---------------------------------------------------------------------------------------------------
# transforming models


def _map_layers(model: T, pick: Callable[[Any], bool], fn: Callable[[int, Any], Any]) -> T:
    """``model`` with every layer ``pick`` selects (in pytree order, counted from 0) replaced by ``fn(i, layer)``."""
    flat, treedef = jax.tree_util.tree_flatten(model, is_leaf=pick)
    out = []
    count = 0
    for leaf in flat:
        if pick(leaf):
            out.append(fn(count, leaf))
            count += 1
        else:
            out.append(leaf)
    return jax.tree_util.tree_unflatten(treedef, out)


def has_lora(model: Any) -> bool:
    """Whether ``model`` has at least one :class:`LoraLinear` layer."""
    flat = jax.tree_util.tree_leaves(model, is_leaf=_is_lora)
    return any(_is_lora(leaf) for leaf in flat)


def loraize(model: T, config: LoraConfig, *, key: jax.Array) -> T:
    """``model`` with adapters on the linear layers ``config.target_modules`` selects.

    Works for every architecture of the zoo, with stacked (scanned) or unrolled layers; a stacked layer gets one
    adapter per layer. The result computes exactly what ``model`` computes until ``lora_b`` moves away from zero.

    Args:
        model: the model (any pytree whose linear layers are :class:`~ponente.namedtensor.nn.Linear`).
        config: the rank, scale, dropout and target modules.
        key: the PRNG key for the adapters' ``A`` matrices.

    Returns:
        The adapted model (same type; the base layers are kept inside the :class:`LoraLinear` layers).

    Raises:
        ValueError: if ``model`` already has adapters, a target pattern matches no layer (the message lists the
            available module names, ``lora.target_modules``), a pattern matches only some layers of a stack, or
            ``config.r`` exceeds a selected layer's input or output size (``lora.r``).

    Example:
        >>> import jax, ponente.namedtensor as hax
        >>> from ponente.models import Gpt2Config
        >>> model = Gpt2Config(seq_len=8, hidden_dim=16, num_layers=1, num_heads=2, num_kv_heads=2).build(
        ...     hax.Axis("vocab", 11), key=jax.random.key(0)
        ... )
        >>> adapted = loraize(model, LoraConfig(r=2), key=jax.random.key(1))
        >>> " ".join(s.path.removeprefix("transformer.h.stacked.") for s in lora_sites(adapted, adapted=True))
        'attn.c_attn attn.c_proj mlp.c_fc mlp.c_proj'
    """
    if has_lora(model):
        raise ValueError("loraize: the model already has LoRA adapters; merge_lora or unwrap it first")
    sites = lora_sites(model)
    chosen = _select(sites, config.target_modules)
    for site in chosen:
        if config.r > min(site.in_size, site.out_size):
            name = site.hf_paths[0] if site.hf_paths else site.path
            raise ValueError(
                f"lora.r: rank {config.r} is larger than {name} allows (in {site.in_size}, out {site.out_size}); "
                f"use lora.r <= {min(min(s.in_size, s.out_size) for s in chosen)} or leave that layer out of "
                "lora.target_modules"
            )
    wanted = {s.index for s in chosen}

    def wrap(i: int, layer: Linear) -> Any:
        if i not in wanted:
            return layer
        return LoraLinear.init(
            layer, config.r, alpha=config.alpha, dropout=config.dropout, key=jax.random.fold_in(key, i)
        )

    return _map_layers(model, _is_linear, wrap)


def merge_lora(model: T) -> T:
    """``model`` with every adapter folded into its base weight (``W + scale * A B``): a plain model again.

    Args:
        model: an adapted model.

    Returns:
        The model with :class:`~ponente.namedtensor.nn.Linear` layers only (same type as before :func:`loraize`).
    """
    return _map_layers(model, _is_lora, lambda _, layer: layer.merged())


def unwrap(model: T) -> T:
    """``model`` with its adapters dropped: the base model (the frozen weights, as before :func:`loraize`).

    Args:
        model: an adapted model.

    Returns:
        The base model.
    """
    return _map_layers(model, _is_lora, lambda _, layer: layer.base)


def lora_trainable_filter(model: Any) -> Any:
    """The trainable-parameter mask of an adapted model: True for the ``lora_a``/``lora_b`` leaves, False elsewhere.

    Pass it as ``is_trainable`` to the trainer (``Trainer.initial_state``) so that the base weights are frozen
    and hold no optimizer state; ``equinox.partition(model, lora_trainable_filter(model))`` splits the model.

    Args:
        model: an adapted model.

    Returns:
        A pytree with the model's structure and a bool per leaf.

    Raises:
        ValueError: if ``model`` has no adapters (nothing would train).
    """
    if not has_lora(model):
        raise ValueError("lora_trainable_filter: the model has no LoRA adapters; call ponente.models.lora.loraize")

    # a NamedArray gets one bool (not one for its array), so that ``equinox.filter(..., is_leaf=is_named)`` drops
    # frozen NamedArrays whole
    def spec(leaf: Any) -> Any:
        if not _is_lora(leaf):
            return False
        frozen = jax.tree_util.tree_map(lambda _: False, leaf, is_leaf=_is_named)
        return dataclasses.replace(frozen, lora_a=True, lora_b=True)

    return jax.tree_util.tree_map(spec, model, is_leaf=lambda x: _is_lora(x) or _is_named(x))


def adapters_only(model: T) -> T:
    """The adapters of ``model``: its ``lora_a``/``lora_b`` arrays, with None in place of everything else.

    Args:
        model: an adapted model.

    Returns:
        The model's structure holding only the adapters (what :func:`lora_trainable_filter` selects).

    Raises:
        ValueError: if ``model`` has no adapters.
    """
    return eqx.filter(model, lora_trainable_filter(model), is_leaf=_is_named)


def with_dropout_keys(model: T, key: jax.Array | None) -> T:
    """``model`` with a fresh dropout key in every adapter whose ``dropout`` is positive (one key per layer).

    The models of the zoo do not pass PRNG keys down to their linear layers, so LoRA dropout gets its keys this
    way: call it inside the loss function of a training step, with that step's key. Without a key (or without
    dropout) the model is returned unchanged.

    Args:
        model: an adapted model.
        key: the step's PRNG key (None: no dropout).

    Returns:
        The model with ``dropout_key`` set.

    Example:
        ```python
        def loss_fn(model, batch, *, key):
            return compute_next_token_loss(with_dropout_keys(model, key), lm_example(batch))
        ```
    """
    if key is None:
        return model
    # a salt, so that the adapters' keys differ from those the caller derives from the same step key
    key = jax.random.fold_in(key, _DROPOUT_SALT)

    def keyed(i: int, layer: LoraLinear) -> LoraLinear:
        if layer.dropout == 0.0:
            return layer
        extra = _extra_axes(layer.lora_a, layer.In, Axis(LORA_R, 1))
        k = jax.random.fold_in(key, i)
        if extra:
            shape = tuple(ax.size for ax in extra)
            keys = jax.random.split(k, math.prod(shape))
            k = keys.reshape(shape + keys.shape[1:])
        return dataclasses.replace(layer, dropout_key=k)

    return _map_layers(model, _is_lora, keyed)
