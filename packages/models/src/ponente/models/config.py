"""Model configurations: the :class:`LmConfig` interface and the registry of config classes keyed by ``type``."""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import ponente.namedtensor as hax
from ponente.namedtensor import Axis, NamedArray, ScanCheckpointPolicy

from .attention import ATTENTION_BACKENDS
from .attention.ring import ATTENTION_CONTEXT_PARALLEL
from .lm import LmHeadModel
from .remat import check_gradient_checkpointing

__all__ = [
    "LmConfig",
    "config_for_type",
    "lm_flops_per_token",
    "mask_padded_vocab",
    "padded_vocab_size",
    "register_config",
    "registered_types",
]

C = TypeVar("C", bound="type[LmConfig]")

_REGISTRY: dict[str, type[LmConfig]] = {}


_ALIASES: dict[str, str] = {}


def register_config(type_name: str, *, aliases: Sequence[str] = ()) -> Callable[[C], C]:
    """Class decorator registering an :class:`LmConfig` subclass under ``type_name`` (the ``type:`` key of a config).

    Args:
        type_name: the registry key, e.g. ``"gpt2"``; also the Hugging Face ``model_type``.
        aliases: other names :func:`config_for_type` resolves to the same class (e.g. a Hugging Face
            ``model_type`` that differs from ``type_name``); they are not listed by :func:`registered_types`.

    Returns:
        The decorator (it returns the class unchanged, with ``model_type`` set).

    Raises:
        ValueError: if another class is already registered under ``type_name`` or one of ``aliases``.

    Example:
        >>> from ponente.models import config_for_type
        >>> config_for_type("gpt2").__name__
        'Gpt2Config'
    """

    def register(cls: C) -> C:
        for name in (type_name, *aliases):
            existing = _REGISTRY.get(_ALIASES.get(name, name))
            if existing is not None and existing is not cls:
                raise ValueError(
                    f"register_config: type {name!r} is already registered to {existing.__qualname__}, "
                    f"cannot register {cls.__qualname__}"
                )
        cls.model_type = type_name
        _REGISTRY[type_name] = cls
        _ALIASES.update(dict.fromkeys(aliases, type_name))
        return cls

    return register


def config_for_type(type_name: str) -> type[LmConfig]:
    """The config class registered under ``type_name``.

    Args:
        type_name: the registry key (e.g. ``"llama"``) or an alias.

    Returns:
        The config class.

    Raises:
        KeyError: if nothing is registered under ``type_name`` (the message lists the known types).
    """
    try:
        return _REGISTRY[_ALIASES.get(type_name, type_name)]
    except KeyError:
        raise KeyError(
            f"no model config registered for type {type_name!r}; known types: {registered_types()}"
        ) from None


def registered_types() -> list[str]:
    """The sorted list of registered config types."""
    return sorted(_REGISTRY)


