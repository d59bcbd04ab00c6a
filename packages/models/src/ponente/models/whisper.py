"""Whisper: a log-mel spectrogram encoder and a text decoder with cross-attention (HF Whisper for ASR).

The encoder runs two 1-D convolutions over the ``frame`` axis of the features (the second with stride 2, so 3000
frames become 1500 ``source`` positions), adds fixed sinusoidal positions (a frozen table: Whisper's sinusoids for a
new model, the checkpoint's own table for a loaded one) and applies pre-LayerNorm transformer blocks. The decoder
embeds tokens, adds learned positions, and each block attends causally over the tokens, then over the encoder's
output, then applies a GELU MLP. The output projection is the token embedding (tied).

Axes: ``mel`` (feature bins), ``frame`` (input frames), ``source`` (encoder positions), ``position`` (decoder
positions), ``embed``, ``heads``, ``head_size``, ``mlp``, ``vocab``, ``layers``; decoding caches the decoder's
keys and values over ``cache_position``.

Example:
    >>> import jax, ponente.namedtensor as hax
    >>> cfg = WhisperConfig.preset("tiny").scaled(d_model=16, layers=1, heads=2, max_source_positions=8)
    >>> model = cfg.build(key=jax.random.key(0))
    >>> feats = hax.zeros({"batch": 1, "mel": 80, "frame": 16})
    >>> model(feats, hax.zeros({"batch": 1, "position": 3}, dtype=int)).shape
    {'batch': 1, 'position': 3, 'vocab': 51865}
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import ponente.namedtensor as hax
from ponente.namedtensor import Axis, NamedArray, ScanCheckpointPolicy
from ponente.namedtensor.nn import Conv, Embedding, LayerNorm, Linear, Stacked
from ponente.namedtensor.state_dict import from_torch_compatible_state_dict, to_torch_compatible_state_dict

from .config import _require
from .remat import check_gradient_checkpointing, tag

__all__ = ["WHISPER_PRESETS", "WhisperConfig", "WhisperDecodeState", "WhisperModel", "sinusoids"]

_MULTILINGUAL = {"vocab_size": 51865, "decoder_start_token_id": 50258, "eos_token_id": 50257, "pad_token_id": 50257}
_ENGLISH = {"vocab_size": 51864, "decoder_start_token_id": 50257, "eos_token_id": 50256, "pad_token_id": 50256}


def _size(d_model: int, layers: int, heads: int, **extra: Any) -> dict[str, Any]:
    return {
        "d_model": d_model,
        "encoder_layers": layers,
        "decoder_layers": layers,
        "encoder_attention_heads": heads,
        "decoder_attention_heads": heads,
        "encoder_ffn_dim": 4 * d_model,
        "decoder_ffn_dim": 4 * d_model,
        **extra,
    }


WHISPER_PRESETS: dict[str, dict[str, Any]] = {
    "tiny": _size(384, 4, 6, **_MULTILINGUAL),
    "tiny.en": _size(384, 4, 6, **_ENGLISH),
    "base": _size(512, 6, 8, **_MULTILINGUAL),
    "base.en": _size(512, 6, 8, **_ENGLISH),
    "small": _size(768, 12, 12, **_MULTILINGUAL),
    "small.en": _size(768, 12, 12, **_ENGLISH),
    "medium": _size(1024, 24, 16, **_MULTILINGUAL),
    "medium.en": _size(1024, 24, 16, **_ENGLISH),
    "large": _size(1280, 32, 20, **_MULTILINGUAL),
    "large-v2": _size(1280, 32, 20, **_MULTILINGUAL),
    "large-v3": _size(1280, 32, 20, **{**_MULTILINGUAL, "vocab_size": 51866}, num_mel_bins=128),
    "large-v3-turbo": {
        **_size(1280, 32, 20, **{**_MULTILINGUAL, "vocab_size": 51866}, num_mel_bins=128),
        "decoder_layers": 4,
    },
}
"""The published OpenAI Whisper sizes (``openai/whisper-<name>`` on the Hugging Face Hub)."""


@dataclasses.dataclass(frozen=True)
class WhisperConfig:
    """Whisper's hyperparameters, named as in Hugging Face's ``WhisperConfig``.

    Attributes:
        vocab_size: token vocabulary (51865 multilingual, 51864 English-only, 51866 large-v3).
        num_mel_bins: mel bins of the input features (80; 128 for large-v3).
        d_model: the model width.
        encoder_layers: encoder blocks.
        encoder_attention_heads: encoder attention heads.
        encoder_ffn_dim: encoder MLP width.
        decoder_layers: decoder blocks.
        decoder_attention_heads: decoder attention heads.
        decoder_ffn_dim: decoder MLP width.
        max_source_positions: encoder positions (1500: 30 s of audio, 3000 frames halved by the stride-2 conv).
        max_target_positions: decoder positions (448).
        layer_norm_eps: LayerNorm epsilon.
        scale_embedding: multiply token embeddings by ``sqrt(d_model)``.
        decoder_start_token_id: ``<|startoftranscript|>``.
        eos_token_id: ``<|endoftext|>``.
        pad_token_id: the id generation pads finished rows with.
        suppress_tokens: ids never generated.
        begin_suppress_tokens: ids not generated as the first new token.
        init_std: standard deviation of the random initialisation.
        gradient_checkpointing: what each block keeps for the backward pass (see ``LmConfig.gradient_checkpointing``:
            False, True, a shortcut such as ``"offload"``, or a list of :data:`ponente.models.remat.CHECKPOINT_NAMES`).
        scan_layers: run each stack's layers as one compiled block in a loop (True) or unrolled (False); the
            parameters stay stacked either way (see ``LmConfig.scan_layers``).
    """

    vocab_size: int = 51865
    num_mel_bins: int = 80
    d_model: int = 384
    encoder_layers: int = 4
    encoder_attention_heads: int = 6
    encoder_ffn_dim: int = 1536
    decoder_layers: int = 4
    decoder_attention_heads: int = 6
    decoder_ffn_dim: int = 1536
    max_source_positions: int = 1500
    max_target_positions: int = 448
    layer_norm_eps: float = 1e-5
    scale_embedding: bool = False
    decoder_start_token_id: int = 50258
    eos_token_id: int = 50257
    pad_token_id: int = 50257
    suppress_tokens: tuple[int, ...] = ()
    begin_suppress_tokens: tuple[int, ...] = ()
    init_std: float = 0.02
    gradient_checkpointing: bool | str | tuple[str, ...] | ScanCheckpointPolicy = False
    scan_layers: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.scan_layers, bool):
            raise ValueError(f"WhisperConfig: scan_layers must be true or false, got {self.scan_layers!r}")
        object.__setattr__(
            self,
            "gradient_checkpointing",
            check_gradient_checkpointing(self.gradient_checkpointing, "WhisperConfig.gradient_checkpointing"),
        )
        for heads, name in ((self.encoder_attention_heads, "encoder"), (self.decoder_attention_heads, "decoder")):
            if heads < 1 or self.d_model % heads:
                raise ValueError(
                    f"WhisperConfig: d_model ({self.d_model}) must be a multiple of {name}_attention_heads ({heads})"
                )
        for name in ("vocab_size", "num_mel_bins", "encoder_layers", "decoder_layers", "max_source_positions"):
            if getattr(self, name) < 1:
                raise ValueError(f"WhisperConfig: {name} must be positive, got {getattr(self, name)}")
        object.__setattr__(self, "suppress_tokens", tuple(int(t) for t in self.suppress_tokens))
        object.__setattr__(self, "begin_suppress_tokens", tuple(int(t) for t in self.begin_suppress_tokens))

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> WhisperConfig:
        """A published size (:data:`WHISPER_PRESETS`: ``tiny`` ... ``large-v3``), with optional overrides.

        Raises:
            ValueError: for an unknown name (the message lists the sizes).
        """
        if name not in WHISPER_PRESETS:
            raise ValueError(f"Whisper size {name!r} is unknown; choose among {sorted(WHISPER_PRESETS)}")
        return cls(**{**WHISPER_PRESETS[name], **overrides})

    def scaled(self, *, d_model: int, layers: int, heads: int, **overrides: Any) -> WhisperConfig:
        """A copy with another width, depth (both stacks) and head count (MLPs 4x wide): for tests and examples."""
        return dataclasses.replace(self, **{**_size(d_model, layers, heads), **overrides})

    # axes
    @property
    def layer_unroll(self) -> bool | None:
        """The ``unroll`` of the loops over layers: None (a loop) or True (unrolled; ``scan_layers``)."""
        return None if self.scan_layers else True

    @property
    def Embed(self) -> Axis:
        return Axis("embed", self.d_model)

    @property
    def Vocab(self) -> Axis:
        return Axis("vocab", self.vocab_size)

    @property
    def Mels(self) -> Axis:
        return Axis("mel", self.num_mel_bins)

    @property
    def Source(self) -> Axis:
        return Axis("source", self.max_source_positions)

    @property
    def Frames(self) -> Axis:
        """The input frames the encoder expects: twice its positions."""
        return Axis("frame", 2 * self.max_source_positions)

    @property
    def TargetPos(self) -> Axis:
        """The rows of the decoder's position table (named apart from the ``position`` axis of the tokens)."""
        return Axis("target_position", self.max_target_positions)

    def build(self, *, key: jax.Array) -> WhisperModel:
        """A randomly initialised model."""
        return WhisperModel.init(self, key=key)

    def to_hf_config(self) -> dict[str, Any]:
        """The Hugging Face ``WhisperConfig`` dict."""
        return {
            "architectures": ["WhisperForConditionalGeneration"],
            "model_type": "whisper",
            "vocab_size": self.vocab_size,
            "num_mel_bins": self.num_mel_bins,
            "d_model": self.d_model,
            "encoder_layers": self.encoder_layers,
            "encoder_attention_heads": self.encoder_attention_heads,
            "encoder_ffn_dim": self.encoder_ffn_dim,
            "decoder_layers": self.decoder_layers,
            "decoder_attention_heads": self.decoder_attention_heads,
            "decoder_ffn_dim": self.decoder_ffn_dim,
            "max_source_positions": self.max_source_positions,
            "max_target_positions": self.max_target_positions,
            "activation_function": "gelu",
            "scale_embedding": self.scale_embedding,
            "decoder_start_token_id": self.decoder_start_token_id,
            "eos_token_id": self.eos_token_id,
            "bos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
            "suppress_tokens": list(self.suppress_tokens),
            "begin_suppress_tokens": list(self.begin_suppress_tokens),
            "init_std": self.init_std,
            "tie_word_embeddings": True,
            "dropout": 0.0,
            "attention_dropout": 0.0,
            "activation_dropout": 0.0,
        }

    @classmethod
    def from_hf_config(cls, hf_config: Mapping[str, Any]) -> WhisperConfig:
        """Read a Hugging Face ``WhisperConfig`` dict.

        Raises:
            KeyError: if a required key is missing (named).
            ValueError: for options this implementation does not support (named).
        """
        where = "WhisperConfig.from_hf_config"
        act = hf_config.get("activation_function", "gelu")
        if act != "gelu":
            raise ValueError(f"{where}: activation_function {act!r} is not supported (expected 'gelu')")
        if hf_config.get("tie_word_embeddings", True) is False:
            raise ValueError(f"{where}: tie_word_embeddings=false is not supported (Whisper ties proj_out)")
        suppress = hf_config.get("suppress_tokens") or ()
        begin = hf_config.get("begin_suppress_tokens") or ()
        return cls(
            vocab_size=int(_require(hf_config, "vocab_size", where)),
            num_mel_bins=int(hf_config.get("num_mel_bins", 80)),
            d_model=int(_require(hf_config, "d_model", where)),
            encoder_layers=int(_require(hf_config, "encoder_layers", where)),
            encoder_attention_heads=int(_require(hf_config, "encoder_attention_heads", where)),
            encoder_ffn_dim=int(_require(hf_config, "encoder_ffn_dim", where)),
            decoder_layers=int(_require(hf_config, "decoder_layers", where)),
            decoder_attention_heads=int(_require(hf_config, "decoder_attention_heads", where)),
            decoder_ffn_dim=int(_require(hf_config, "decoder_ffn_dim", where)),
            max_source_positions=int(hf_config.get("max_source_positions", 1500)),
            max_target_positions=int(hf_config.get("max_target_positions", 448)),
            layer_norm_eps=float(hf_config.get("layer_norm_eps", 1e-5)),
            scale_embedding=bool(hf_config.get("scale_embedding", False)),
            decoder_start_token_id=int(hf_config.get("decoder_start_token_id", 50258)),
            eos_token_id=int(hf_config.get("eos_token_id", 50257)),
            pad_token_id=int(hf_config.get("pad_token_id", hf_config.get("eos_token_id", 50257))),
            suppress_tokens=tuple(int(t) for t in suppress),
            begin_suppress_tokens=tuple(int(t) for t in begin),
            init_std=float(hf_config.get("init_std", 0.02)),
        )


