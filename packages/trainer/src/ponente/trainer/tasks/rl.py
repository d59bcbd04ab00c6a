"""The reinforcement-learning task (``ponente-rl``): GRPO, Dr. GRPO and RLOO with rollouts from the in-process engine.

A step of :class:`RlTask`:

1. the data loader hands the step its rows: ``train_batch_size`` completions, ``group_size`` per prompt, each row
   naming its prompt and its global row index (so its step and place in the batch): a pure function of the step;
2. :meth:`RlTask.make_batch` (called on the training thread, after the previous step's hooks ran) **rolls out**:
   the :class:`~ponente.trainer.inference.Engine` (built once, on the trainer's mesh and devices) samples every
   completion with a seed derived from ``(trainer.seed, step, prompt index, sample index)`` (:func:`rollout_seed`),
   so a resumed run draws the very same rollouts;
3. the reward function scores each ``(prompt, completion, example)`` on the host, :func:`group_advantages` turns
   the rewards into advantages;
4. the batch (prompt + completion tokens, the completion mask, the advantages, the engine's log-probs of the
   sampled tokens under ``logits / rl.temperature`` as the old policy's) goes through the normal compiled training
   step, whose loss is :func:`policy_loss`;
5. a hook logs the ``train/rl/*`` host metrics and, every ``rl.sync_every`` steps, swaps the trained weights into
   the engine (:meth:`~ponente.trainer.inference.Engine.update_weights`, nothing recompiles).

The engine is built from :attr:`RunContext.state` (the initial or restored state) when the run asks the task for
its hooks. With ``sync_every > 1`` the engine's weights lag the policy by up to ``sync_every - 1`` steps and the
clipped ratio against the engine's log-probs is the off-policy correction; a run resumed at a step that is not a
multiple of ``sync_every`` syncs at once (its rollouts then differ from an uninterrupted run's).

With ``kl_coef > 0`` the model trained is a :class:`~ponente.trainer.tasks.dpo.PolicyAndReference` whose
reference half (the initial model) is frozen; the KL term is the k3 estimator
``exp(ref - logp) - (ref - logp) - 1`` per completion token.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

import ponente.namedtensor as hax
from ponente.trainer.run import (
    RunContext,
    Task,
    export_hf,
    hf_model_config,
    hf_vocab_size,
    load_hf_weights,
    pad_vocab_for_partitioning,
    resolve_path,
)

from .dpo import PolicyAndReference

__all__ = [
    "RL_LOSSES",
    "RlConfig",
    "RlTask",
    "group_advantages",
    "policy_loss",
    "read_examples",
    "read_hf_examples",
    "rollout_seed",
    "token_logprobs",
]

logger = logging.getLogger(__name__)

RL_LOSSES = ("grpo", "dr_grpo", "rloo")
"""The objectives of ``rl.loss``."""

ADVANTAGE_EPS = 1e-4
"""Added to the group's standard deviation before GRPO divides by it (TRL's value)."""

AXES = ("batch", "position")


@dataclasses.dataclass(frozen=True)
class RlConfig:
    """Rollouts and the objective.

    Attributes:
        group_size: completions sampled per prompt (>= 2: the advantages compare them).
        max_new_tokens: the most tokens of a completion (also Dr. GRPO's constant normaliser).
        temperature: the sampling temperature (> 0); every log-prob of the loss is that of ``logits / temperature``.
        top_p: nucleus sampling (None: off).
        stop_tokens: tokens that end a completion (empty: the tokenizer's end-of-sequence token).
        stop_strings: strings that end a completion (the text is cut before them).
        loss: ``grpo``, ``dr_grpo`` or ``rloo``.
        clip_epsilon: the ratio clip.
        kl_coef: the weight of the k3 KL to the frozen initial model (0: no reference kept).
        sync_every: copy the trained weights into the engine every this many steps.
        rollout_batch_size: the most completions the engine runs together (None: the whole step).
    """

    group_size: int = 4
    max_new_tokens: int = 32
    temperature: float = 1.0
    top_p: float | None = None
    stop_tokens: list[str] = dataclasses.field(default_factory=list)
    stop_strings: list[str] = dataclasses.field(default_factory=list)
    loss: str = "grpo"
    clip_epsilon: float = 0.2
    kl_coef: float = 0.0
    sync_every: int = 1
    rollout_batch_size: int | None = None

    def __post_init__(self) -> None:
        if self.group_size < 2:
            raise ValueError(
                f"group_size: expected >= 2 (advantages compare a prompt's completions), got {self.group_size}"
            )
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens: expected >= 1, got {self.max_new_tokens}")
        if not self.temperature > 0:
            raise ValueError(f"temperature: expected > 0, got {self.temperature}")
        if self.loss not in RL_LOSSES:
            raise ValueError(f"loss: expected one of {', '.join(RL_LOSSES)}, got {self.loss!r}")
        if not self.clip_epsilon > 0:
            raise ValueError(f"clip_epsilon: expected > 0, got {self.clip_epsilon}")
        if self.kl_coef < 0:
            raise ValueError(f"kl_coef: expected >= 0, got {self.kl_coef}")
        if self.sync_every < 1:
            raise ValueError(f"sync_every: expected >= 1, got {self.sync_every}")


# -- the objective ----------------------------------------------------------------------------------------------
def group_advantages(rewards: np.ndarray, group_size: int, loss: str) -> np.ndarray:
    """The advantage of each completion from the rewards of its group (``group_size`` consecutive completions).

    - ``grpo``: ``(r - mean) / (std + 1e-4)`` (the group's sample standard deviation, ``ddof=1``, as TRL);
    - ``dr_grpo``: ``r - mean`` (Dr. GRPO drops the division by the standard deviation);
    - ``rloo``: ``r - mean of the other completions' rewards`` (the leave-one-out baseline).

    Example:
        >>> group_advantages(np.array([1.0, 0.0, 0.0, 1.0]), 2, "dr_grpo").tolist()
        [0.5, -0.5, -0.5, 0.5]
        >>> group_advantages(np.array([1.0, 0.0, 0.0, 0.0]), 4, "rloo").tolist()
        [1.0, -0.3333333333333333, -0.3333333333333333, -0.3333333333333333]
    """
    r = np.asarray(rewards, dtype=np.float64).reshape(-1, group_size)
    mean = r.mean(axis=1, keepdims=True)
    if loss == "grpo":
        adv = (r - mean) / (r.std(axis=1, ddof=1, keepdims=True) + ADVANTAGE_EPS)
    elif loss == "dr_grpo":
        adv = r - mean
    elif loss == "rloo":
        adv = r - (r.sum(axis=1, keepdims=True) - r) / (group_size - 1)
    else:
        raise ValueError(f"rl.loss: expected one of {', '.join(RL_LOSSES)}, got {loss!r}")
    return adv.reshape(-1)


def policy_loss(
    logp: Any,
    old_logp: Any,
    advantages: Any,
    mask: Any,
    *,
    loss: str,
    clip_epsilon: float,
    ref_logp: Any = None,
    kl_coef: float = 0.0,
    max_completion_length: int = 1,
) -> tuple[Any, dict[str, Any]]:
    """The clipped policy-gradient objective of a batch of completions, and the metrics ``train/rl/kl`` and
    ``train/rl/clip_fraction``.

    Arrays are ``[completions, positions]``, aligned on the predicted token (``mask`` is 1 where the position
    predicts a completion token); ``advantages`` is ``[completions]``. With ``r = exp(logp - old_logp)``:

    - ``grpo``: per token ``-min(r A, clip(r, 1-eps, 1+eps) A) + kl_coef k3``, averaged over each completion's
      tokens, then over the completions;
    - ``dr_grpo``: the same per-token terms summed over every token and divided by
      ``completions * max_completion_length``;
    - ``rloo``: the sequence-level ratio ``R = exp(sum logp - sum old_logp)``, ``-min(R A, clip(R) A)`` averaged
      over completions (+ ``kl_coef`` times the per-completion token mean of k3).

    ``k3 = exp(ref - logp) - (ref - logp) - 1`` (needs ``ref_logp``, which gets no gradient). ``train/rl/kl`` is the
    mean k3 over completion tokens (0 without a reference); ``train/rl/clip_fraction`` the fraction of completion
    tokens (sequences, for ``rloo``) whose ratio the clip holds (``r < 1-eps`` with ``A < 0``, or ``r > 1+eps`` with
    ``A > 0``).
    """
    import jax
    import jax.numpy as jnp

    logp = jnp.asarray(logp, jnp.float32)
    old_logp = jnp.asarray(old_logp, jnp.float32)
    mask = jnp.asarray(mask, jnp.float32)
    adv = jnp.asarray(advantages, jnp.float32)
    lo, hi = 1.0 - clip_epsilon, 1.0 + clip_epsilon
    tokens = jnp.maximum(mask.sum(axis=-1), 1.0)
    if ref_logp is not None:
        delta = jax.lax.stop_gradient(jnp.asarray(ref_logp, jnp.float32)) - logp
        k3 = (jnp.exp(delta) - delta - 1.0) * mask
        kl = k3.sum() / jnp.maximum(mask.sum(), 1.0)
    else:
        k3 = jnp.zeros_like(logp)
        kl = jnp.zeros((), jnp.float32)
    if loss in ("grpo", "dr_grpo"):
        ratio = jnp.exp((logp - old_logp) * mask)
        a = adv[:, None]
        per_token = -jnp.minimum(ratio * a, jnp.clip(ratio, lo, hi) * a) + kl_coef * k3
        if loss == "grpo":
            value = ((per_token * mask).sum(axis=-1) / tokens).mean()
        else:
            value = (per_token * mask).sum() / (mask.shape[0] * max_completion_length)
        clipped = ((ratio < lo) & (a < 0)) | ((ratio > hi) & (a > 0))
        clip_fraction = (clipped * mask).sum() / jnp.maximum(mask.sum(), 1.0)
    elif loss == "rloo":
        ratio = jnp.exp(((logp - old_logp) * mask).sum(axis=-1))
        per_sequence = -jnp.minimum(ratio * adv, jnp.clip(ratio, lo, hi) * adv)
        value = per_sequence.mean() + kl_coef * ((k3 * mask).sum(axis=-1) / tokens).mean()
        clip_fraction = (((ratio < lo) & (adv < 0)) | ((ratio > hi) & (adv > 0))).mean(dtype=jnp.float32)
    else:
        raise ValueError(f"rl.loss: expected one of {', '.join(RL_LOSSES)}, got {loss!r}")
    return value, {"train/rl/kl": kl, "train/rl/clip_fraction": clip_fraction}


def token_logprobs(
    model: Any, tokens: hax.NamedArray, mask: hax.NamedArray, *, key: Any, temperature: float = 1.0
) -> Any:
    """``[batch, position]`` log-probs of the next token at every position where ``mask`` (prediction-aligned)
    is 1 (0 elsewhere), float32, under the tempered distribution ``log_softmax(logits / temperature)``: the model's
    next-token cross-entropy (:func:`~ponente.models.loss.compute_next_token_loss`, whose ``temperature`` divides the
    float32 logits, or the final hidden states where the loss is blockwise and never materializes the logits)."""
    import jax.numpy as jnp

    from ponente.models import LmExample
    from ponente.models.loss import compute_next_token_loss

    example = LmExample.causal(tokens, loss_mask=mask)
    per_token = compute_next_token_loss(model, example, key=key, reduction="none", temperature=temperature)
    nll = per_token.rearrange(AXES).array.astype(jnp.float32)
    return -nll * mask.rearrange(AXES).array


def rollout_seed(seed: int, step: int, prompt_index: int, sample: int) -> int:
    """The engine seed of one completion: a 32-bit hash of ``(seed, step, prompt index, sample index)``.

    Example:
        >>> rollout_seed(0, 3, 1, 2) == rollout_seed(0, 3, 1, 2) != rollout_seed(0, 3, 1, 1)
        True
    """
    return int(np.random.SeedSequence([seed, step, prompt_index, sample]).generate_state(1)[0])


# -- the data ---------------------------------------------------------------------------------------------------
def read_examples(urls: Sequence[str], prompt_field: str = "prompt") -> list[dict[str, Any]]:
    """The rows of jsonl files (``.gz``/``.zst``/... by extension, local or fsspec URLs) that have ``prompt_field``.

    Raises:
        ValueError: naming ``data.train_urls``, for no rows, a line that is not JSON, or a row without the prompt.
    """
    import json

    import fsspec

    from ponente.trainer.config import ConfigError
    from ponente.trainer.data.cache_build import resolve_url

    rows: list[dict[str, Any]] = []
    for url in urls:
        for path in fsspec.open_files(resolve_url(url), mode="rt", compression="infer", encoding="utf-8"):
            with path as f:
                for number, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        row = json.loads(line)
                    except json.JSONDecodeError as exc:
                        raise ConfigError(f"data.train_urls: {url} line {number} is not JSON ({exc})") from exc
                    if not isinstance(row, dict) or prompt_field not in row:
                        raise ConfigError(f"data.train_urls: {url} line {number} has no {prompt_field!r} field")
                    rows.append(row)
    if not rows:
        raise ConfigError(f"data.train_urls: no rows in {list(urls)}")
    return rows


def read_hf_examples(
    path_or_id: str, split: str, name: str | None = None, prompt_field: str = "prompt"
) -> list[dict[str, Any]]:
    """The rows of a Hugging Face dataset (a ``save_to_disk`` folder, or a hub id when online), read through
    :class:`ponente.datacache.HFSource`.

    Raises:
        ValueError: one line naming the key: ``data.train_split`` for a split the dataset does not have,
            ``data.id`` for a dataset that does not load or has no rows, ``data.prompt_field`` for a missing column.
    """
    from ponente.datacache import BadInput, HFSource
    from ponente.trainer.config import ConfigError

    try:
        source = HFSource(path_or_id, split=split, name=name)
    except ValueError as exc:
        raise ConfigError(f"data.train_split: {_first_line(exc)}") from exc
    except OSError as exc:
        raise ConfigError(f"data.id: {_first_line(exc)}") from exc
    rows: list[dict[str, Any]] = []
    for shard in source.shard_names:
        for _, record, _ in source.open_shard(shard):
            if isinstance(record, BadInput):
                raise ConfigError(f"data.id: {record.location}: {record.detail}")
            rows.append(record)
    if not rows:
        raise ConfigError(f"data.id: no rows in split {split!r} of {path_or_id!r}")
    if prompt_field not in rows[0]:
        raise ConfigError(
            f"data.prompt_field: dataset {path_or_id!r} has no column {prompt_field!r} (columns: {', '.join(rows[0])})"
        )
    return rows


def _first_line(exc: BaseException) -> str:
    return (str(exc).splitlines() or [type(exc).__name__])[0]


def _map_answer_field(rows: list[dict[str, Any]], answer_field: str, where: str) -> list[dict[str, Any]]:
    """The rows with ``answer`` taken from ``answer_field`` (rows unchanged when it is ``"answer"``; then the answer
    stays optional).

    Raises:
        ValueError: naming ``data.answer_field``, for a row without that field.
    """
    if answer_field == "answer":
        return rows
    from ponente.trainer.config import ConfigError

    for number, row in enumerate(rows):
        if answer_field not in row:
            raise ConfigError(f"data.answer_field: row {number} of {where} has no {answer_field!r} field")
    return [{**row, "answer": row[answer_field]} for row in rows]


class RolloutRows:
    """The loader's dataset: row ``j`` names a prompt and its own index (unbounded; a pure function of ``j``).

    Row ``j`` is completion ``j % group_size`` of prompt slot ``j // group_size``; slots walk the prompts in a fresh
    permutation each epoch (seeded by ``seed`` and the epoch).
    """

    def __init__(self, num_prompts: int, group_size: int, seed: int) -> None:
        self.num_prompts = num_prompts
        self.group_size = group_size
        self.seed = seed
        self._orders: dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        return 2**62

    def wait_for_length(self, length: int | None, timeout: float | None = None) -> bool:
        return True

    def prompt_of(self, index: int) -> int:
        slot = index // self.group_size
        epoch, within = divmod(slot, self.num_prompts)
        order = self._orders.get(epoch)
        if order is None:
            order = np.random.default_rng([self.seed, epoch]).permutation(self.num_prompts)
            self._orders[epoch] = order
        return int(order[within])

    def get_batch(self, indices: Sequence[int]) -> list[dict[str, np.ndarray]]:
        return [
            {"row_index": np.asarray(int(j), np.int64), "prompt_index": np.asarray(self.prompt_of(int(j)), np.int64)}
            for j in indices
        ]


# -- the task ---------------------------------------------------------------------------------------------------
class RlTask(Task):
    """Train a language model with rewards on its own samples (a ``TrainRlConfig``; see the module docstring).

    Call :func:`~ponente.trainer.run.start_run` first: the vocabulary is padded for the devices' mesh.

    Args:
        config: the configuration (``initialize_from_hf``, ``data``, ``reward``, ``rl``, ``trainer``, ...).
        reward: the reward callable (``reward.function`` loaded by
            :func:`~ponente.trainer.rewards.load_reward`).
    """

    def __init__(self, config: Any, reward: Any) -> None:
        import jax

        from ponente.trainer.config import ConfigError

        if not config.initialize_from_hf:
            raise ConfigError(
                "initialize_from_hf: RL starts from a trained model; set a Hugging Face folder or hub id"
            )
        self.rl = config.rl
        batch = config.trainer.train_batch_size
        if batch % self.rl.group_size:
            raise ConfigError(
                f"trainer.train_batch_size: {batch} completions per step is not a multiple of rl.group_size "
                f"({self.rl.group_size})"
            )
        self.reward = reward
        self.initialize_from_hf: str = config.initialize_from_hf
        self.allow_pickle: bool = config.allow_pickle
        model_config = hf_model_config(config.initialize_from_hf)
        self.model_config = pad_vocab_for_partitioning(model_config, config.trainer, jax.device_count())
        self.config = dataclasses.replace(config, model=self.model_config)
        self.Vocab = hax.Axis("vocab", hf_vocab_size(config.initialize_from_hf))
        self.seq_len: int = self.model_config.seq_len
        self.hf_save_path: str | None = config.hf_save_path
        self.export_every = config.hf_save_steps
        self.paired = self.rl.kl_coef > 0
        self.seed: int = config.trainer.seed
        self.engine: Any = None
        self.last_rollout: dict[str, float] = {}
        self._load_data(config)

    def _load_data(self, config: Any) -> None:
        from ponente.datacache import load_tokenizer

        data = config.data
        self.tokenizer = load_tokenizer(data.tokenizer or self.initialize_from_hf)
        if data.id is not None:
            examples = read_hf_examples(data.id, data.train_split, data.name, data.prompt_field)
            where, key = repr(data.id), "data.id"
        else:
            examples = read_examples(data.train_urls, data.prompt_field)
            where, key = str(list(data.train_urls)), "data.train_urls"
        self.examples = _map_answer_field(examples, data.answer_field, where)
        self.prompt_texts = [self._render(row[data.prompt_field]) for row in self.examples]
        self.prompt_ids = [list(self.tokenizer.encode(text).ids) for text in self.prompt_texts]
        longest = max(len(ids) for ids in self.prompt_ids)
        if longest >= self.seq_len:
            from ponente.trainer.config import ConfigError

            raise ConfigError(f"{key}: a prompt has {longest} tokens; the model's seq_len is {self.seq_len}")
        stop_ids = [self.tokenizer.token_to_id(t) for t in self.rl.stop_tokens]
        if not self.rl.stop_tokens:
            from ponente.trainer.data.templates import tokenizer_chat_defaults

            eos = tokenizer_chat_defaults(data.tokenizer or self.initialize_from_hf).eos_token
            stop_ids = [self.tokenizer.token_to_id(eos)] if eos else []
        self.stop_token_ids = tuple(int(i) for i in stop_ids if i is not None)

    def _render(self, prompt: Any) -> str:
        """A text prompt as is; a list of chat messages rendered by the chat template (with the generation
        prompt)."""
        if isinstance(prompt, str):
            return prompt
        if not getattr(self, "_template", None):
            import jinja2.sandbox

            from ponente.trainer.data.templates import read_template, tokenizer_chat_defaults

            source = self.config.data.tokenizer or self.initialize_from_hf
            defaults = tokenizer_chat_defaults(source)
            text = read_template(self.config.data.chat_template, "data.chat_template") or defaults.chat_template
            if text is None:
                from ponente.trainer.config import ConfigError

                raise ConfigError("data.chat_template: chat prompts need a template; the tokenizer has none")
            env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            self._template = (env.from_string(text), defaults)
        template, defaults = self._template
        return str(
            template.render(
                messages=list(prompt),
                add_generation_prompt=True,
                bos_token=defaults.bos_token or "",
                eos_token=defaults.eos_token or "",
            )
        )

    # -- the model ------------------------------------------------------------------------------------------------
    def build_model(self, key: Any) -> Any:
        """A freshly initialized model (paired with a frozen reference when ``rl.kl_coef > 0``)."""
        model = self.model_config.build(self.Vocab, key=key)
        return PolicyAndReference(model, model) if self.paired else model

    def pretrained_model(self, mp: Any) -> Any | None:
        """The weights of ``initialize_from_hf`` (twice, policy and reference, when ``rl.kl_coef > 0``)."""
        model = load_hf_weights(self.initialize_from_hf, self.model_config, mp, allow_pickle=self.allow_pickle)
        return PolicyAndReference(model, model) if self.paired else model

    def trainable(self) -> Any:
        """The policy; never the reference."""
        if not self.paired:
            return True
        import equinox as eqx
        import jax

        shapes = eqx.filter_eval_shape(self.build_model, jax.random.PRNGKey(0))
        return PolicyAndReference(
            jax.tree_util.tree_map(lambda _: True, shapes.policy),
            jax.tree_util.tree_map(lambda _: False, shapes.reference),
        )

    def policy(self, model: Any) -> Any:
        """The policy of the trained model (what the engine samples from and what is exported)."""
        return model.policy if isinstance(model, PolicyAndReference) else model

    def flops_per_token(self) -> float | None:
        """The policy's forward FLOPs per token."""
        return float(self.model_config.flops_per_token(self.Vocab.size))

    # -- batches and the loss -----------------------------------------------------------------------------------
    def datasets(self, seed: int, batch_size: int) -> tuple[Any, dict[str, Any]]:
        """The rollout rows (:class:`RolloutRows`); no validation sets."""
        return RolloutRows(len(self.examples), self.rl.group_size, seed), {}

    def placeholder_rows(self, count: int) -> dict[str, np.ndarray]:
        """Rows that make the zero batch the step compiles with (no rollout)."""
        return {"row_index": np.full((count,), -1, np.int64), "prompt_index": np.zeros((count,), np.int64)}

    def make_batch(self, rows: Mapping[str, np.ndarray]) -> Any:
        """Roll out the rows' completions with the engine and score them (see the module docstring); the
        placeholder rows give a zero batch."""
        index = np.asarray(rows["row_index"], np.int64)
        n = len(index)
        if index[0] < 0:
            zeros = np.zeros((n, self.seq_len), np.float32)
            return self._named(np.zeros((n, self.seq_len), np.int32), zeros, zeros, np.zeros((n,), np.float32))
        if self.engine is None:
            raise RuntimeError("RlTask.make_batch: no engine yet (the run builds it in RlTask.hooks)")
        return self._rollout(index, np.asarray(rows["prompt_index"], np.int64))

    def _named(self, tokens: np.ndarray, mask: np.ndarray, old: np.ndarray, adv: np.ndarray) -> dict[str, Any]:
        n = tokens.shape[0]
        return {
            "input_ids": hax.named(tokens, AXES),
            "completion_mask": hax.named(mask, AXES),
            "old_logprobs": hax.named(old, AXES),
            "advantages": hax.named(adv, ("batch",)),
            "loss_mask": hax.named(np.ones((n,), np.float32), ("batch",)),
        }

    def _rollout(self, index: np.ndarray, prompts: np.ndarray) -> dict[str, Any]:
        from ponente.trainer.inference import GenerationConfig

        rl, n = self.rl, len(index)
        batch_size = self.config.trainer.train_batch_size
        configs = [
            GenerationConfig(
                max_new_tokens=rl.max_new_tokens,
                temperature=rl.temperature,
                top_p=rl.top_p,
                stop_token_ids=self.stop_token_ids,
                stop_strings=tuple(rl.stop_strings),
                seed=rollout_seed(self.seed, int(j) // batch_size, int(p), int(j) % rl.group_size),
                logprobs=True,
                tempered_logprobs=True,
            )
            for j, p in zip(index, prompts, strict=True)
        ]
        start = time.perf_counter()
        completions = self.engine.generate([self.prompt_ids[int(p)] for p in prompts], configs)
        seconds = time.perf_counter() - start
        tokens = np.zeros((n, self.seq_len), np.int32)
        mask = np.zeros((n, self.seq_len), np.float32)
        old = np.zeros((n, self.seq_len), np.float32)
        rewards = np.zeros((n,), np.float64)
        lengths = np.zeros((n,), np.float64)
        for r, (p, c) in enumerate(zip(prompts, completions, strict=True)):
            prompt, out = self.prompt_ids[int(p)], list(c.tokens)
            total = len(prompt) + len(out)
            tokens[r, :total] = prompt + out
            # position i predicts token i + 1: the completion's tokens are predicted from len(prompt) - 1 on
            mask[r, len(prompt) - 1 : total - 1] = 1.0
            old[r, len(prompt) - 1 : total - 1] = c.logprobs or []
            rewards[r] = float(self.reward(self.prompt_texts[int(p)], c.text, self.examples[int(p)]))
            lengths[r] = len(out)
        advantages = group_advantages(rewards, rl.group_size, rl.loss).astype(np.float32)
        self.last_rollout = {
            "train/rl/reward_mean": float(rewards.mean()),
            "train/rl/reward_std": float(rewards.std()),
            "train/rl/completion_length": float(lengths.mean()),
            "train/rl/rollout_seconds": seconds,
            "train/rl/rollout_tokens_per_second": float(lengths.sum() / max(seconds, 1e-9)),
        }
        return self._named(tokens, mask, old, advantages)

    def loss(self, model: Any, batch: Any, *, key: Any) -> Any:
        """The clipped objective of :func:`policy_loss` on the batch's completions (+ the k3 KL to the reference)."""
        import jax

        mask = batch["completion_mask"]
        temperature = self.rl.temperature
        logp = token_logprobs(self.policy(model), batch["input_ids"], mask, key=key, temperature=temperature)
        ref = None
        if self.paired:
            ref = token_logprobs(model.reference, batch["input_ids"], mask, key=None, temperature=temperature)
            ref = jax.lax.stop_gradient(ref)
        return policy_loss(
            logp,
            batch["old_logprobs"].rearrange(AXES).array,
            batch["advantages"].array,
            mask.rearrange(AXES).array,
            loss=self.rl.loss,
            clip_epsilon=self.rl.clip_epsilon,
            ref_logp=ref,
            kl_coef=self.rl.kl_coef,
            max_completion_length=self.rl.max_new_tokens,
        )

    # -- the engine and the hooks ---------------------------------------------------------------------------------
    def hooks(self, context: RunContext) -> list[Any]:
        """Build the engine from the run's current state (same mesh and devices as the trainer); the hook that logs
        the ``train/rl/*`` host metrics and syncs the weights every ``rl.sync_every`` steps."""
        from ponente.trainer.inference import Engine

        trainer = context.trainer
        if context.state is None:
            raise RuntimeError("RlTask.hooks: the run context has no state to build the engine from")

        def weights(model: Any) -> Any:
            # the engine's own copy: the training step donates the state's buffers (and may alias the cast model)
            import equinox as eqx
            import jax

            cast = context.eval_model(self.policy(model))
            return jax.tree_util.tree_map(lambda x: x.copy() if eqx.is_array(x) else x, cast)

        self.engine = Engine(
            weights(context.state.model),
            self.tokenizer,
            max_batch_size=self.rl.rollout_batch_size or trainer.config.train_batch_size,
            max_seq_len=self.seq_len,
            axis_mapping=trainer.compute_axis_mapping,
            mesh=trainer.mesh,
            parameter_axis_mapping=trainer.parameter_axis_mapping,
        )
        every = self.rl.sync_every

        def after_step(info: Any) -> None:
            if info.final:
                return
            metrics = dict(self.last_rollout)
            metrics["train/rl/train_seconds"] = float(info.step_seconds)
            context.tracker.log(metrics, step=info.step)
            if info.step % every == 0:
                self.engine.update_weights(weights(info.state.model))

        from ponente.trainer.callbacks import as_hook

        return [as_hook(after_step)]

    # -- exports --------------------------------------------------------------------------------------------------
    def export(self, model: Any, subfolder: str | None) -> dict[str, str]:
        """The policy as a Hugging Face folder at ``hf_save_path`` (``step-N`` under it during the run)."""
        if not self.hf_save_path:
            return {}
        where = resolve_path(self.hf_save_path if subfolder is None else f"{self.hf_save_path}/{subfolder}")
        path = export_hf(self.policy(model), where, tokenizer=self.tokenizer, seq_len=self.seq_len)
        return {"hugging face export": path}
