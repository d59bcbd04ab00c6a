"""The speech-recognition task (``train_asr``): a Whisper model on audio + transcript data.

:class:`AsrTask` says what a Whisper run trains: rows of log-mel features and decoder tokens
(:func:`whisper_batch`), the teacher-forced next-token loss over the transcript (:func:`whisper_loss`), and at each
evaluation the loss and the greedy word error rate on the validation sets (``eval/<name>/loss``,
``eval/<name>/wer``, :class:`SpeechEvaluator`); it exports a folder ``transformers`` loads (:func:`export_whisper`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from ponente.trainer.run import (
    Evaluator,
    RunContext,
    Task,
    TaskConfig,
    check_training_data,
    export_folder,
    resolve_path,
)

if TYPE_CHECKING:
    from ponente.models.whisper import WhisperConfig
    from ponente.trainer.data import AsrDatasetFormat, LMDatasetConfig
    from ponente.trainer.trainer import Trainer

__all__ = [
    "AsrTask",
    "SpeechEvaluator",
    "WerConfig",
    "check_speech_shapes",
    "export_whisper",
    "hf_whisper_config",
    "whisper_batch",
    "whisper_loss",
]

logger = logging.getLogger("ponente.trainer.run")


@dataclasses.dataclass(frozen=True)
class WerConfig:
    """The word error rate measured at each evaluation: greedy transcription of the first validation clips.

    Attributes:
        max_examples: transcribe at most this many clips of each validation set (0: no WER).
        max_new_tokens: the most tokens generated per clip after the prompt.
    """

    max_examples: int = 64
    max_new_tokens: int = 64

    def __post_init__(self) -> None:
        if self.max_examples < 0:
            raise ValueError(f"wer.max_examples: expected >= 0, got {self.max_examples}")
        if self.max_new_tokens < 1:
            raise ValueError(f"wer.max_new_tokens: expected >= 1, got {self.max_new_tokens}")


def hf_whisper_config(path: str, *, key: str = "initialize_from_hf") -> WhisperConfig:
    """The Whisper config of a Hugging Face checkpoint (its ``config.json``), without loading the weights.

    Raises:
        FileNotFoundError: if ``path`` is neither a checkpoint folder nor a cached or reachable hub id.
        ValueError: if ``config.json`` is not a Whisper config (naming ``key``).
    """
    from pathlib import Path

    from ponente.models.hf import resolve_checkpoint
    from ponente.models.whisper import WhisperConfig

    if Path(path).exists() and not (Path(path) / "config.json").is_file():
        raise FileNotFoundError(f"{key}: {path} has no config.json, so it is not a Hugging Face checkpoint")
    config_file = resolve_checkpoint(path, weights=False, key=key) / "config.json"
    hf_config = json.loads(config_file.read_text(encoding="utf-8"))
    if hf_config.get("model_type") != "whisper":
        raise ValueError(f"{key}: {config_file} has model_type {hf_config.get('model_type')!r}, expected 'whisper'")
    return WhisperConfig.from_hf_config(hf_config)


def check_speech_shapes(data: AsrDatasetFormat, vocab_size: int, model: WhisperConfig) -> None:
    """Fail early, naming the keys, when the data's rows do not fit the model.

    Args:
        data: the ``data.format`` of the speech corpus.
        vocab_size: the data's vocabulary size (`ponente.trainer.data.data_vocab_size`).
        model: the Whisper config.

    Raises:
        ValueError: mel bins, frames, label length or vocabulary that the model cannot take.
    """
    if data.n_mels != model.num_mel_bins:
        raise ValueError(f"data.format.n_mels ({data.n_mels}) differs from model.num_mel_bins ({model.num_mel_bins})")
    if data.frames > 2 * model.max_source_positions:
        raise ValueError(
            f"data.format.chunk_seconds: {data.chunk_seconds} s gives {data.frames} frames, more than the encoder "
            "takes "
            f"(2 * model.max_source_positions = {2 * model.max_source_positions})"
        )
    if data.max_label_tokens > model.max_target_positions:
        raise ValueError(
            f"data.format.max_label_tokens ({data.max_label_tokens}) exceeds model.max_target_positions "
            f"({model.max_target_positions})"
        )
    if vocab_size > model.vocab_size:
        raise ValueError(f"data.tokenizer has {vocab_size} tokens, more than model.vocab_size ({model.vocab_size})")


def whisper_batch(rows: Mapping[str, np.ndarray], n_mels: int, frames: int) -> dict[str, Any]:
    """Named Whisper batches of ``AsrExampleDataset`` rows, with a prediction-aligned loss mask.

    Position ``i`` of ``decoder_input_ids`` predicts token ``i + 1``; it counts when token ``i + 1`` is a real token
    (``loss_mask`` of the rows), so the loss covers the transcript and ``<|endoftext|>`` and never the padding.

    Args:
        rows: ``input_features`` float32 ``[batch, n_mels * frames]``, ``input_ids`` and ``loss_mask`` int
            ``[batch, tokens]``.
        n_mels: mel bins of the features.
        frames: frames of the features.

    Returns:
        ``{"decoder_input_ids": (batch, position), "input_features": (batch, mel, frame), "loss_mask": (batch,
        position) float32}`` as NamedArrays.

    Raises:
        ValueError: if the arrays do not have those shapes.
    """
    import ponente.namedtensor as hax

    ids = np.asarray(rows["input_ids"], dtype=np.int32)
    target = np.asarray(rows["loss_mask"], dtype=np.int32)
    features = np.asarray(rows["input_features"], dtype=np.float32)
    if ids.ndim != 2 or target.shape != ids.shape or features.shape != (ids.shape[0], n_mels * frames):
        raise ValueError(
            "whisper_batch: expected input_ids/loss_mask [batch, tokens] and input_features "
            f"[batch, {n_mels * frames}], got {ids.shape}, {target.shape}, {features.shape}"
        )
    mask = np.zeros(ids.shape, dtype=np.float32)
    mask[:, :-1] = target[:, 1:] != 0
    return {
        "decoder_input_ids": hax.named(ids, ("batch", "position")),
        "input_features": hax.named(features.reshape(-1, n_mels, frames), ("batch", "mel", "frame")),
        "loss_mask": hax.named(mask, ("batch", "position")),
    }


def whisper_loss(model: Any, batch: Mapping[str, Any], *, key: Any) -> Any:
    """The mean next-token cross-entropy over the batch's loss tokens (float32), teacher-forced on the transcript."""
    import jax
    import jax.numpy as jnp

    tokens = batch["decoder_input_ids"]
    logits = model(batch["input_features"].astype(model_dtype(model)), tokens, key=key)
    logits = logits.rearrange(("batch", "position", "vocab")).array.astype(jnp.float32)
    ids = tokens.rearrange(("batch", "position")).array
    targets = jnp.concatenate([ids[:, 1:], ids[:, -1:]], axis=1)
    log_probs = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0]
    mask = batch["loss_mask"].rearrange(("batch", "position")).array.astype(jnp.float32)
    return jnp.sum(nll * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def model_dtype(model: Any) -> Any:
    """The dtype of the model's token embedding (its compute dtype inside the step)."""
    return model.model.decoder.embed_tokens.weight.dtype


class SpeechEvaluator(Evaluator):
    """The loss on each validation set, and the greedy word error rate of its first clips.

    Returns ``{"<name>/loss": ..., "<name>/wer": ...}`` (logged as ``eval/<name>/...``). The transcripts of each
    evaluation are written to ``<run_dir>/transcripts/<name>-step-<N>.jsonl`` (``{"reference", "hypothesis"}``).

    Args:
        trainer: the trainer that evaluates.
        datasets: the validation sets by name (``AsrExampleDataset``).
        max_batches: evaluate the loss on at most this many batches of each set (None: all).
        data: the ``data.format`` (prompt, feature shape).
        tokenizer: the data's tokenizer (prompt ids, transcripts).
        wer: the WER settings.
        eval_model: ``eval_model(model)``: the model in the compute dtype.
        run_dir: where the transcripts go (None: not written).
    """

    def __init__(
        self,
        trainer: Trainer,
        datasets: Mapping[str, Any],
        max_batches: int | None,
        *,
        data: AsrDatasetFormat,
        tokenizer: Any,
        wer: WerConfig,
        eval_model: Callable[[Any], Any],
        run_dir: str | None,
    ) -> None:
        super().__init__(
            trainer, datasets, max_batches, make_batch=lambda rows: whisper_batch(rows, data.n_mels, data.frames)
        )
        self.data = data
        self.tokenizer = tokenizer
        self.wer = wer
        self.eval_model = eval_model
        self.run_dir = run_dir

    def __call__(self, state: Any) -> dict[str, float]:
        from ponente.trainer.wer import wer

        results = super().__call__(state)
        if self.wer.max_examples > 0:
            model = self.eval_model(state.model)
            for name, dataset in self.datasets.items():
                references, hypotheses = self.transcribe(model, dataset)
                results[f"{name}/wer"] = wer(references, hypotheses)
                self._write(name, int(state.step), references, hypotheses)
        self.last = results
        return results

    def transcribe(self, model: Any, dataset: Any) -> tuple[list[str], list[str]]:
        """``(references, hypotheses)`` of the first ``wer.max_examples`` clips of ``dataset`` (greedy decoding)."""
        import jax

        import ponente.namedtensor as hax
        from ponente.models.whisper import greedy_transcribe

        dataset.wait_for_length(None)
        count = min(self.wer.max_examples, len(dataset))
        chunk = max(1, min(count, self.batch_size))
        tokenizer = self.tokenizer
        prompt = self.data.prompt_ids(tokenizer)
        references: list[str] = []
        hypotheses: list[str] = []
        for start in range(0, count, chunk):
            indices = [start + k if start + k < count else k for k in range(chunk)]  # the last chunk: same shape
            rows = dataset.get_batch(indices)
            stacked = {
                key: np.stack([row[key] for row in rows]) for key in ("input_features", "input_ids", "loss_mask")
            }
            features = stacked["input_features"].reshape(chunk, self.data.n_mels, self.data.frames)
            named = hax.named(features.astype(model_dtype(model)), ("batch", "mel", "frame"))
            with jax.set_mesh(self.trainer.mesh):
                out = greedy_transcribe(model, named, prompt, max_new_tokens=self.wer.max_new_tokens)
            real = min(chunk, count - start)
            for k in range(real):
                labels = stacked["input_ids"][k][stacked["loss_mask"][k] != 0]
                references.append(_text(tokenizer, labels))
                hypotheses.append(_text(tokenizer, out[k, len(prompt) :]))
        return references, hypotheses

    def _write(self, name: str, step: int, references: list[str], hypotheses: list[str]) -> None:
        import jax

        if self.run_dir is None or jax.process_index() != 0 or "://" in self.run_dir:
            return
        folder = os.path.join(self.run_dir, "transcripts")
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, f"{name.replace('/', '_')}-step-{step}.jsonl"), "w", encoding="utf-8") as f:
            for reference, hypothesis in zip(references, hypotheses, strict=True):
                f.write(json.dumps({"reference": reference, "hypothesis": hypothesis}) + "\n")