def sinusoids(length: int, channels: int, max_timescale: float = 10_000.0) -> np.ndarray:
    """Whisper's fixed encoder positions: ``[length, channels]``, sines in the first half, cosines in the second."""
    if channels % 2:
        raise ValueError(f"sinusoids: channels must be even, got {channels}")
    increment = math.log(max_timescale) / (channels // 2 - 1)
    inv = np.exp(-increment * np.arange(channels // 2))
    angles = np.arange(length)[:, None] * inv[None, :]
    return np.concatenate([np.sin(angles), np.cos(angles)], axis=1).astype(np.float32)


class WhisperAttention(eqx.Module):
    """Multi-head attention; ``k_proj`` has no bias (as in Whisper)."""

    q_proj: Linear
    k_proj: Linear
    v_proj: Linear
    out_proj: Linear

    @staticmethod
    def init(Embed: Axis, heads: int, std: float, *, key: jax.Array) -> WhisperAttention:
        Heads, HeadSize = Axis("heads", heads), Axis("head_size", Embed.size // heads)
        kq, kk, kv, ko = jax.random.split(key, 4)
        scale = std * math.sqrt(Embed.size)  # Linear's σ is init_scale / sqrt(fan_in)
        return WhisperAttention(
            q_proj=Linear.init(Embed, (Heads, HeadSize), key=kq, init_scale=scale),
            k_proj=Linear.init(Embed, (Heads, HeadSize), key=kk, use_bias=False, init_scale=scale),
            v_proj=Linear.init(Embed, (Heads, HeadSize), key=kv, init_scale=scale),
            out_proj=Linear.init((Heads, HeadSize), Embed, key=ko, init_scale=scale),
        )

    def project_kv(self, x: NamedArray, Pos: str) -> tuple[NamedArray, NamedArray]:
        """Keys and values of ``x``, with ``Pos`` renamed to ``key_position`` (the axis attention reduces over)."""
        k, v = self.k_proj(x).rename({Pos: "key_position"}), self.v_proj(x).rename({Pos: "key_position"})
        return tag((k, v), "attn_qkv")

    def attend(self, x: NamedArray, k: NamedArray, v: NamedArray, mask: NamedArray | None) -> NamedArray:
        """Queries from ``x`` over keys/values with a ``key_position`` axis (``mask``: True where allowed)."""
        q = tag(self.q_proj(x), "attn_qkv")
        head_size = q.resolve_axis("head_size").size
        scores = hax.dot(q * (head_size**-0.5), k, axis="head_size")
        if mask is not None:
            scores = hax.where(mask, scores, jnp.finfo(scores.dtype).min)
        weights = hax.nn.softmax(scores.astype(jnp.float32), axis="key_position").astype(v.dtype)
        context = tag(hax.dot(weights, v, axis="key_position"), "attn_context")
        return tag(self.out_proj(context), "attn_out")


class _Mlp(eqx.Module):
    fc1: Linear
    fc2: Linear

    @staticmethod
    def init(Embed: Axis, width: int, std: float, *, key: jax.Array) -> _Mlp:
        Mlp = Axis("mlp", width)
        k1, k2 = jax.random.split(key)
        return _Mlp(
            fc1=Linear.init(Embed, Mlp, key=k1, init_scale=std * math.sqrt(Embed.size)),
            fc2=Linear.init(Mlp, Embed, key=k2, init_scale=std * math.sqrt(width)),
        )

    def __call__(self, x: NamedArray) -> NamedArray:
        return tag(self.fc2(hax.nn.gelu(tag(self.fc1(x), "mlp_in"), approximate=False)), "mlp_out")


class WhisperEncoderLayer(eqx.Module):
    """Pre-LayerNorm self-attention and MLP (HF ``WhisperEncoderLayer``)."""

    self_attn: WhisperAttention
    self_attn_layer_norm: LayerNorm
    fc1: Linear
    fc2: Linear
    final_layer_norm: LayerNorm

    @staticmethod
    def init(config: WhisperConfig, *, key: jax.Array) -> WhisperEncoderLayer:
        ka, km = jax.random.split(key)
        mlp = _Mlp.init(config.Embed, config.encoder_ffn_dim, config.init_std, key=km)
        eps = config.layer_norm_eps
        return WhisperEncoderLayer(
            self_attn=WhisperAttention.init(config.Embed, config.encoder_attention_heads, config.init_std, key=ka),
            self_attn_layer_norm=LayerNorm.init(config.Embed, eps=eps),
            fc1=mlp.fc1,
            fc2=mlp.fc2,
            final_layer_norm=LayerNorm.init(config.Embed, eps=eps),
        )

    def __call__(self, x: NamedArray) -> NamedArray:
        h = self.self_attn_layer_norm(x)
        k, v = self.self_attn.project_kv(h, "source")
        x = x + self.self_attn.attend(h, k, v, None)
        return x + _Mlp(self.fc1, self.fc2)(self.final_layer_norm(x))


class WhisperDecoderLayer(eqx.Module):
    """Causal self-attention, cross-attention over the encoder output, MLP (HF ``WhisperDecoderLayer``)."""

    self_attn: WhisperAttention
    self_attn_layer_norm: LayerNorm
    encoder_attn: WhisperAttention
    encoder_attn_layer_norm: LayerNorm
    fc1: Linear
    fc2: Linear
    final_layer_norm: LayerNorm

    @staticmethod
    def init(config: WhisperConfig, *, key: jax.Array) -> WhisperDecoderLayer:
        ks, kc, km = jax.random.split(key, 3)
        mlp = _Mlp.init(config.Embed, config.decoder_ffn_dim, config.init_std, key=km)
        eps, heads = config.layer_norm_eps, config.decoder_attention_heads
        return WhisperDecoderLayer(
            self_attn=WhisperAttention.init(config.Embed, heads, config.init_std, key=ks),
            self_attn_layer_norm=LayerNorm.init(config.Embed, eps=eps),
            encoder_attn=WhisperAttention.init(config.Embed, heads, config.init_std, key=kc),
            encoder_attn_layer_norm=LayerNorm.init(config.Embed, eps=eps),
            fc1=mlp.fc1,
            fc2=mlp.fc2,
            final_layer_norm=LayerNorm.init(config.Embed, eps=eps),
        )

    def _rest(self, x: NamedArray, cross_k: NamedArray, cross_v: NamedArray) -> NamedArray:
        x = x + self.encoder_attn.attend(self.encoder_attn_layer_norm(x), cross_k, cross_v, None)
        return x + _Mlp(self.fc1, self.fc2)(self.final_layer_norm(x))

    def __call__(self, x: NamedArray, encoded: NamedArray) -> NamedArray:
        h = self.self_attn_layer_norm(x)
        k, v = self.self_attn.project_kv(h, "position")
        Pos = x.resolve_axis("position")
        causal = hax.arange(Pos).broadcast_axis(Axis("key_position", Pos.size)) >= hax.arange(
            Axis("key_position", Pos.size)
        )
        x = x + self.self_attn.attend(h, k, v, causal)
        cross_k, cross_v = self.encoder_attn.project_kv(encoded, "source")
        return self._rest(x, cross_k, cross_v)

    def decode(
        self,
        x: NamedArray,
        keys: NamedArray,
        values: NamedArray,
        cross_k: NamedArray,
        cross_v: NamedArray,
        start: jax.Array,
    ) -> tuple[NamedArray, tuple[NamedArray, NamedArray]]:
        """The layer over this layer's cache: write the new tokens' keys/values at ``start``, attend causally."""
        h = self.self_attn_layer_norm(x)
        k, v = self.self_attn.project_kv(h, "position")
        keys = _write(keys, k, start)
        values = _write(values, v, start)
        Slots = keys.resolve_axis("key_position")
        query_pos = hax.arange(x.resolve_axis("position")) + start
        allowed = hax.arange(Slots).broadcast_axis(query_pos.axes) <= query_pos
        x = x + self.self_attn.attend(h, keys, values, allowed)
        return self._rest(x, cross_k, cross_v), (keys, values)


def _write(cache: NamedArray, new: NamedArray, start: jax.Array) -> NamedArray:
    """``cache`` with ``new`` written at slots ``start ..`` of its ``key_position`` axis."""
    new = hax.rearrange(new, tuple(a.name for a in cache.axes))
    index = [jnp.asarray(0, jnp.int32)] * cache.ndim
    index[cache.axis_indices("key_position")] = jnp.asarray(start, jnp.int32)
    return NamedArray(jax.lax.dynamic_update_slice(cache.array, new.array.astype(cache.dtype), index), cache.axes)


class WhisperEncoder(eqx.Module):
    """The audio encoder (HF ``model.encoder``).

    ``embed_positions`` is the frozen table of fixed positions (HF ``model.encoder.embed_positions``, which
    transformers does not train either): :func:`sinusoids` for a new model, the stored table for a loaded one, so a
    checkpoint round-trips bit for bit (transformers computes the sinusoids in float32, which differ from
    :func:`sinusoids` by a few 1e-6). No gradient reaches it, and as an ``Embedding`` it is not weight-decayed.
    """

    conv1: Conv
    conv2: Conv
    layers: Stacked[WhisperEncoderLayer]
    layer_norm: LayerNorm
    embed_positions: Embedding

    def positions(self, n: int, dtype: Any) -> NamedArray:
        """The first ``n`` rows of the position table ``(source, embed)`` in ``dtype``, outside of any gradient."""
        table = jax.lax.stop_gradient(self.embed_positions.weight.array[:n])
        return hax.named(table.astype(dtype), ("source", "embed"))


class WhisperDecoder(eqx.Module):
    """The text decoder (HF ``model.decoder``)."""

    embed_tokens: Embedding
    embed_positions: Embedding
    layers: Stacked[WhisperDecoderLayer]
    layer_norm: LayerNorm


class _Core(eqx.Module):
    encoder: WhisperEncoder
    decoder: WhisperDecoder


class WhisperDecodeState(eqx.Module):
    """What decoding carries between steps: the decoder's self-attention cache and the cross-attention keys/values.

    Attributes:
        keys: ``(layers, batch, key_position, heads, head_size)`` self-attention keys, one slot per position.
        values: same axes.
        cross_keys: ``(layers, batch, key_position, heads, head_size)`` keys of the encoder output (1500 slots).
        cross_values: same axes.
        length: how many positions are filled (the next token's position).
    """

    keys: NamedArray
    values: NamedArray
    cross_keys: NamedArray
    cross_values: NamedArray
    length: jax.Array


class WhisperModel(eqx.Module):
    """Whisper for speech recognition (HF ``WhisperForConditionalGeneration``; ``proj_out`` tied to the embedding).

    Attributes:
        model: ``encoder`` and ``decoder`` (the attribute names follow Hugging Face's parameter names).
        config: the configuration (static).
    """

    model: _Core
    config: WhisperConfig = eqx.field(static=True)

    @staticmethod
    def init(config: WhisperConfig, *, key: jax.Array) -> WhisperModel:
        """A randomly initialised model."""
        k_c1, k_c2, k_enc, k_emb, k_pos, k_dec = jax.random.split(key, 6)
        Embed, std = config.Embed, config.init_std
        enc_layers = Axis("layers", config.encoder_layers)
        dec_layers = Axis("layers", config.decoder_layers)
        ckpt = config.gradient_checkpointing
        encoder = WhisperEncoder(
            # the first conv's channels get their own axis name: a conv's input and output axes must differ
            conv1=Conv.init("frame", config.Mels, Axis("conv_embed", config.d_model), 3, padding=1, key=k_c1),
            conv2=Conv.init("frame", Axis("conv_embed", config.d_model), Embed, 3, stride=2, padding=1, key=k_c2),
            layers=Stacked.init(enc_layers, WhisperEncoderLayer, gradient_checkpointing=ckpt)(
                config, key=jax.random.split(k_enc, config.encoder_layers)
            ),
            layer_norm=LayerNorm.init(Embed, eps=config.layer_norm_eps),
            embed_positions=_position_table(config, sinusoids(config.max_source_positions, config.d_model)),
        )
        decoder = WhisperDecoder(
            embed_tokens=Embedding.init(config.Vocab, Embed, key=k_emb, initializer_range=std),
            embed_positions=Embedding.init(config.TargetPos, Embed, key=k_pos, initializer_range=std),
            layers=Stacked.init(dec_layers, WhisperDecoderLayer, gradient_checkpointing=ckpt)(
                config, key=jax.random.split(k_dec, config.decoder_layers)
            ),
            layer_norm=LayerNorm.init(Embed, eps=config.layer_norm_eps),
        )
        return WhisperModel(model=_Core(encoder, decoder), config=config)

    # -- forward -------------------------------------------------------------------------------------------------

    def encode(self, features: NamedArray) -> NamedArray:
        """The encoder output ``(..., source, embed)`` of log-mel features ``(..., mel, frame)``.

        Raises:
            ValueError: if the features have the wrong number of mel bins or more frames than the encoder has
                positions for (the message gives both sizes).
        """
        cfg = self.config
        if features.resolve_axis("mel").size != cfg.num_mel_bins:
            raise ValueError(
                f"Whisper: features have {features.resolve_axis('mel').size} mel bins, the model expects "
                f"{cfg.num_mel_bins} (num_mel_bins)"
            )
        enc = self.model.encoder
        x = hax.nn.gelu(enc.conv1(features), approximate=False)
        x = hax.nn.gelu(enc.conv2(x), approximate=False).rename({"frame": "source"})
        n = x.resolve_axis("source").size
        if n > cfg.max_source_positions:
            raise ValueError(
                f"Whisper: {2 * n} frames give {n} encoder positions, more than max_source_positions "
                f"({cfg.max_source_positions})"
            )
        x = enc.layers.fold(x + enc.positions(n, x.dtype), unroll=cfg.layer_unroll)
        return enc.layer_norm(x)

    def _embed(self, tokens: NamedArray, start: jax.Array | int = 0) -> NamedArray:
        dec = self.model.decoder
        x = dec.embed_tokens.embed(tokens)
        if self.config.scale_embedding:
            x = x * math.sqrt(self.config.d_model)
        Pos = tokens.resolve_axis("position")
        positions = hax.arange(Pos) + start
        return x + dec.embed_positions.embed(positions)

    def _logits(self, x: NamedArray) -> NamedArray:
        return self.model.decoder.embed_tokens.unembed(self.model.decoder.layer_norm(x))

    def decode_logits(self, tokens: NamedArray, encoded: NamedArray) -> NamedArray:
        """Decoder logits ``(..., position, vocab)`` of ``tokens`` given the encoder output (teacher forcing)."""
        x = self.model.decoder.layers.fold(self._embed(tokens), encoded, unroll=self.config.layer_unroll)
        return self._logits(x)

    def __call__(self, features: NamedArray, tokens: NamedArray, *, key: jax.Array | None = None) -> NamedArray:
        """Logits ``(..., position, vocab)``: features ``(..., mel, frame)``, decoder tokens ``(..., position)``."""
        del key
        return self.decode_logits(tokens, self.encode(features))

    # -- decoding with a cache -----------------------------------------------------------------------------------

    def init_decode_state(self, encoded: NamedArray, max_len: int | None = None) -> WhisperDecodeState:
        """An empty self-attention cache of ``max_len`` slots and the cross-attention keys/values of ``encoded``."""
        cfg = self.config
        max_len = cfg.max_target_positions if max_len is None else max_len
        if not 0 < max_len <= cfg.max_target_positions:
            raise ValueError(
                f"Whisper: max_len {max_len} must be in 1..max_target_positions ({cfg.max_target_positions})"
            )

        def cross(layer: WhisperDecoderLayer, encoded: NamedArray) -> tuple[NamedArray, NamedArray]:
            return layer.encoder_attn.project_kv(encoded, "source")

        cross_k, cross_v = self.model.decoder.layers.vmap_via(cross)(encoded)
        # the self-attention cache: the cross keys' axes with max_len slots instead of the encoder's positions
        slots = [Axis("key_position", max_len) if a.name == "key_position" else a for a in cross_k.axes]
        zeros = hax.zeros(tuple(slots), dtype=cross_k.dtype)
        return WhisperDecodeState(zeros, zeros, cross_k, cross_v, jnp.asarray(0, jnp.int32))

    def decode_step(self, tokens: NamedArray, state: WhisperDecodeState) -> tuple[NamedArray, WhisperDecodeState]:
        """Logits of ``tokens`` ``(batch, position)`` placed at ``state.length ..``, and the updated state."""
        start = state.length
        x = self._embed(tokens, start)

        def layer_fn(
            layer: WhisperDecoderLayer,
            x: NamedArray,
            keys: NamedArray,
            values: NamedArray,
            ck: NamedArray,
            cv: NamedArray,
        ) -> tuple[NamedArray, tuple[NamedArray, NamedArray]]:
            return layer.decode(x, keys, values, ck, cv, start)

        x, (keys, values) = self.model.decoder.layers.scan_via(layer_fn, unroll=self.config.layer_unroll)(
            x, state.keys, state.values, state.cross_keys, state.cross_values
        )
        n = tokens.resolve_axis("position").size
        new_state = dataclasses.replace(state, keys=keys, values=values, length=start + n)
        return self._logits(x), new_state

    # -- Hugging Face parameters ---------------------------------------------------------------------------------

    def to_hf_state_dict(self) -> dict[str, np.ndarray]:
        """The parameters under Hugging Face's names (with the encoder's position table and the tied ``proj_out``)."""
        state = {k: np.asarray(v) for k, v in to_torch_compatible_state_dict(self).items()}
        state["proj_out.weight"] = state["model.decoder.embed_tokens.weight"]
        return state

    def from_hf_state_dict(self, state_dict: Mapping[str, Any]) -> WhisperModel:
        """A copy of this (template) model with parameters from a Hugging Face state dict.

        The encoder's position table is the checkpoint's as stored (bit for bit); a checkpoint without one gets
        Whisper's :func:`sinusoids`.

        Raises:
            KeyError: if a parameter is missing (named).
            ValueError: if a parameter has the wrong shape (named).
        """
        cfg = self.config
        name = "model.encoder.embed_positions.weight"
        state = {k: v for k, v in state_dict.items() if k != "proj_out.weight"}
        if name not in state:
            state[name] = sinusoids(cfg.max_source_positions, cfg.d_model)
        return from_torch_compatible_state_dict(self, state)


def _position_table(config: WhisperConfig, table: np.ndarray) -> Embedding:
    """The encoder's frozen position table ``(source, embed)``."""
    return Embedding(hax.named(jnp.asarray(table), (config.Source, config.Embed)), config.Source, config.Embed)


def greedy_transcribe(
    model: WhisperModel,
    features: NamedArray,
    prompt: Sequence[int] | None = None,
    *,
    max_new_tokens: int = 128,
) -> np.ndarray:
    """Greedy decoding with the key/value cache (what ``transformers`` ``generate`` does with ``do_sample=False``).

    Args:
        model: the model.
        features: ``(batch, mel, frame)`` log-mel features.
        prompt: the decoder prompt (default: ``[decoder_start_token_id]``); e.g. ``<|startoftranscript|><|en|>
            <|transcribe|><|notimestamps|>``.
        max_new_tokens: the most tokens generated after the prompt.

    Returns:
        int32 ``[batch, len(prompt) + generated]``: the prompt, then the tokens, rows that ended early padded with
        ``pad_token_id`` after their ``<|endoftext|>``.
    """
    cfg = model.config
    prompt = [cfg.decoder_start_token_id] if prompt is None else [int(t) for t in prompt]
    Batch = features.resolve_axis("batch")
    total = len(prompt) + max_new_tokens
    if total > cfg.max_target_positions:
        raise ValueError(
            f"Whisper: prompt ({len(prompt)}) + max_new_tokens ({max_new_tokens}) exceeds max_target_positions "
            f"({cfg.max_target_positions})"
        )
    state, logits = _prefill(
        model,
        features,
        hax.named(jnp.tile(jnp.asarray(prompt, jnp.int32), (Batch.size, 1)), ("batch", "position")),
        total,
    )
    out = np.tile(np.asarray(prompt, np.int32), (Batch.size, 1))
    done = np.zeros(Batch.size, dtype=bool)
    generated: list[np.ndarray] = []
    for i in range(max_new_tokens):
        token = np.asarray(_pick(logits, cfg, first=i == 0))
        token = np.where(done, cfg.pad_token_id, token)
        generated.append(token)
        done |= token == cfg.eos_token_id
        if done.all() or i == max_new_tokens - 1:
            break
        logits, state = _step(model, hax.named(jnp.asarray(token[:, None], jnp.int32), ("batch", "position")), state)
    return np.concatenate([out, np.stack(generated, axis=1)], axis=1) if generated else out


@eqx.filter_jit
def _prefill(
    model: WhisperModel, features: NamedArray, prompt: NamedArray, max_len: int
) -> tuple[WhisperDecodeState, jax.Array]:
    state = model.init_decode_state(model.encode(features), max_len)
    logits, state = model.decode_step(prompt, state)
    return state, logits["position", -1].array


@eqx.filter_jit
def _step(model: WhisperModel, tokens: NamedArray, state: WhisperDecodeState) -> tuple[jax.Array, WhisperDecodeState]:
    logits, state = model.decode_step(tokens, state)
    return logits["position", -1].array, state


def _pick(logits: jax.Array, cfg: WhisperConfig, *, first: bool) -> jax.Array:
    """The greedy token of ``[batch, vocab]`` logits after Whisper's token suppression."""
    banned = list(cfg.suppress_tokens) + (list(cfg.begin_suppress_tokens) if first else [])
    if banned:
        logits = logits.at[:, jnp.asarray(banned)].set(-jnp.inf)
    return jnp.argmax(logits, axis=-1)
