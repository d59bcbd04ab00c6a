"""Train Whisper for speech recognition: ``python -m ponente.trainer.main.train_asr --config_path whisper_tiny_digits``
(``ponente-train-asr``; Levanter's ``train_asr``).

The configuration is a :class:`TrainAsrConfig` (``data``, ``model``, ``trainer``, ``optimizer`` sections) read from
YAML files and dotted overrides; ``--help`` lists every field. A run:

1. writes the synthetic set of ``synthetic_data`` if ``data.train_urls`` reads it and it is not there yet (the
   packaged example's spoken digits), then opens (or builds, in the background) the caches of ``data`` (the
   pipeline of every task, with ``data.format: asr``): log-mel features of each clip, padded or cut to
   ``data.format.chunk_seconds``, and its tokenised transcript after Whisper's prompt;
2. builds the Whisper model of ``model`` (or of ``initialize_from_hf``'s config, and its weights), or resumes;
3. trains with every trainer feature (mixed precision, sharding, checkpoints, bitwise resume, trackers), the loss
   being the next-token cross-entropy of the transcript given the audio; every ``trainer.steps_per_eval`` steps
   it logs ``eval/<name>/loss`` and the greedy word error rate ``eval/<name>/wer`` of the first
   ``wer.max_examples`` validation clips (their transcripts go to ``<run_dir>/transcripts/``);
4. saves a final checkpoint and, with ``hf_save_path``, a Hugging Face folder that
   ``transformers.WhisperForConditionalGeneration`` and ``WhisperProcessor`` load.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from ponente.models.whisper import WhisperConfig
from ponente.trainer import run
from ponente.trainer.data import AsrDatasetFormat, LMDatasetConfig
from ponente.trainer.data.synthetic_speech import SyntheticSpeechConfig, write_missing_synthetic_speech
from ponente.trainer.optim import AdamConfig, OptimizerConfig
from ponente.trainer.run import Run, TrainResult
from ponente.trainer.tasks.asr import AsrTask, WerConfig
from ponente.trainer.trainer import TrainerConfig

__all__ = ["TrainAsrConfig", "WerConfig", "main", "train"]


def speech_data() -> LMDatasetConfig:
    """The ``data`` defaults of a speech run: ``format: asr``, a full shuffle, Whisper's tokenizer."""
    return LMDatasetConfig(tokenizer="openai/whisper-tiny", shuffle=True, format=AsrDatasetFormat())


@dataclasses.dataclass(frozen=True)
class TrainAsrConfig:
    """Everything a speech-recognition training run reads (Levanter's ``TrainASRConfig`` keys).

    Attributes:
        data: the speech corpus, its Whisper tokenizer and cache; ``data.format`` (type ``asr``, the default here)
            holds the feature settings. The flat keys of older configs (``data.n_mels``, ...) are read into it.
        model: the Whisper config (Hugging Face's field names; e.g. ``d_model``, ``encoder_layers``, ...).
        trainer: batch size, steps, mixed precision, mesh, tracker, checkpointer, evaluation cadence.
        optimizer: ``optimizer.type``, learning rate, schedule.
        initialize_from_hf: a Hugging Face Whisper checkpoint folder or hub id (``openai/whisper-tiny``) whose
            weights start the run.
        use_hf_model_config: with ``initialize_from_hf``, take the model config from the checkpoint (None: yes when
            ``initialize_from_hf`` is set).
        allow_pickle: let ``initialize_from_hf`` load pickle weights (``pytorch_model.bin``) without safetensors.
        data_seed: seed of the data order (None: ``trainer.seed``).
        hf_save_path: if set, export the final model as a Hugging Face folder there.
        hf_save_steps: also export every this many steps (needs ``hf_save_path``).
        wer: the word error rate measured at each evaluation (``max_examples: 0``: none).
        synthetic_data: a synthetic spoken-digit set written into its ``out_dir`` before the run when
            ``data.train_urls`` reads from there and the set is incomplete (None: none).
    """

    data: LMDatasetConfig = dataclasses.field(default_factory=speech_data)
    model: WhisperConfig = dataclasses.field(default_factory=WhisperConfig)
    trainer: TrainerConfig = dataclasses.field(default_factory=TrainerConfig)
    optimizer: OptimizerConfig = dataclasses.field(default_factory=AdamConfig)
    initialize_from_hf: str | None = None
    use_hf_model_config: bool | None = None
    allow_pickle: bool = False
    data_seed: int | None = None
    hf_save_path: str | None = None
    hf_save_steps: int | None = None
    wer: WerConfig = dataclasses.field(default_factory=WerConfig)
    synthetic_data: SyntheticSpeechConfig | None = None

    def __post_init__(self) -> None:
        if self.hf_save_steps is not None and self.hf_save_path is None:
            raise ValueError("hf_save_steps is set but hf_save_path is not; set hf_save_path too")
        if self.use_hf_model_config and self.initialize_from_hf is None:
            raise ValueError("use_hf_model_config needs initialize_from_hf")


def train(config: TrainAsrConfig) -> TrainResult:
    """Run training as configured (see the module docstring).

    Args:
        config: the resolved configuration.

    Returns:
        What the run produced.

    Raises:
        ValueError: for a configuration that cannot run (no training data, no tokenizer, data that do not fit the
            model, a resume that changes a field that must stay fixed, ...), naming the key.
        FileNotFoundError: if ``trainer.load_checkpoint`` is true and there is no checkpoint.
    """
    write_missing_data(config)
    startup = run.start_run(config.trainer)
    return Run(AsrTask(config), startup).train()


def write_missing_data(config: TrainAsrConfig) -> None:
    """Write the ``synthetic_data`` set if ``data.train_urls`` reads it and it is not there yet (logged)."""
    if config.synthetic_data is not None:
        write_missing_synthetic_speech(config.synthetic_data, config.data.train_urls)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the entry point; returns the process exit code."""
    return run.command_line_main(train, TrainAsrConfig, argv, prog="ponente-train-asr", prepare=write_missing_data)


if __name__ == "__main__":
    raise SystemExit(main())
