"""Reinforcement learning: ``python -m ponente.trainer.main.train_rl --config_path rl_arithmetic`` (``ponente-rl``).

GRPO, Dr. GRPO or RLOO of a trained model (``initialize_from_hf``) against a reward function. A run:

1. loads ``reward.function`` (a packaged reward, or ``module:name`` importable from ``PYTHONPATH``) before any
   model loads: a path that does not import is one line naming ``reward.function``;
2. reads the prompts (jsonl or Hugging Face dataset rows with ``prompt``, optional ``answer`` and any other fields,
   all passed to the reward; chat prompts, lists of messages, are rendered by the chat template);
3. every step samples ``rl.group_size`` completions of ``trainer.train_batch_size / rl.group_size`` prompts with
   the in-process engine (same devices as training; seeds keyed by step, so a resumed run draws the same
   rollouts), scores them, computes group-normalised advantages and takes one step of the clipped objective
   (:mod:`ponente.trainer.tasks.rl`), syncing the engine's weights every ``rl.sync_every`` steps;
4. logs ``train/rl/reward_mean``, ``reward_std``, ``kl``, ``clip_fraction``, ``completion_length``,
   ``rollout_seconds``, ``train_seconds`` (and ``rollout_tokens_per_second``);
5. exports the policy to ``hf_save_path``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from ponente.models import LlamaConfig, LmConfig
from ponente.trainer import run
from ponente.trainer.optim import AdamConfig, OptimizerConfig
from ponente.trainer.rewards import load_reward
from ponente.trainer.tasks.rl import RlConfig, RlTask
from ponente.trainer.trainer import TrainerConfig

__all__ = ["RewardConfig", "RlConfig", "RlDataConfig", "TrainRlConfig", "main", "train"]


@dataclasses.dataclass(frozen=True)
class RlDataConfig:
    """The prompts: jsonl files (``train_urls``) or a Hugging Face dataset (``id``), not both.

    Attributes:
        train_urls: jsonl files (compressed by extension; local or fsspec URLs) of rows with ``prompt_field``.
        id: a Hugging Face dataset: a ``save_to_disk`` folder, or a hub id (read when online).
        name: the dataset's configuration name on the hub, if any.
        train_split: the split of ``id`` that is read.
        tokenizer: the tokenizer (a ``tokenizer.json``, its folder or a hub id; None: ``initialize_from_hf``'s).
        prompt_field: the field holding the prompt: a string, or a list of chat messages.
        answer_field: the field the reward reads as ``answer`` (``"answer"``: optional; another name: required).
        chat_template: the template of chat prompts (Jinja text, a file, or ``package://``; None: the
            tokenizer folder's).
    """

    train_urls: list[str] = dataclasses.field(default_factory=list)
    id: str | None = None
    name: str | None = None
    train_split: str = "train"
    tokenizer: str | None = None
    prompt_field: str = "prompt"
    answer_field: str = "answer"
    chat_template: str | None = None

    def __post_init__(self) -> None:
        if self.train_urls and self.id is not None:
            raise ValueError("train_urls and id are both set: read jsonl files or a Hugging Face dataset, not both")


@dataclasses.dataclass(frozen=True)
class RewardConfig:
    """The reward.

    Attributes:
        function: ``exact_match``, ``regex_match``, ``math_answer`` or ``"module:name"`` of a callable
            ``(prompt: str, completion: str, example: dict) -> float`` importable from ``PYTHONPATH``.
    """

    function: str = "exact_match"


@dataclasses.dataclass(frozen=True)
class TrainRlConfig:
    """Everything an RL run reads.

    Attributes:
        data: the prompts.
        model: the model config (read from ``initialize_from_hf``; recorded as trained).
        trainer: ``train_batch_size`` (completions per step, a multiple of ``rl.group_size``), steps, mesh,
            tracker, checkpointer, seed (also the rollouts' seed).
        optimizer: the optimizer.
        initialize_from_hf: the Hugging Face checkpoint (folder or hub id) the policy starts from.
        allow_pickle: let Hugging Face folders load pickle weights when they have no safetensors.
        reward: the reward function.
        rl: rollouts and the objective.
        hf_save_path: write the policy there as a Hugging Face folder (None: not written).
        hf_save_steps: also export every this many steps, to ``<path>/step-N``.
        data_seed: seed of the prompt order (None: ``trainer.seed``).
    """

    data: RlDataConfig = dataclasses.field(default_factory=RlDataConfig)
    model: LmConfig = dataclasses.field(default_factory=LlamaConfig)
    trainer: TrainerConfig = dataclasses.field(default_factory=TrainerConfig)
    optimizer: OptimizerConfig = dataclasses.field(default_factory=AdamConfig)
    initialize_from_hf: str | None = None
    allow_pickle: bool = False
    reward: RewardConfig = dataclasses.field(default_factory=RewardConfig)
    rl: RlConfig = dataclasses.field(default_factory=RlConfig)
    hf_save_path: str | None = None
    hf_save_steps: int | None = None
    data_seed: int | None = None


def train(config: TrainRlConfig) -> run.TrainResult:
    """Train with rewards as configured (see the module docstring).

    Raises:
        ValueError: naming the key: a reward that does not load, no ``initialize_from_hf``, no prompts, a batch
            size that is not a multiple of ``rl.group_size``.
    """
    from ponente.trainer.config import ConfigError

    reward = load_reward(config.reward.function)  # before any model loads
    if not config.initialize_from_hf:
        raise ConfigError("initialize_from_hf: RL starts from a trained model; set a Hugging Face folder or hub id")
    if not config.data.train_urls and config.data.id is None:
        raise ConfigError("data.train_urls: no prompts; name jsonl files of rows with a 'prompt' field, or data.id")
    startup = run.start_run(config.trainer)
    return run.Run(RlTask(config, reward), startup).train()


def _check_reward(config: TrainRlConfig) -> None:
    load_reward(config.reward.function)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the entry point; returns the process exit code."""
    return run.command_line_main(train, TrainRlConfig, argv, prog="ponente-rl", prepare=_check_reward)


if __name__ == "__main__":
    raise SystemExit(main())
