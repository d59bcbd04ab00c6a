"""Qwen2: Llama with biases on the query, key and value projections and an optional sliding window on all or some
layers."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, Protocol, cast

import equinox as eqx
import jax

import ponente.namedtensor as hax
from ponente.namedtensor import Axis, NamedArray
from ponente.namedtensor.nn import Linear

from ._layer_types import FULL, SLIDING, check_layer_types, layer_kinds, select_by_kind, with_sliding_window
from .attention import Attention, AttentionMask
from .attention.kv_cache import KvCache
from .config import register_config
from .llama import LlamaConfig, LlamaDecoderLayer, QkNormAttention
from .mistral import MistralConfig, MistralLMHeadModel

__all__ = ["QwenConfig", "QwenLMHeadModel"]

_HF_MAX_WINDOW_LAYERS = 28  # transformers' default ``max_window_layers`` of Qwen2 and Qwen3
_HF_SLIDING_WINDOW = 4096  # transformers' default ``sliding_window`` of Qwen2 and Qwen3


def _qwen_layer_types(
    num_layers: int, sliding_window: int | None, layer_types: Sequence[str] | None
) -> tuple[str, ...]:
    """Per layer, ``"sliding_attention"`` or ``"full_attention"`` (``layer_types=None``: all slide iff windowed)."""
    if layer_types is not None:
        return tuple(layer_types)
    return (SLIDING if sliding_window is not None else FULL,) * num_layers


def _check_qwen_layer_types(
    layer_types: Sequence[str] | None, sliding_window: int | None, num_layers: int, where: str
) -> None:
    """The ``__post_init__`` check of the Qwen2/Qwen3 ``layer_types`` field.

    Raises:
        ValueError: for a wrong length, an unknown type, or sliding layers without a ``sliding_window``.
    """
    if layer_types is None:
        return
    check_layer_types(layer_types, num_layers, where)
    sliding = [i for i, t in enumerate(layer_types) if t == SLIDING]
    if sliding and sliding_window is None:
        raise ValueError(
            f"{where}: layer_types marks layers {sliding} as {SLIDING!r} but sliding_window is None; set a window "
            f"or mark them {FULL!r}"
        )


def _qwen_window_to_hf(
    sliding_window: int | None, layer_types: Sequence[str] | None, num_layers: int
) -> dict[str, Any]:
    """The Qwen2/Qwen3 ``config.json`` keys saying which layers attend over ``sliding_window``.

    Both spellings are written: transformers 5 reads ``layer_types``; ``max_window_layers`` (the first sliding layer)
    is the transformers-4 spelling, exact when the sliding layers are the last ones.
    """
    types = _qwen_layer_types(num_layers, sliding_window, layer_types)
    first_sliding = types.index(SLIDING) if SLIDING in types else num_layers
    return {
        "use_sliding_window": sliding_window is not None,
        "sliding_window": sliding_window,
        "max_window_layers": first_sliding,
        "layer_types": list(types),
    }


def _qwen_window_from_hf(
    hf_config: Mapping[str, Any], num_layers: int, where: str
) -> tuple[int | None, tuple[str, ...] | None]:
    """``(sliding_window, layer_types)`` of a Qwen2/Qwen3 ``config.json``, as transformers 5 reads it.

    The window is ``sliding_window`` (default 4096) when ``use_sliding_window`` is true, else None. Layer ``i``
    slides when ``layer_types[i]`` is ``sliding_attention``; without ``layer_types`` (transformers-4 spelling),
    when there is a window and ``i >= max_window_layers`` (default 28). ``layer_types`` is returned as None when
    it is implied (every layer slides, or there is no window and no layer slides), so configs compare equal.

    Raises:
        ValueError: if ``layer_types`` has the wrong length or an unknown entry, or marks sliding layers while
            ``use_sliding_window`` is false or ``sliding_window`` is null (transformers fails on such a config).
    """
    window = hf_config.get("sliding_window", _HF_SLIDING_WINDOW) if hf_config.get("use_sliding_window") else None
    raw = hf_config.get("layer_types")
    if raw is None:
        if window is None:
            return None, None
        first_sliding = int(hf_config.get("max_window_layers", _HF_MAX_WINDOW_LAYERS))
        types = tuple(SLIDING if i >= first_sliding else FULL for i in range(num_layers))
    else:
        types = tuple(str(t) for t in raw)
        check_layer_types(types, num_layers, where)
        sliding = [i for i, t in enumerate(types) if t == SLIDING]
        if window is None and sliding:
            raise ValueError(
                f"{where}: layer_types marks layers {sliding} as {SLIDING!r} but there is no window "
                f"(use_sliding_window={hf_config.get('use_sliding_window')!r}, "
                f"sliding_window={hf_config.get('sliding_window')!r})"
            )
        if window is None:
            return None, None
    if all(t == SLIDING for t in types):
        return int(window), None
    return int(window), types


class _SlidingLayersConfig(Protocol):
    """What :class:`QwenLMHeadModel` needs of its config (Qwen2 and Qwen3 configs both provide it)."""

    @property
    def sliding_window(self) -> int | None: ...

    def resolved_layer_types(self) -> tuple[str, ...]: ...


def _with_zero_biases(attn: Attention | QkNormAttention, projections: Sequence[str]) -> Attention | QkNormAttention:
    """``attn`` with zero biases (as Hugging Face initializes them) on the named projections (e.g. ``"q_proj"``)."""
    inner = attn.attn if isinstance(attn, QkNormAttention) else attn
    linears: list[Linear] = [getattr(inner, name) for name in projections]
    biased = [dataclasses.replace(lin, bias=hax.zeros(lin.Out, dtype=lin.weight.dtype)) for lin in linears]
    inner = eqx.tree_at(lambda a: [getattr(a, name) for name in projections], inner, biased)
    return dataclasses.replace(attn, attn=inner) if isinstance(attn, QkNormAttention) else inner


@register_config("qwen", aliases=("qwen2",))
@dataclasses.dataclass(frozen=True)
class QwenConfig(MistralConfig):
    """Qwen2 (Hugging Face ``Qwen2ForCausalLM``, ``model_type: qwen2``): Llama plus query/key/value biases.

    All :class:`~ponente.models.LlamaConfig` fields apply; the query, key and value projections have
    biases (the output projection has none), as in every Qwen2 and Qwen2.5 checkpoint. Layers may attend
    over a sliding window, all of them or only some (``layer_types``); both kinds stay in one scanned stack.

    Attributes:
        sliding_window: how many keys (the query's own included) a sliding layer sees; None (the default, as in
            released Qwen2 checkpoints) for full causal attention everywhere.
        layer_types: per layer ``"sliding_attention"`` or ``"full_attention"`` (Hugging Face ``layer_types``);
            None: every layer slides when ``sliding_window`` is set.

    Example:
        >>> import jax, ponente.namedtensor as hax
        >>> cfg = QwenConfig(seq_len=8, hidden_dim=16, intermediate_dim=32, num_layers=2, num_heads=4, num_kv_heads=2)
        >>> model = cfg.build(hax.Axis("vocab", 11), key=jax.random.key(0))
        >>> model.to_hf_state_dict()["model.layers.0.self_attn.k_proj.bias"].shape
        (8,)
        >>> types = ("full_attention", "sliding_attention")
        >>> QwenConfig(num_layers=2, sliding_window=4, layer_types=types).to_hf_config(11)["max_window_layers"]
        1
    """

    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_qwen_layer_types(self.layer_types, self.sliding_window, self.num_layers, type(self).__name__)

    def resolved_layer_types(self) -> tuple[str, ...]:
        """``layer_types``, or every layer ``"sliding_attention"`` (with a window) or ``"full_attention"``.

        Returns:
            One entry per layer.
        """
        return _qwen_layer_types(self.num_layers, self.sliding_window, self.layer_types)

    def attention_windows(self) -> tuple[int | None, ...]:
        """``sliding_window`` for the sliding layers, None for the others (see :meth:`LmConfig.attention_windows`)."""
        return tuple(self.sliding_window if t == SLIDING else None for t in self.resolved_layer_types())

    def build(self, Vocab: Axis, *, key: jax.Array) -> QwenLMHeadModel:
        """Build a randomly initialized Qwen2 (see :meth:`LmConfig.build`)."""
        return QwenLMHeadModel.init(self, Vocab, key=key)

    def to_hf_config(self, vocab_size: int) -> dict[str, Any]:
        """The Hugging Face ``Qwen2Config`` dict, transformers-5 spelling (see :meth:`LmConfig.to_hf_config`).

        The layers that slide are written both as ``layer_types`` (transformers 5) and ``max_window_layers``
        (transformers 4; exact when the sliding layers are the last ones).

        Raises:
            ValueError: if ``qk_norm`` is set (transformers' Qwen2 has no QK-norm).
        """
        hf = self._llama_hf_config(vocab_size)
        del hf["attention_bias"], hf["mlp_bias"]  # keys of Llama only (Qwen2's biases are fixed)
        hf.update(architectures=["Qwen2ForCausalLM"], model_type="qwen2")
        hf.update(_qwen_window_to_hf(self.sliding_window, self.layer_types, self.num_layers))
        return hf

    @classmethod
    def from_hf_config(cls, hf_config: Mapping[str, Any]) -> QwenConfig:
        """Read a Hugging Face ``Qwen2Config`` dict (transformers-4 or -5 spelling).

        ``layer_types`` takes precedence over ``max_window_layers`` (see ``_qwen_window_from_hf``).

        Raises:
            KeyError: if a required key is missing.
            ValueError: for unsupported options, or a ``layer_types`` of the wrong length, with an unknown entry,
                or with sliding layers but no window.
        """
        config = cast(QwenConfig, super().from_hf_config(hf_config))
        window, types = _qwen_window_from_hf(hf_config, config.num_layers, f"{cls.__name__}.from_hf_config")
        return dataclasses.replace(config, sliding_window=window, layer_types=types)


class QwenDecoderLayer(LlamaDecoderLayer):
    """A Llama block whose query, key and value projections have biases (Qwen2), on a full or sliding mask."""

    @staticmethod
    def _init_attention(config: LlamaConfig, *, key: jax.Array) -> Attention | QkNormAttention:
        return _with_zero_biases(LlamaDecoderLayer._init_attention(config, key=key), ("q_proj", "k_proj", "v_proj"))

    def __call__(
        self,
        x: NamedArray,
        mask: AttentionMask | NamedArray | None,
        sliding_mask: AttentionMask | NamedArray | None = None,
        sliding: bool | NamedArray = False,
        *,
        pos_ids: NamedArray | None = None,
    ) -> NamedArray:
        """Apply the block to ``(..., position, embed)``.

        Args:
            x: the input.
            mask: the mask of a full-attention layer.
            sliding_mask: the mask of a sliding layer (``mask`` restricted to the window).
            sliding: whether this layer slides (a bool, or a scalar boolean NamedArray inside a scan).
            pos_ids: the rotary positions (None: ``0 .. n - 1``).

        Returns:
            ``(..., position, embed)``.
        """
        h = self.input_layernorm(x)
        x = x + select_by_kind(
            sliding,
            lambda: self.self_attn(h, sliding_mask, pos_ids=pos_ids),
            lambda: self.self_attn(h, mask, pos_ids=pos_ids),
        )
        return x + self.mlp(self.post_attention_layernorm(x))

    def decode(
        self,
        x: NamedArray,
        cache: KvCache,
        pos_ids: NamedArray,
        *,
        sliding: bool | NamedArray = False,
        window: int | None = None,
    ) -> tuple[NamedArray, KvCache]:
        """The block over cached keys and values (see :meth:`~ponente.models.LmHeadModel.decode`).

        Args:
            x: ``(batch, position, embed)``.
            cache: this layer's cache.
            pos_ids: the tokens' positions over ``(batch, position)``.
            sliding: whether this layer slides (a bool, or a scalar boolean NamedArray inside the scan).
            window: the window of sliding layers.

        Returns:
            ``((batch, position, embed), the updated cache)``.
        """
        h = self.input_layernorm(x)
        attn_out, cache = select_by_kind(
            sliding,
            lambda: self.self_attn.decode(h, cache, pos_ids, window=window),
            lambda: self.self_attn.decode(h, cache, pos_ids),
        )
        x = x + attn_out
        return x + self.mlp(self.post_attention_layernorm(x)), cache


class QwenLMHeadModel(MistralLMHeadModel):
    """Qwen2: :class:`~ponente.models.MistralLMHeadModel` with Q/K/V biases, its sliding window on all or some layers.

    Its Hugging Face parameter names are Llama's plus ``model.layers.L.self_attn.{q,k,v}_proj.bias``. A mask
    passed by the caller (segment ids, an explicit boolean mask) is intersected with the window on sliding
    layers, never replaced.
    """

    _decoder_layer: ClassVar[type[LlamaDecoderLayer]] = QwenDecoderLayer

    def activations(
        self,
        input_ids: NamedArray,
        attn_mask: AttentionMask | NamedArray | None = None,
        *,
        key: jax.Array | None = None,
        pos_ids: NamedArray | None = None,
    ) -> NamedArray:
        """The final hidden states ``(..., position, embed)`` (see :meth:`LlamaLMHeadModel.activations`).

        Args:
            input_ids: integer ids ``(..., position)``.
            attn_mask: the attention mask (None: causal); sliding layers further restrict it to their window.
            key: unused (no dropout).
            pos_ids: the rotary positions ``(..., position)`` (None: ``0 .. n - 1``; see :class:`LmHeadModel`).

        Returns:
            The hidden states after the final norm.
        """
        del key
        config = cast(_SlidingLayersConfig, self.config)
        mask = AttentionMask.causal() if attn_mask is None else attn_mask
        sliding_mask = with_sliding_window(attn_mask, config.sliding_window, input_ids.resolve_axis("position"))
        kinds = layer_kinds(config.resolved_layer_types(), self.config.Layers)
        x = self.transformer.embed_tokens.embed(input_ids)
        x = self.transformer.layers.fold(
            x, mask, sliding_mask, kinds, pos_ids=pos_ids, unroll=self.config.layer_unroll
        )
        return self.transformer.norm(x)

    def _decode_kwargs(self) -> dict[str, Any]:
        """The per-layer sliding flags and the window (see :meth:`LlamaLMHeadModel.decode`)."""
        config = cast(_SlidingLayersConfig, self.config)
        return {
            "sliding": layer_kinds(config.resolved_layer_types(), self.config.Layers),
            "window": config.sliding_window,
        }
