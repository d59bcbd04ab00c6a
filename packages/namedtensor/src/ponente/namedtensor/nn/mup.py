"""Parameterizations of ``Linear`` and ``Embedding``: standard, and μP (maximal update parameterization).

A parameterization (the "abc" of Yang & Hu, https://arxiv.org/abs/2011.14522) says, as a function of the
layer's widths, three multipliers:

- ``init_scale(In, Out)``: the standard deviation of the initial weights (before the layer's ``init_scale``);
- ``active_scale``: a constant the weight is multiplied by in the forward pass;
- ``lr_scale``: how much to scale the learning rate of the weight (the optimizer applies it).

Layers take the class as ``reparam_cls`` (``Linear.init(In, Out, key=k, reparam_cls=HiddenLinearMup)``) and
expose the instance for their axes as ``layer.reparam``. Under μP, a network's best learning rate and its
training dynamics stay (roughly) the same as its hidden width grows:

| class                    | initial std      | forward multiplier            | learning-rate multiplier |
|--------------------------|------------------|-------------------------------|--------------------------|
| `LinearStandardParam`    | 1 / sqrt(fan_in) | 1                             | 1                        |
| `InputLinearMup`         | 1                | 1                             | 1                        |
| `HiddenLinearMup`        | 1 / sqrt(fan_in) | 1                             | 1 / fan_in               |
| `OutputLinearMup`        | 1                | 1 / fan_in                    | 1                        |
| `EmbeddingStandardParam` | 1 / embed        | 1 (unembed: 1)                | 1                        |
| `EmbeddingMup`           | 1                | 1 (unembed: 1 / embed)        | 1                        |

(``fan_in`` is the total size of the input axes; ``embed`` the total size of the embedding axes.)

Example:
    ```python
    import jax
    import ponente.namedtensor as hax
    from ponente.namedtensor.nn import Linear
    from ponente.namedtensor.nn.mup import HiddenLinearMup

    Hidden, Hidden2 = hax.make_axes(hidden=64, hidden2=64)
    layer = Linear.init(Hidden, Hidden2, key=jax.random.key(0), reparam_cls=HiddenLinearMup)
    assert layer.reparam.lr_scale == 1 / 64  # multiply this layer's learning rate by it
    ```
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass

from ..axis import AxisSpec, axis_size

__all__ = [
    "AbstractEmbeddingReparam",
    "AbstractLinearReparam",
    "AbstractReparam",
    "EmbeddingMup",
    "EmbeddingStandardParam",
    "HiddenLinearMup",
    "InputLinearMup",
    "LinearStandardParam",
    "OutputLinearMup",
    "ReparamEnabled",
]


class AbstractReparam(ABC):
    """A parameterization: initialization, forward and learning-rate multipliers as functions of the widths."""

    @staticmethod
    @abstractmethod
    def init_scale(In: AxisSpec, Out: AxisSpec) -> float:
        """The standard deviation of the initial weights of a layer from ``In`` to ``Out`` (times ``init_scale``)."""

    @property
    @abstractmethod
    def active_scale(self) -> float:
        """The constant the weight is multiplied by in the forward pass."""

    @property
    @abstractmethod
    def lr_scale(self) -> float:
        """The factor to multiply the weight's learning rate by."""


@dataclass
class AbstractLinearReparam(AbstractReparam):
    """A parameterization of a linear layer from the axes ``In`` to the axes ``Out``.

    Attributes:
        In: the input (contracted) axes.
        Out: the output axes.
    """

    In: AxisSpec
    Out: AxisSpec


class LinearStandardParam(AbstractLinearReparam):
    """The usual parameterization: initial std ``1/sqrt(fan_in)``, no forward or learning-rate multiplier.

    Example:
        >>> import ponente.namedtensor as hax
        >>> LinearStandardParam.init_scale(hax.Axis("in", 16), hax.Axis("out", 4))
        0.25
    """

    @staticmethod
    def init_scale(In: AxisSpec, Out: AxisSpec) -> float:
        """``1 / sqrt(fan_in)``."""
        return 1 / math.sqrt(axis_size(In))

    @property
    def active_scale(self) -> float:
        """1."""
        return 1

    @property
    def lr_scale(self) -> float:
        """1."""
        return 1