def padded_vocab_size(vocab_size: int, multiple: int) -> int:
    """``vocab_size`` rounded up to a multiple of ``multiple`` (so the vocabulary axis shards evenly).

    Args:
        vocab_size: the real vocabulary size (positive).
        multiple: the padding multiple (positive; 1 means no padding).

    Returns:
        The smallest multiple of ``multiple`` that is at least ``vocab_size``.

    Raises:
        ValueError: if either argument is not positive.

    Example:
        >>> padded_vocab_size(50257, 128), padded_vocab_size(256, 128), padded_vocab_size(97, 1)
        (50304, 256, 97)
    """
    if vocab_size <= 0 or multiple <= 0:
        raise ValueError(
            f"padded_vocab_size: vocab_size and multiple must be positive, got vocab_size={vocab_size}, "
            f"multiple={multiple}"
        )
    return -(-vocab_size // multiple) * multiple


def mask_padded_vocab(logits: NamedArray, Vocab: Axis, vocab_size: int | None) -> NamedArray:
    """``logits`` with the padded vocabulary entries (index ``>= vocab_size``) set to the dtype's most negative value.

    The value is finite, so masked entries contribute exactly nothing to a softmax or ``logsumexp``,
    never win an argmax, and multiplying them by a zero one-hot target gives 0 (not NaN).

    Args:
        logits: floating logits with the ``Vocab`` axis.
        Vocab: the (padded) vocabulary axis.
        vocab_size: the number of real entries (None, or at least ``Vocab.size``: nothing is masked).

    Returns:
        The masked logits (same axes and dtype).

    Example:
        >>> import ponente.namedtensor as hax
        >>> V = hax.Axis("vocab", 4)
        >>> out = mask_padded_vocab(hax.zeros(V), V, 3).array
        >>> out[:3].tolist(), bool(out[3] < -1e38)
        ([0.0, 0.0, 0.0], True)
    """
    if vocab_size is None or vocab_size >= Vocab.size:
        return logits
    axis = logits.axis_indices(Vocab.name)
    shape = [1] * logits.ndim
    shape[axis] = Vocab.size
    valid = (jnp.arange(Vocab.size) < vocab_size).reshape(shape)
    return NamedArray(jnp.where(valid, logits.array, jnp.finfo(logits.dtype).min), logits.axes)


def _real_vocab_rows(weight: NamedArray, Vocab: Axis, vocab_size: int | None) -> NamedArray:
    """``weight`` restricted to the first ``vocab_size`` entries of ``Vocab`` (all of them if None)."""
    if vocab_size is None or vocab_size >= Vocab.size:
        return weight
    return weight[Vocab.name, :vocab_size]


def lm_flops_per_token(
    *,
    hidden_dim: int,
    intermediate_dim: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    seq_len: int,
    vocab_size: int,
    glu: bool,
    attention_windows: Sequence[int | None] | None = None,
) -> float:
    """Forward-pass FLOPs per token of a decoder-only transformer (matrix products only, 2 FLOPs per multiply-add).

    Counts the Q/K/V/O projections, the attention scores and weighted sum over the keys a query may see, the
    MLP (3 matrices if ``glu``, else 2) and the output projection to the vocabulary. A full-attention layer
    counts all ``seq_len`` keys (no causal saving, as the reference kernel computes them), a sliding-window
    layer ``min(window, seq_len)`` keys (the same convention: the window, without the triangle at the start).
    Multiply by 3 for forward + backward.

    Args:
        hidden_dim: the model width.
        intermediate_dim: the MLP width.
        num_layers: the number of blocks.
        num_heads: query heads.
        num_kv_heads: key/value heads.
        head_size: the size of one head.
        seq_len: the sequence length.
        vocab_size: the vocabulary size.
        glu: whether the MLP is gated (gate, up, down).
        attention_windows: per layer, the sliding window (keys a query sees, itself included) or None for full
            attention (None: every layer full).

    Returns:
        FLOPs per token.

    Raises:
        ValueError: if ``attention_windows`` does not have one entry per layer.
    """
    windows = [None] * num_layers if attention_windows is None else list(attention_windows)
    if len(windows) != num_layers:
        raise ValueError(f"lm_flops_per_token: {len(windows)} attention_windows for {num_layers} layers")
    q_out = num_heads * head_size
    kv_out = num_kv_heads * head_size
    proj = 2 * hidden_dim * (q_out + 2 * kv_out) + 2 * q_out * hidden_dim
    keys = sum(seq_len if w is None else min(w, seq_len) for w in windows)
    attn = 2 * 2 * keys * q_out  # scores and the weighted sum of values, summed over layers
    mlp = 2 * hidden_dim * intermediate_dim * (3 if glu else 2)
    return float(num_layers * (proj + mlp) + attn + 2 * hidden_dim * vocab_size)


@dataclasses.dataclass(frozen=True)
class LmConfig(abc.ABC):
    """Base of the language-model configs: sizes, axes, a ``build`` method and Hugging Face conversion.

    Subclasses are frozen dataclasses registered with :func:`register_config`.

    Attributes:
        seq_len: the (maximum) sequence length.
        hidden_dim: the model width.
        intermediate_dim: the MLP width.
        num_layers: the number of blocks.
        num_heads: query heads.
        num_kv_heads: key/value heads (``num_heads`` for multi-head attention, 1 for MQA).
        head_dim: the size of one head (None: ``hidden_dim // num_heads``).
        gradient_checkpointing: what each layer keeps for the backward pass (the rest is recomputed): False (no
            checkpointing: everything), True or ``"full"`` (only the layer's input: one more forward pass of compute),
            another shortcut of ``hax.ScanCheckpointPolicy.from_bool_or_str`` (``"offload"``, ``"nested"``, ...), a
            list of the block internals to keep as well (selective checkpointing; names from
            :data:`ponente.models.remat.CHECKPOINT_NAMES`: ``attn_qkv``, ``attn_context``, ``attn_out``,
            ``mlp_in``, ``mlp_out``), or a ``ScanCheckpointPolicy``.
        scan_layers: run the layers as one compiled block in a loop (True, the default: ``jax.lax.scan``, compile
            time independent of depth) or unrolled, one copy of the block per layer (False: XLA sees the whole
            network and may schedule and fuse across layers, and compile time grows with depth). The parameters
            stay stacked either way, so checkpoints, Hugging Face conversion and LoRA are the same; Levanter's key of
            this name switches to separate per-layer parameters instead. Unrolled layers are checkpointed with
            ``prevent_cse``; XLA's CPU backend still keeps every internal of straight-line code (no memory saved).
        attn_backend: the attention kernel, one of ``ponente.models.ATTENTION_BACKENDS``: ``"auto"`` (the fastest
            backend that supports the call on the device it runs on), ``"reference"`` (materialized scores),
            ``"flash"`` (blockwise, never materializing the full score matrix), ``"xla"``/``"cudnn"``
            (``jax.nn.dot_product_attention``) or ``"pallas"`` (JAX's GPU/TPU kernels); see
            :mod:`ponente.models.attention.backends`.
        flash_attention_block_size: the query/key block size of the ``"flash"`` backend.
        attention_context_parallel: the attention under context parallelism (``trainer.context_axis_size > 1``):
            ``"allgather"`` (keys and values gathered over the context axis, then ``attn_backend``) or ``"ring"``
            (key/value blocks passed around the devices with the online-softmax merge; blocks of grouped-query
            attention layers; the others all-gather).
        vocab_padding_multiple: ``build(Vocab)`` pads the vocabulary axis to a multiple of this (1: no padding);
            logits of padded entries are the dtype's most negative value, so they never win and add nothing
            to the softmax, and Hugging Face export drops them.
    """

    model_type: ClassVar[str] = ""
    glu_mlp: ClassVar[bool] = True
    """Whether the MLP is gated (three matrices, e.g. SwiGLU) rather than two; used to count FLOPs."""

    seq_len: int = 1024
    hidden_dim: int = 768
    intermediate_dim: int = 3072
    num_layers: int = 12
    num_heads: int = 12
    num_kv_heads: int = 12
    head_dim: int | None = None
    gradient_checkpointing: bool | str | tuple[str, ...] | ScanCheckpointPolicy = False
    scan_layers: bool = True
    attn_backend: str = "auto"
    flash_attention_block_size: int = 128
    attention_context_parallel: str = "allgather"
    vocab_padding_multiple: int = 1

    def __post_init__(self) -> None:
        name = type(self).__name__
        if self.attn_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"{name}: attn_backend {self.attn_backend!r} is not supported; expected one of {ATTENTION_BACKENDS}"
            )
        if self.attention_context_parallel not in ATTENTION_CONTEXT_PARALLEL:
            raise ValueError(
                f"{name}: attention_context_parallel {self.attention_context_parallel!r} is not supported; expected "
                f"one of {ATTENTION_CONTEXT_PARALLEL}"
            )
        if not isinstance(self.scan_layers, bool):
            raise ValueError(f"{name}: scan_layers must be true or false, got {self.scan_layers!r}")
        object.__setattr__(
            self,
            "gradient_checkpointing",
            check_gradient_checkpointing(self.gradient_checkpointing, f"{name}.gradient_checkpointing"),
        )
        if self.flash_attention_block_size <= 0:
            raise ValueError(
                f"{name}: flash_attention_block_size must be positive, got {self.flash_attention_block_size}"
            )
        if self.vocab_padding_multiple <= 0:
            raise ValueError(f"{name}: vocab_padding_multiple must be positive, got {self.vocab_padding_multiple}")
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"{type(self).__name__}: num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim is None and self.hidden_dim % self.num_heads != 0:
            raise ValueError(
                f"{type(self).__name__}: hidden_dim ({self.hidden_dim}) is not divisible by num_heads "
                f"({self.num_heads}); set head_dim explicitly"
            )

    @property
    def layer_unroll(self) -> bool | None:
        """The ``unroll`` the models give their loop over layers: None (a loop) or True (unrolled; ``scan_layers``)."""
        return None if self.scan_layers else True

    # axes ------------------------------------------------------------------------------------------
    @property
    def Pos(self) -> Axis:
        """The query position axis ``position``."""
        return Axis("position", self.seq_len)

    @property
    def KeyPos(self) -> Axis:
        """The key/value position axis ``key_position``."""
        return Axis("key_position", self.seq_len)

    @property
    def Embed(self) -> Axis:
        """The model-width axis ``embed``."""
        return Axis("embed", self.hidden_dim)

    @property
    def Heads(self) -> Axis:
        """The query-heads axis ``heads``."""
        return Axis("heads", self.num_heads)

    @property
    def KVHeads(self) -> Axis:
        """The key/value-heads axis ``kv_heads``."""
        return Axis("kv_heads", self.num_kv_heads)

    @property
    def QHeadsPerGroup(self) -> Axis:
        """The query heads sharing one key/value head, axis ``q_heads_per_group``."""
        return Axis("q_heads_per_group", self.num_heads // self.num_kv_heads)

    @property
    def HeadSize(self) -> Axis:
        """The per-head axis ``head_size``."""
        return Axis("head_size", self.head_dim if self.head_dim is not None else self.hidden_dim // self.num_heads)

    @property
    def Mlp(self) -> Axis:
        """The MLP-width axis ``mlp``."""
        return Axis("mlp", self.intermediate_dim)

    @property
    def Layers(self) -> Axis:
        """The stacked-layers axis ``layers``."""
        return Axis("layers", self.num_layers)

    def padded_vocab(self, Vocab: Axis) -> Axis:
        """``Vocab`` padded to a multiple of ``vocab_padding_multiple`` (the axis the built model's logits have).

        Args:
            Vocab: the real vocabulary axis.

        Returns:
            The padded axis (same name).
        """
        return Axis(Vocab.name, padded_vocab_size(Vocab.size, self.vocab_padding_multiple))

    # interface -------------------------------------------------------------------------------------
    @abc.abstractmethod
    def build(self, Vocab: Axis, *, key: jax.Array) -> LmHeadModel:
        """Build a randomly initialized model.

        Args:
            Vocab: the vocabulary axis (``Axis("vocab", n)``).
            key: the PRNG key.

        Returns:
            The model.
        """

    def flops_per_token(self, vocab_size: int) -> float:
        """Forward-pass FLOPs per token (matrix products incl. attention, honouring sliding windows), used for MFU.

        Architectures whose forward pass is the standard decoder (attention + MLP per layer, then the
        output projection) share this count; others override it.

        Args:
            vocab_size: the real vocabulary size (the count uses it padded to ``vocab_padding_multiple``, as the
                model computes the padded logits).

        Returns:
            FLOPs per token.
        """
        return lm_flops_per_token(
            hidden_dim=self.hidden_dim,
            intermediate_dim=self.intermediate_dim,
            num_layers=self.num_layers,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_size=self.HeadSize.size,
            seq_len=self.seq_len,
            vocab_size=padded_vocab_size(vocab_size, self.vocab_padding_multiple),
            glu=self.glu_mlp,
            attention_windows=self.attention_windows(),
        )

    def attention_windows(self) -> tuple[int | None, ...]:
        """Per layer, the sliding window (keys a query sees, itself included), or None for full causal attention.

        Used to count attention FLOPs (:meth:`flops_per_token`); architectures with sliding windows override it.
        """
        return (None,) * self.num_layers

    @abc.abstractmethod
    def to_hf_config(self, vocab_size: int) -> dict[str, Any]:
        """The Hugging Face ``config.json`` contents (transformers-5 spelling) for this config.

        Args:
            vocab_size: the vocabulary size to record.

        Returns:
            A JSON-serializable dict.
        """

    @classmethod
    @abc.abstractmethod
    def from_hf_config(cls, hf_config: Mapping[str, Any]) -> LmConfig:
        """Build a config from a Hugging Face ``config.json`` dict (transformers-4 or -5 spelling).

        Args:
            hf_config: the parsed ``config.json``.

        Returns:
            The config.

        Raises:
            KeyError: if a required key is missing.
        """

    def param_count(self, vocab_size: int) -> int:
        """The number of parameters of the model this config builds (counted without allocating it).

        Args:
            vocab_size: the vocabulary size.

        Returns:
            The total number of array elements in the model's parameters.
        """
        shapes = eqx.filter_eval_shape(lambda k: self.build(Axis("vocab", vocab_size), key=k), jax.random.key(0))
        leaves = jax.tree_util.tree_leaves(shapes, is_leaf=lambda x: isinstance(x, hax.NamedArray))
        total = 0
        for leaf in leaves:
            array = leaf.array if isinstance(leaf, hax.NamedArray) else leaf
            if hasattr(array, "shape"):
                total += int(np.prod(array.shape))
        return total


def _require(hf_config: Mapping[str, Any], key: str, where: str) -> Any:
    """``hf_config[key]`` or a KeyError naming the key and the config type."""
    if key not in hf_config:
        raise KeyError(f"{where}: the Hugging Face config has no {key!r} key (keys: {sorted(hf_config)})")
    return hf_config[key]