def _text(tokenizer: Any, ids: np.ndarray) -> str:
    """The words of token ids: special tokens dropped, whitespace normalised."""
    return " ".join(tokenizer.decode([int(t) for t in ids], skip_special_tokens=True).split())


def export_whisper(model: Any, path: str, *, tokenizer: Any | None, data: AsrDatasetFormat | None = None) -> str:
    """Write a Whisper model as a folder ``transformers.WhisperForConditionalGeneration`` loads, with its tokenizer.

    Also writes ``preprocessor_config.json`` (the ``WhisperFeatureExtractor`` of ``data``'s mel bins and window), so
    ``WhisperProcessor.from_pretrained`` reads the folder. ``path`` may be an ``s3://``/``gs://`` URL (uploaded
    with ``config.json`` last).

    Args:
        model: the Whisper model.
        path: the output folder.
        tokenizer: a ``tokenizers.Tokenizer`` saved alongside (None: none).
        data: the ``data.format``, for the feature extractor's settings (None: no ``preprocessor_config.json``).

    Returns:
        ``path``.
    """
    return export_folder(path, lambda folder: _write_whisper(model, folder, tokenizer, data))


def _write_whisper(model: Any, folder: str, tokenizer: Any | None, data: AsrDatasetFormat | None) -> None:
    from ponente.models.hf import save_whisper_pretrained
    from ponente.trainer.hf_tokenizer import HfTokenizerFiles

    save_whisper_pretrained(model, folder)
    if tokenizer is not None:
        HfTokenizerFiles(tokenizer, model_max_length=model.config.max_target_positions).save_pretrained(folder)
    if data is not None:
        samples = round(data.chunk_seconds * 16000)
        chunk: int | float = data.chunk_seconds
        if float(chunk).is_integer():
            chunk = int(chunk)  # transformers derives n_samples from it and pads with it: it must be an integer
        else:
            logger.warning(
                "data.format.chunk_seconds=%s is not a whole number of seconds: transformers' WhisperFeatureExtractor "
                "cannot "
                "express it, so the exported preprocessor_config.json pads to %d samples only through n_samples",
                chunk,
                samples,
            )
        extractor = {
            "feature_extractor_type": "WhisperFeatureExtractor",
            "processor_class": "WhisperProcessor",
            "feature_size": data.n_mels,
            "sampling_rate": 16000,
            "hop_length": 160,
            "n_fft": 400,
            "chunk_length": chunk,
            "n_samples": samples,
            "nb_max_frames": data.frames,
            "padding_side": "right",
            "padding_value": 0.0,
            "return_attention_mask": False,
        }
        with open(os.path.join(folder, "preprocessor_config.json"), "w", encoding="utf-8") as f:
            json.dump(extractor, f, indent=2, sort_keys=True)