class InputLinearMup(AbstractLinearReparam):
    """μP for a layer whose input has a fixed width (the first layer): initial std 1, no multipliers.

    Example:
        >>> import ponente.namedtensor as hax
        >>> InputLinearMup.init_scale(hax.Axis("in", 3), hax.Axis("hidden", 512))
        1
    """

    @staticmethod
    def init_scale(In: AxisSpec, Out: AxisSpec) -> float:
        """1."""
        return 1

    @property
    def active_scale(self) -> float:
        """1."""
        return 1

    @property
    def lr_scale(self) -> float:
        """1."""
        return 1


class HiddenLinearMup(AbstractLinearReparam):
    """μP for a layer between two growing widths: initial std ``1/sqrt(fan_in)``, learning rate ``1/fan_in``.

    Example:
        >>> import ponente.namedtensor as hax
        >>> HiddenLinearMup(hax.Axis("hidden", 64), hax.Axis("hidden2", 64)).lr_scale
        0.015625
    """

    @staticmethod
    def init_scale(In: AxisSpec, Out: AxisSpec) -> float:
        """``1 / sqrt(fan_in)``."""
        return 1 / math.sqrt(axis_size(In))

    @property
    def active_scale(self) -> float:
        """1."""
        return 1

    @property
    def lr_scale(self) -> float:
        """``1 / fan_in``."""
        return 1 / axis_size(self.In)


class OutputLinearMup(AbstractLinearReparam):
    """μP for a layer whose output has a fixed width (the readout): initial std 1, forward multiplier ``1/fan_in``.

    The weight is stored unscaled; state dicts hold the effective weight (``weight * active_scale``).

    Example:
        >>> import ponente.namedtensor as hax
        >>> OutputLinearMup(hax.Axis("hidden", 64), hax.Axis("out", 1)).active_scale
        0.015625
    """

    @staticmethod
    def init_scale(In: AxisSpec, Out: AxisSpec) -> float:
        """1."""
        return 1

    @property
    def active_scale(self) -> float:
        """``1 / fan_in``."""
        return 1 / axis_size(self.In)

    @property
    def lr_scale(self) -> float:
        """1."""
        return 1


@dataclass
class AbstractEmbeddingReparam(AbstractReparam):
    """A parameterization of an embedding table, which is also used transposed (``unembed``).

    ``init_scale`` is called as ``init_scale(Vocab, Embed)``.

    Attributes:
        Embed: the embedding axes.
        Vocab: the vocabulary axis.
    """

    Embed: AxisSpec
    Vocab: AxisSpec

    @property
    @abstractmethod
    def unembed_active_scale(self) -> float:
        """The constant the logits of ``unembed`` are multiplied by."""


class EmbeddingStandardParam(AbstractEmbeddingReparam):
    """The usual embedding: initial std ``1/embed`` (Haliax's default), no multipliers.

    Example:
        >>> import ponente.namedtensor as hax
        >>> EmbeddingStandardParam.init_scale(hax.Axis("vocab", 100), hax.Axis("embed", 8))
        0.125
    """

    @staticmethod
    def init_scale(In: AxisSpec, Out: AxisSpec) -> float:
        """``1 / axis_size(Out)`` (``Out`` is the embedding axes)."""
        return 1 / axis_size(Out)

    @property
    def active_scale(self) -> float:
        """1."""
        return 1

    @property
    def lr_scale(self) -> float:
        """1."""
        return 1

    @property
    def unembed_active_scale(self) -> float:
        """1."""
        return 1


class EmbeddingMup(AbstractEmbeddingReparam):
    """μP for an embedding: initial std 1, and tied-output logits multiplied by ``1/embed``.

    See https://www.cerebras.ai/blog/the-practitioners-guide-to-the-maximal-update-parameterization.

    Example:
        >>> import ponente.namedtensor as hax
        >>> EmbeddingMup(hax.Axis("embed", 8), hax.Axis("vocab", 100)).unembed_active_scale
        0.125
    """

    @staticmethod
    def init_scale(In: AxisSpec, Out: AxisSpec) -> float:
        """1."""
        return 1

    @property
    def active_scale(self) -> float:
        """1."""
        return 1

    @property
    def lr_scale(self) -> float:
        """1."""
        return 1

    @property
    def unembed_active_scale(self) -> float:
        """``1 / axis_size(Embed)``."""
        return 1 / axis_size(self.Embed)


class ReparamEnabled(ABC):
    """A module with a parameterization, exposed as its ``reparam`` property (``Linear``, ``Embedding``)."""

    @property
    @abstractmethod
    def reparam(self) -> AbstractReparam:
        """The parameterization for this module's axes."""
