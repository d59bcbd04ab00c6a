"""Preference losses: the sequence log-probabilities of responses, and DPO, IPO, hinge and SimPO on them.

:func:`sequence_logprobs` sums a causal language model's log-probabilities over the scored tokens of each row
(the response of a prompt/response pair); :func:`preference_loss` turns those of a chosen and a rejected
response (under the policy and, except for SimPO, a frozen reference) into a loss and its metrics. The
definitions are those of TRL (``DPOTrainer`` for ``sigmoid``/``ipo``/``hinge``, ``CPOTrainer`` for ``simpo``):
with :math:`\\Delta = (\\log\\pi_c - \\log\\pi^{ref}_c) - (\\log\\pi_r - \\log\\pi^{ref}_r)`,

- ``sigmoid`` (DPO): :math:`-(1-\\epsilon)\\log\\sigma(\\beta\\Delta) - \\epsilon\\log\\sigma(-\\beta\\Delta)`
  (:math:`\\epsilon`: ``label_smoothing``, conservative DPO);
- ``ipo``: :math:`(\\Delta' - 1/(2\\beta))^2`, :math:`\\Delta'` the log-ratios divided by each response's length;
- ``hinge``: :math:`\\max(0, 1 - \\beta\\Delta)`;
- ``simpo`` (reference-free): with the length-normalised log-probs :math:`a = \\log\\pi / n` and
  :math:`z = a_c - a_r - \\gamma/\\beta`,
  :math:`-(1-\\epsilon)\\log\\sigma(\\beta z) - \\epsilon\\log\\sigma(-\\beta z)`.

Example:
    ```python
    import jax.numpy as jnp
    from ponente.models.loss import preference_loss

    loss, metrics = preference_loss(
        jnp.array([-3.0]),
        jnp.array([-5.0]),
        jnp.array([-4.0]),
        jnp.array([-4.0]),
        chosen_tokens=jnp.array([2.0]),
        rejected_tokens=jnp.array([3.0]),
        loss_type="sigmoid",
        beta=0.1,
    )
    float(loss)  # -log(sigmoid(0.1 * 2)) = 0.598...
    ```
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp

import ponente.namedtensor as hax
from ponente.namedtensor import NamedArray

from ..lm import LmExample
from .next_token import compute_next_token_loss

if TYPE_CHECKING:
    from ..lm import LmHeadModel

__all__ = [
    "PREFERENCE_LOSS_TYPES",
    "REFERENCE_FREE_LOSS_TYPES",
    "SMOOTHED_LOSS_TYPES",
    "preference_loss",
    "sequence_logprobs",
]

PREFERENCE_LOSS_TYPES = ("sigmoid", "ipo", "hinge", "simpo")
"""The values of ``loss_type``."""

REFERENCE_FREE_LOSS_TYPES = ("simpo",)
"""The loss types that do not read a reference model."""

SMOOTHED_LOSS_TYPES = ("sigmoid", "simpo")
"""The loss types ``label_smoothing`` applies to."""


def sequence_logprobs(
    model: LmHeadModel,
    tokens: NamedArray,
    loss_mask: NamedArray,
    *,
    key: jax.Array | None = None,
    block_size: int | str | None = "auto",
) -> NamedArray:
    """The log-probability of each row's scored tokens: :math:`\\sum_i m_{i+1} \\log p(t_{i+1} | t_{\\le i})`.

    One causal sequence per row (right padding is harmless: no token attends to a later one).

    Args:
        model: the language model.
        tokens: token ids over ``position`` (and batch axes).
        loss_mask: over the same axes, *target-aligned*: 1 where the token is scored (a response token), else 0.
        key: the model's PRNG key (dropout; None: deterministic).
        block_size: as for :func:`~ponente.models.loss.compute_next_token_loss` (``"auto"``: blockwise over the
            vocabulary for large vocabularies, so the full logits are never materialized).

    Returns:
        float32 log-probabilities over the batch axes (``position`` summed out).
    """
    Pos = tokens.resolve_axis("position")
    # position i predicts token i + 1: the mask of the prediction is the target mask shifted left by one (the
    # last position, which wraps around, predicts nothing: a causal example masks it)
    predicted = hax.roll(loss_mask.astype(jnp.float32), -1, Pos)
    example = LmExample.causal(tokens, loss_mask=predicted)
    per_token = compute_next_token_loss(model, example, key=key, reduction="none", block_size=block_size)
    return -hax.sum(per_token.astype(jnp.float32), Pos)


def _smoothed(z: jax.Array, beta: float, label_smoothing: float) -> jax.Array:
    """``-(1 - eps) log sigmoid(beta z) - eps log sigmoid(-beta z)``."""
    return -(1.0 - label_smoothing) * jax.nn.log_sigmoid(beta * z) - label_smoothing * jax.nn.log_sigmoid(-beta * z)


def preference_loss(
    policy_chosen: Any,
    policy_rejected: Any,
    reference_chosen: Any,
    reference_rejected: Any,
    *,
    chosen_tokens: Any,
    rejected_tokens: Any,
    loss_type: str = "sigmoid",
    beta: float = 0.1,
    label_smoothing: float = 0.0,
    simpo_gamma: float = 0.5,
    weights: Any = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The preference loss of a batch of pairs (see the module docstring) and Levanter's ``dpo_*`` metrics.

    Args:
        policy_chosen: the policy's sequence log-probs of the chosen responses, ``[pairs]`` (arrays or NamedArrays).
        policy_rejected: the same for the rejected responses.
        reference_chosen: the reference model's, ``[pairs]`` (ignored, may be None, for ``simpo``).
        reference_rejected: the same for the rejected responses.
        chosen_tokens: the number of scored tokens of each chosen response (``ipo`` and ``simpo`` divide by it).
        rejected_tokens: the same for the rejected responses.
        loss_type: ``sigmoid``, ``ipo``, ``hinge`` or ``simpo``.
        beta: the temperature :math:`\\beta` (> 0).
        label_smoothing: :math:`\\epsilon` of ``sigmoid`` and ``simpo`` (the probability a label is flipped).
        simpo_gamma: SimPO's target reward margin :math:`\\gamma`.
        weights: the weight of each pair (e.g. 0 for padding; None: all 1); the loss and metrics are weighted means.

    Returns:
        ``(loss, metrics)``: the weighted mean loss, and ``dpo_loss``, ``dpo_accuracy`` (pairs whose chosen
        reward exceeds the rejected one), ``dpo_margin_policy`` (mean :math:`\\log\\pi_c - \\log\\pi_r`),
        ``dpo_chosen_reward``, ``dpo_rejected_reward`` (:math:`\\beta(\\log\\pi - \\log\\pi^{ref})`; for SimPO
        :math:`\\beta a`), and, with a reference, ``dpo_margin_ref``.

    Raises:
        ValueError: for an unknown ``loss_type``.
    """
    if loss_type not in PREFERENCE_LOSS_TYPES:
        raise ValueError(f"loss_type: expected one of {', '.join(PREFERENCE_LOSS_TYPES)}, got {loss_type!r}")

    def raw(x: Any) -> jax.Array:
        return jnp.asarray(x.array if isinstance(x, NamedArray) else x, jnp.float32)

    pc, pr = raw(policy_chosen), raw(policy_rejected)
    nc, nr = jnp.maximum(raw(chosen_tokens), 1.0), jnp.maximum(raw(rejected_tokens), 1.0)
    metrics: dict[str, jax.Array] = {}
    if loss_type == "simpo":
        chosen_score, rejected_score = pc / nc, pr / nr
        losses = _smoothed(chosen_score - rejected_score - simpo_gamma / beta, beta, label_smoothing)
    else:
        rc, rr = raw(reference_chosen), raw(reference_rejected)
        chosen_score, rejected_score = pc - rc, pr - rr
        delta = chosen_score - rejected_score
        if loss_type == "sigmoid":
            losses = _smoothed(delta, beta, label_smoothing)
        elif loss_type == "hinge":
            losses = jax.nn.relu(1.0 - beta * delta)
        else:  # ipo: the log-ratios per token (TRL's normalisation)
            losses = (chosen_score / nc - rejected_score / nr - 1.0 / (2.0 * beta)) ** 2
        metrics["dpo_margin_ref"] = rc - rr
    w = jnp.ones_like(pc) if weights is None else raw(weights)
    total = jnp.maximum(jnp.sum(w), jnp.finfo(jnp.float32).tiny)

    def mean(x: jax.Array) -> jax.Array:
        return jnp.sum(w * x) / total

    chosen_reward = jax.lax.stop_gradient(beta * chosen_score)
    rejected_reward = jax.lax.stop_gradient(beta * rejected_score)
    loss = mean(losses)
    metrics.update(
        dpo_accuracy=(chosen_reward > rejected_reward).astype(jnp.float32),
        dpo_margin_policy=pc - pr,
        dpo_chosen_reward=chosen_reward,
        dpo_rejected_reward=rejected_reward,
    )
    out = {name: mean(jax.lax.stop_gradient(value)) for name, value in metrics.items()}
    out["dpo_loss"] = jax.lax.stop_gradient(loss)
    return loss, out
