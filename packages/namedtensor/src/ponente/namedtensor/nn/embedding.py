"""``Embedding``: a lookup table from a vocabulary axis to embedding axes, and its transpose (``unembed``)."""

from __future__ import annotations

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp

from .. import random as hrandom
from ..axis import Axis, AxisSpec, axis_name
from ..core import NamedArray
from ..dot import dot
from ..jax_utils import named_call
from ..partitioning import auto_sharded
from ..util import ensure_tuple
from .mup import AbstractEmbeddingReparam, EmbeddingStandardParam, ReparamEnabled

__all__ = ["Embedding"]


class Embedding(eqx.Module, ReparamEnabled):
    """A table of ``Vocab`` vectors over the ``Embed`` axes.

    The parameterization (:mod:`ponente.namedtensor.nn.mup`) sets the initial scale and constants that
    the looked-up vectors (``active_scale``) and the tied-output logits (``unembed_active_scale``) are
    multiplied by.

    Attributes:
        weight: the table, axes ``(Vocab, *Embed)``.
        Vocab: the vocabulary axis (static).
        Embed: the embedding axis or axes (static).
        _reparam_cls: the parameterization class (static; default
            :class:`~ponente.namedtensor.nn.mup.EmbeddingStandardParam`).

    Example:
        >>> import jax, jax.numpy as jnp
        >>> import ponente.namedtensor as hax
        >>> Vocab, Embed = hax.make_axes(vocab=10, embed=4)
        >>> emb = Embedding.init(Vocab, Embed, key=jax.random.key(0))
        >>> ids = hax.named(jnp.array([1, 2, 3]), "pos")
        >>> emb.embed(ids).shape, emb.unembed(emb.embed(ids)).shape
        ({'pos': 3, 'embed': 4}, {'pos': 3, 'vocab': 10})
    """

    weight: NamedArray
    Vocab: Axis = eqx.field(static=True)
    Embed: AxisSpec = eqx.field(static=True)
    _reparam_cls: type[AbstractEmbeddingReparam] = eqx.field(static=True, default=EmbeddingStandardParam)

    @property
    def reparam(self) -> AbstractEmbeddingReparam:
        """The parameterization for this table's axes."""
        return self._reparam_cls(self.Embed, self.Vocab)

    @staticmethod
    def init(
        Vocab: Axis,
        Embed: AxisSpec,
        *,
        init_scale: float = 1.0,
        key: jax.Array,
        initializer_range: float | None = None,
        reparam_cls: type[AbstractEmbeddingReparam] = EmbeddingStandardParam,
    ) -> Embedding:
        """Creates a table drawn from a truncated normal (±3σ) with σ = ``init_scale * reparam_cls.init_scale``.

        With the standard parameterization σ is ``init_scale / axis_size(Embed)``, as in Haliax.

        Args:
            Vocab: the vocabulary axis.
            Embed: the embedding axis or axes.
            init_scale: multiplies the parameterization's standard deviation.
            key: the PRNG key.
            initializer_range: if given, the standard deviation itself (overrides ``init_scale`` and the
                parameterization's scale).
            reparam_cls: the parameterization, e.g. :class:`~ponente.namedtensor.nn.mup.EmbeddingMup`.

        Returns:
            The embedding.
        """
        embed_axes = tuple(ensure_tuple(Embed))
        if initializer_range is not None:
            std = initializer_range
        else:
            std = init_scale * reparam_cls.init_scale(Vocab, Embed)
        weight = hrandom.truncated_normal(key, (Vocab, *embed_axes), -3.0, 3.0) * std
        return Embedding(weight, Vocab, Embed, _reparam_cls=reparam_cls)

    def __call__(self, input_ids: NamedArray, *, key: jax.Array | None = None) -> NamedArray:
        """Same as :meth:`embed` (``key`` is unused)."""
        del key
        return self.embed(input_ids)

    @named_call
    def embed(self, input_ids: NamedArray) -> NamedArray:
        """Looks up the vectors of integer ids.

        Args:
            input_ids: integer ids in ``[0, Vocab.size)``, any axes.

        Returns:
            ``input_ids``' axes followed by the ``Embed`` axes.

        Raises:
            ValueError: if the ids carry the ``Vocab`` axis or are not integers.
        """
        if not jnp.issubdtype(input_ids.dtype, jnp.integer):
            raise ValueError(f"Embedding.embed: ids must be integers, got dtype {input_ids.dtype}")
        if input_ids.has_axis(self.Vocab.name):
            raise ValueError(f"Embedding.embed: the ids must not have the vocabulary axis {self.Vocab.name!r}")
        rows = NamedArray(jnp.take(self.weight.array, input_ids.array, axis=0), input_ids.axes + self.weight.axes[1:])
        scale = self.reparam.active_scale
        return auto_sharded(rows if scale == 1 else rows * scale)

    @named_call
    def unembed(self, input_embeds: NamedArray) -> NamedArray:
        """Scores embeddings against every vocabulary vector (the transposed embedding, tied output logits).

        Args:
            input_embeds: arrays with the ``Embed`` axes.

        Returns:
            The other axes of ``input_embeds`` followed by ``Vocab``, times ``reparam.unembed_active_scale``.
        """
        logits = dot(input_embeds, self.weight, axis=axis_name(self.Embed))
        scale = self.reparam.unembed_active_scale
        return auto_sharded(logits if scale == 1 else logits * scale)

    def resize_embeddings(self, new_size: int, key: jax.Array | None = None) -> Embedding:
        """A copy with ``new_size`` rows: truncated, or extended with rows drawn around the mean row.

        Args:
            new_size: the new vocabulary size.
            key: needed when growing: the PRNG key for the new rows.

        Returns:
            The resized embedding (the ``Vocab`` axis has the new size).

        Raises:
            ValueError: if growing without a key.
        """
        old = self.Vocab.size
        NewVocab = self.Vocab.resize(new_size)
        if new_size <= old:
            small = NamedArray(self.weight.array[:new_size], (NewVocab, *self.weight.axes[1:]))
            return dataclasses.replace(self, weight=small, Vocab=NewVocab)
        if key is None:
            raise ValueError("Embedding.resize_embeddings: growing the vocabulary needs a key for the new rows")
        w = self.weight.array
        mean = jnp.mean(w, axis=0, keepdims=True)
        std = jnp.std(w, axis=0, keepdims=True)
        extra = mean + std * jax.random.normal(key, (new_size - old, *w.shape[1:]), w.dtype)
        new = jnp.concatenate([w, extra], axis=0)
        return dataclasses.replace(self, weight=NamedArray(new, (NewVocab, *self.weight.axes[1:])), Vocab=NewVocab)
