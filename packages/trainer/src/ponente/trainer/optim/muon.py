"""Muon (``type: muon``): momentum, then Newton-Schulz orthogonalization of each matrix update (Jordan et al. 2024).

Matrices are the weights of ``ponente.namedtensor.nn.Linear`` layers, flattened to ``(Out, In)`` (multi-axis
``In``/``Out`` are merged; other axes, such as a stacked ``layers`` axis, are batched). Everything else
(embeddings, norms, biases, and by default the ``lm_head``) is trained by AdamW.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

from ponente.namedtensor import NamedArray
from ponente.namedtensor.axis import axis_name
from ponente.namedtensor.nn import Linear

from .config import OptimizerConfig, _check_regexes

__all__ = ["MuonConfig", "MuonState", "newton_schulz", "orthogonalize_linear_update", "scale_by_muon"]

_NS_COEFFS = (3.4445, -4.7750, 2.0315)  # the quintic of Jordan et al.: fast growth of small singular values


def newton_schulz(x: jax.Array, steps: int = 5, epsilon: float = 1e-7) -> jax.Array:
    """Approximately orthogonalizes the matrices ``x[..., rows, cols]`` (their ``U Vᵀ``, singular values ≈ 1).

    Runs ``steps`` iterations of the quintic ``X ← a X + (b A + c A²) X`` with ``A = X Xᵀ`` on ``x`` scaled to
    unit Frobenius norm, working on the wide orientation. The quintic trades exactness for speed: the
    singular values end up roughly in ``[0.7, 1.2]`` rather than exactly 1.

    Args:
        x: a matrix or a batch of matrices (leading axes are batched).
        steps: the number of iterations.
        epsilon: added to the norm before scaling.

    Returns:
        An array of the shape and dtype of ``x``.

    Example:
        >>> import jax
        >>> s = jax.numpy.linalg.svd(newton_schulz(jax.random.normal(jax.random.key(0), (4, 6))), compute_uv=False)
        >>> bool((s > 0.6).all() and (s < 1.3).all())
        True
    """
    a, b, c = _NS_COEFFS
    y = x.astype(jnp.float32)
    wide = y.shape[-2] <= y.shape[-1]
    if not wide:
        y = jnp.swapaxes(y, -1, -2)
    y = y / (jnp.linalg.norm(y, axis=(-2, -1), keepdims=True) + epsilon)
    for _ in range(steps):
        gram = y @ jnp.swapaxes(y, -1, -2)
        y = a * y + (b * gram + c * gram @ gram) @ y
    if not wide:
        y = jnp.swapaxes(y, -1, -2)
    return y.astype(x.dtype)


def _names(spec: Any) -> tuple[str, ...]:
    names = axis_name(spec)
    return (names,) if isinstance(names, str) else tuple(names)


def orthogonalize_linear_update(
    update: NamedArray, In: Any, Out: Any, *, steps: int = 5, epsilon: float = 1e-7, kimi_scaling: bool = False
) -> NamedArray:
    """Muon's direction for a ``Linear`` weight update: ``newton_schulz`` of the ``(Out, In)`` matrix, rescaled.

    The scale is ``sqrt(max(1, fan_out / fan_in))`` (Jordan et al.), or with ``kimi_scaling``
    ``0.2 * sqrt(max(fan_out, fan_in))`` (Moonshot's Kimi, matching AdamW's update RMS).

    Args:
        update: the update of the weight; axes ``In``, ``Out`` and any batch axes (e.g. ``layers``), any order.
        In: the layer's input axes.
        Out: the layer's output axes.
        steps: Newton-Schulz iterations.
        epsilon: Newton-Schulz's norm epsilon.
        kimi_scaling: use Kimi's scale instead of Jordan et al.'s.

    Returns:
        The direction, with the axes of ``update``.

    Raises:
        ValueError: if ``update`` lacks one of the ``In``/``Out`` axes (the message names it).
    """
    ins, outs = _names(In), _names(Out)
    for name in (*outs, *ins):
        if name not in update.axis_names:
            raise ValueError(f"muon: Linear update has axes {update.axis_names}, missing the layer axis {name!r}")
    batch = tuple(n for n in update.axis_names if n not in ins and n not in outs)
    order = (*batch, *outs, *ins)
    perm = [update.axis_names.index(n) for n in order]
    arr = jnp.transpose(update.array, perm)
    batch_shape = arr.shape[: len(batch)]
    fan_out = math.prod(update.axis_size(n) for n in outs)
    fan_in = math.prod(update.axis_size(n) for n in ins)
    ortho = newton_schulz(arr.reshape((*batch_shape, fan_out, fan_in)), steps, epsilon)
    scale = 0.2 * math.sqrt(max(fan_out, fan_in)) if kimi_scaling else math.sqrt(max(1.0, fan_out / fan_in))
    ortho = (ortho * scale).reshape(arr.shape)
    return NamedArray(jnp.transpose(ortho, [perm.index(i) for i in range(len(perm))]), update.axes)


class MuonState(NamedTuple):
    """State of :func:`scale_by_muon`.

    Attributes:
        momentum: the momentum buffer ``buf ← momentum * buf + g``.
    """

    momentum: Any


def _is_linear(x: Any) -> bool:
    return isinstance(x, Linear)


def scale_by_muon(
    *, momentum: float = 0.95, nesterov: bool = True, steps: int = 5, epsilon: float = 1e-7, kimi_scaling: bool = False
) -> optax.GradientTransformation:
    """Muon's direction for trees whose parameters are ``Linear`` weights (no learning rate, no weight decay).

    Per weight: ``buf ← momentum * buf + g``; ``d = g + momentum * buf`` (Nesterov) or ``buf``; the result is
    :func:`orthogonalize_linear_update` of ``d``. Leaves outside a ``Linear`` are an error; a ``Linear``'s bias
    must be masked out (e.g. by ``optax.multi_transform``, as :class:`MuonConfig` does).

    Args:
        momentum: the momentum coefficient.
        nesterov: use Nesterov momentum.
        steps: Newton-Schulz iterations.
        epsilon: Newton-Schulz's norm epsilon.
        kimi_scaling: Kimi's update scale (see :func:`orthogonalize_linear_update`).

    Returns:
        The transformation; its state is a :class:`MuonState`.

    Raises:
        ValueError: (at update) if a parameter is not the weight of a ``Linear``.
    """

    def init_fn(params: Any) -> MuonState:
        return MuonState(momentum=jax.tree.map(jnp.zeros_like, params))

    def update_fn(updates: Any, state: MuonState, params: Any = None) -> tuple[Any, MuonState]:
        buf = jax.tree.map(lambda b, g: momentum * b + g, state.momentum, updates)
        if nesterov:
            direction = jax.tree.map(lambda g, b: g + momentum * b, updates, buf)
        else:
            direction = buf

        def per_node(path: Any, node: Any) -> Any:
            if not isinstance(node, Linear):
                raise ValueError(
                    f"muon: the parameter at {jax.tree_util.keystr(path)} is not the weight of a Linear layer; "
                    "only Linear weights can be orthogonalized"
                )
            if not isinstance(node.weight, NamedArray) or not eqx.is_array(node.weight.array):
                return node  # masked out (trained by AdamW)
            ortho = orthogonalize_linear_update(
                node.weight, node.In, node.Out, steps=steps, epsilon=epsilon, kimi_scaling=kimi_scaling
            )
            return eqx.tree_at(lambda layer: layer.weight, node, ortho)

        return jax.tree_util.tree_map_with_path(per_node, direction, is_leaf=_is_linear), MuonState(buf)

    return optax.GradientTransformation(init_fn, update_fn)


def _muon_labels(params: Any, adamw_modules: Sequence[str]) -> Any:
    """Labels each parameter ``"muon"`` (weights of ``Linear`` layers whose path matches no ``adamw_modules``
    regex) or ``"adamw"`` (everything else), as a tree like ``params`` for ``optax.multi_transform``."""
    patterns = [re.compile(p) for p in adamw_modules]

    def label(path: Any, node: Any) -> Any:
        adamw = jax.tree.map(lambda _: "adamw", node)
        if not isinstance(node, Linear) or not isinstance(node.weight, NamedArray):
            return adamw
        dotted = ".".join(str(getattr(k, "name", getattr(k, "key", getattr(k, "idx", k)))) for k in path)
        if any(p.search(dotted) for p in patterns):
            return adamw
        return eqx.tree_at(lambda layer: layer.weight, adamw, "muon")

    return jax.tree_util.tree_map_with_path(label, params, is_leaf=_is_linear)


@OptimizerConfig.register_subclass("muon")
@dataclasses.dataclass(frozen=True)
class MuonConfig(OptimizerConfig):
    """Muon for ``Linear`` weights, AdamW for the rest, both on the same schedule shape.

    ``learning_rate`` (0.02) and ``weight_decay`` apply to the Muon part; ``adam_lr`` (peak) and
    ``adam_weight_decay`` (None: ``weight_decay``) to the AdamW part, whose moments use ``beta1``, ``beta2``,
    ``epsilon``. Both parts use the weight-decay mask.

    Attributes:
        adam_lr: the AdamW part's peak learning rate.
        adam_weight_decay: the AdamW part's weight decay (None: ``weight_decay``).
        momentum: Muon's momentum coefficient.
        nesterov: Nesterov momentum.
        backend_steps: Newton-Schulz iterations.
        muon_epsilon: Newton-Schulz's norm epsilon.
        use_kimi_scaling: scale by ``0.2 * sqrt(max(fan_out, fan_in))`` instead of ``sqrt(max(1, fan_out/fan_in))``.
        adamw_modules: regexes (``re.search``) over dotted paths of ``Linear`` layers trained by AdamW instead
            (default: the untied output head ``lm_head``).
    """

    learning_rate: float = 0.02
    weight_decay: float = 0.0
    adam_lr: float = 6e-4
    adam_weight_decay: float | None = None
    momentum: float = 0.95
    nesterov: bool = True
    backend_steps: int = 5
    muon_epsilon: float = 1e-7
    use_kimi_scaling: bool = False
    adamw_modules: tuple[str, ...] = ("lm_head",)

    def __post_init__(self) -> None:
        """Checks the shared fields and ``adamw_modules``.

        Raises:
            ValueError: naming the offending key.
        """
        super().__post_init__()
        _check_regexes("adamw_modules", self.adamw_modules)
        if self.backend_steps < 1:
            raise ValueError(f"optimizer.backend_steps (muon): must be >= 1, found {self.backend_steps}")

    def _schedules(self, num_train_steps: int) -> dict[str, optax.Schedule]:
        return {
            "learning_rate": self.lr_scheduler(num_train_steps),
            "adam_lr": dataclasses.replace(self, learning_rate=self.adam_lr).lr_scheduler(num_train_steps),
        }

    def _optimizer(self, learning_rate: Any, adam_lr: Any = None) -> optax.GradientTransformation:
        mask = self.build_weight_decay_mask()
        muon = optax.chain(
            scale_by_muon(
                momentum=self.momentum,
                nesterov=self.nesterov,
                steps=self.backend_steps,
                epsilon=self.muon_epsilon,
                kimi_scaling=self.use_kimi_scaling,
            ),
            optax.add_decayed_weights(self.weight_decay, mask),
            optax.scale_by_learning_rate(learning_rate),
        )
        adam_wd = self.weight_decay if self.adam_weight_decay is None else self.adam_weight_decay
        adamw = optax.adamw(adam_lr, b1=self.beta1, b2=self.beta2, eps=self.epsilon, weight_decay=adam_wd, mask=mask)
        modules = tuple(self.adamw_modules)
        return optax.multi_transform({"muon": muon, "adamw": adamw}, lambda params: _muon_labels(params, modules))