class AsrTask(Task):
    """Train a Whisper model for speech recognition (a ``TrainAsrConfig``: Levanter's ``train_asr`` keys).

    Args:
        config: the configuration (``data``: an ``LMDatasetConfig`` with ``format: asr``, ``model``: a
            ``WhisperConfig``, ``initialize_from_hf``, ``use_hf_model_config``, ``hf_save_path``, ``hf_save_steps``,
            ``wer``, ...); the task's :attr:`config` is it with ``model`` the model as trained (the checkpoint's
            config when ``initialize_from_hf`` is set, unless ``use_hf_model_config: false``).

    Raises:
        ValueError: if ``data`` names no training data, is not of ``format: asr``, or its rows do not fit the model
            (naming the keys).
    """

    def __init__(self, config: Any) -> None:
        from ponente.trainer.data import AsrDatasetFormat, LMDatasetConfig, data_tokenizer, data_vocab_size

        check_training_data(config.data, hint="the packaged example: --config_path whisper_tiny_digits")
        if not isinstance(config.data, LMDatasetConfig) or not isinstance(config.data.format, AsrDatasetFormat):
            raise ValueError(
                "data.format: speech recognition reads one corpus of format type 'asr' (data.format: {type: asr}), "
                f"got {type(getattr(config.data, 'format', config.data)).__name__}"
            )
        self.data: LMDatasetConfig = config.data
        self.speech: AsrDatasetFormat = config.data.format
        self.tokenizer = data_tokenizer(self.data)  # fails early, naming data.tokenizer
        model_config: WhisperConfig = config.model
        if config.initialize_from_hf and config.use_hf_model_config is not False:
            model_config = hf_whisper_config(config.initialize_from_hf)
        self.config: TaskConfig = dataclasses.replace(config, model=model_config)
        self.model_config = model_config
        check_speech_shapes(self.speech, data_vocab_size(self.data), model_config)
        self.initialize_from_hf: str | None = config.initialize_from_hf
        self.allow_pickle: bool = config.allow_pickle
        self.hf_save_path: str | None = config.hf_save_path
        self.export_every = config.hf_save_steps
        self.wer: WerConfig = config.wer

    def build_model(self, key: Any) -> Any:
        """A freshly initialized Whisper model."""
        return self.model_config.build(key=key)

    def pretrained_model(self, mp: Any) -> Any | None:
        """The weights of ``initialize_from_hf`` in ``mp``'s parameter dtype (None when not set)."""
        from ponente.models.hf import load_whisper_pretrained

        if not self.initialize_from_hf:
            return None
        model = load_whisper_pretrained(
            self.initialize_from_hf, allow_pickle=self.allow_pickle, config=self.model_config
        )
        return mp.cast_to_param(model)

    def loss(self, model: Any, batch: Any, *, key: Any) -> Any:
        """The transcript's next-token loss (:func:`whisper_loss`)."""
        return whisper_loss(model, batch, key=key)

    def make_batch(self, rows: Mapping[str, np.ndarray]) -> Any:
        """Rows of features and tokens to the named Whisper batch (:func:`whisper_batch`)."""
        return whisper_batch(rows, self.speech.n_mels, self.speech.frames)

    def placeholder_rows(self, count: int) -> dict[str, np.ndarray]:
        """Zeros in the layout of ``count`` rows of ``AsrExampleDataset``."""
        data = self.speech
        return {
            "input_features": np.zeros((count, data.n_mels * data.frames), dtype=np.float32),
            "input_ids": np.zeros((count, data.max_label_tokens), dtype=np.int32),
            "loss_mask": np.zeros((count, data.max_label_tokens), dtype=np.int32),
        }

    def datasets(self, seed: int, batch_size: int) -> tuple[Any, dict[str, Any]]:
        """The training clips of ``data`` and its validation sets (`ponente.trainer.data.build_datasets`)."""
        from ponente.trainer.data import build_datasets

        built = build_datasets(self.data, self.speech.max_label_tokens, seed=seed, batch_size=batch_size)
        return built.train, built.validation

    def evaluator(self, context: RunContext) -> Evaluator:
        """The loss and the greedy WER of each validation set (:class:`SpeechEvaluator`)."""
        trainer = context.trainer
        return SpeechEvaluator(
            trainer,
            context.validation,
            trainer.config.max_eval_batches,
            data=self.speech,
            tokenizer=self.tokenizer,
            wer=self.wer,
            eval_model=context.eval_model,
            run_dir=context.record.run_dir,
        )

    def export(self, model: Any, subfolder: str | None) -> dict[str, str]:
        """A Whisper folder at ``hf_save_path`` (``step-N`` under it during the run), when set."""
        if not self.hf_save_path:
            return {}
        where = resolve_path(self.hf_save_path if subfolder is None else f"{self.hf_save_path}/{subfolder}")
        return {"hugging face export": export_whisper(model, where, tokenizer=self.tokenizer, data=self.speech)}
