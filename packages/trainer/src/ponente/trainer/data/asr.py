"""The data config of speech recognition: audio + transcript records, their feature/token caches and datasets.

`AsrDatasetConfig` describes one speech corpus (jsonl/json/parquet files with an audio path or bytes and a
transcript, or a Hugging Face dataset with an ``Audio`` column). Its caches hold Whisper log-mel features and
tokenised transcripts (``ponente.datacache.AudioTranscriptProcessor``); its datasets give fixed-shape rows
``{"input_features": float32[n_mels * frames], "input_ids": int32[max_label_tokens], "loss_mask":
int32[max_label_tokens]}`` (``ponente.datacache.AsrExampleDataset``). Split ``S`` is cached at
``<cache_dir>/<name or id or "default">/<S>``.
"""

from __future__ import annotations

import dataclasses
import posixpath
from typing import TYPE_CHECKING, Any, Literal

from ponente.datacache import AsrExampleDataset, AudioTranscriptProcessor, CacheDataset, Dataset
from ponente.datacache.asr import TASKS, chunk_frames, whisper_prefix_tokens
from ponente.trainer.data.build import derive_seed, shuffled
from ponente.trainer.data.cache_build import open_or_build, resolve_url
from ponente.trainer.data.source import SPLITS, SplitSources
from ponente.trainer.data.tokens import load_data_tokenizer

if TYPE_CHECKING:
    from tokenizers import Tokenizer

__all__ = ["AsrDatasetConfig"]


@dataclasses.dataclass(frozen=True)
class AsrDatasetConfig(SplitSources):
    """One speech-recognition corpus: sources, Whisper tokenizer, features, cache, shuffle (Levanter's keys).

    Attributes:
        id: A Hugging Face dataset id or ``save_to_disk`` directory with an ``Audio`` column (needs the ``hf``
            extra of ``ponente-datacache``); used when ``train_urls``/``validation_urls`` are empty.
        name: The Hugging Face dataset configuration (subset) name; also names the cache folder.
        train_urls: Training files (jsonl/json/parquet; paths, globs, fsspec or ``package://`` URLs), one record per
            clip with an audio field (a path, bytes, or ``{"bytes", "path"}``) and a transcript.
        validation_urls: Validation files, same forms. Empty (and no ``id``): no validation set.
        cache_dir: Root folder (or URL) of the caches.
        tokenizer: A Whisper tokenizer: ``tokenizer.json``, a folder with one, a ``package://`` URL or a hub id such
            as ``openai/whisper-tiny``. Required.
        audio_field: The record field holding the audio.
        text_field: The record field holding the transcript.
        audio_root: The folder relative audio paths are resolved against; None: the folder of the split's first
            file (so ``{"audio": "clips/a.wav"}`` next to ``train.jsonl`` works from any working directory).
        n_mels: Mel bins of the features (80; 128 for large-v3); must equal the model's ``num_mel_bins``.
        chunk_seconds: The window every clip is padded or cut to (30 for Whisper); the features have
            ``100 * chunk_seconds`` frames, which must be ``2 * model.max_source_positions`` or fewer.
        language: The language token's code (``en``), or None for English-only models.
        task: ``transcribe`` or ``translate``.
        timestamps: Train with timestamp tokens around the transcript instead of ``<|notimestamps|>``.
        max_label_tokens: Decoder tokens per row (prompt, transcript, ``<|endoftext|>``, padding); at most the
            model's ``max_target_positions``.
        bad_records: ``error`` (stop at a missing or corrupt clip, naming the file) or ``skip`` (count them).
        shuffle: ``False``: rows in corpus order; ``True``: a full permutation (waits for the cache to finish); an
            integer ``n``: shuffle within consecutive eras of ``n`` rows.
        train_split: The Hugging Face split read for training (with ``id``).
        validation_split: The Hugging Face split read for validation (with ``id``); None: none.
        workers: Feature worker processes of a cache build; ``0``: in the building thread; None: one per CPU.

    Example:
        ```python
        from ponente.trainer.data import AsrDatasetConfig

        cfg = AsrDatasetConfig(train_urls=["speech/train.jsonl"], tokenizer="speech/tokenizer", cache_dir="/tmp/c")
        assert cfg.cache_path("train") == "/tmp/c/default/train"
        assert cfg.frames == 3000  # 30-second windows
        ```
    """

    id: str | None = None
    name: str | None = None
    train_urls: list[str] = dataclasses.field(default_factory=list)
    validation_urls: list[str] = dataclasses.field(default_factory=list)
    cache_dir: str = "cache/"
    tokenizer: str | None = None
    audio_field: str = "audio"
    text_field: str = "text"
    audio_root: str | None = None
    n_mels: int = 80
    chunk_seconds: float = 30.0
    language: str | None = "en"
    task: Literal["transcribe", "translate"] = "transcribe"
    timestamps: bool = False
    max_label_tokens: int = 448
    bad_records: Literal["error", "skip"] = "error"
    shuffle: bool | int = True
    train_split: str = "train"
    validation_split: str | None = "validation"
    workers: int | None = None

    def __post_init__(self) -> None:
        """Check the values that can be checked without touching files.

        Raises:
            ValueError: naming the offending key.
        """
        self._check_sources()
        if self.bad_records not in ("error", "skip"):
            raise ValueError(f"data.bad_records: expected 'error' or 'skip', got {self.bad_records!r}")
        if self.workers is not None and self.workers < 0:
            raise ValueError(f"data.workers: expected >= 0 or null, got {self.workers}")
        if self.task not in TASKS:
            raise ValueError(f"data.task: expected one of {list(TASKS)}, got {self.task!r}")
        if self.n_mels < 1:
            raise ValueError(f"data.n_mels: expected a positive number of mel bins, got {self.n_mels}")
        if self.max_label_tokens < 8:
            raise ValueError(f"data.max_label_tokens: expected at least 8, got {self.max_label_tokens}")
        try:
            chunk_frames(self.chunk_seconds)
        except ValueError as e:
            raise ValueError(f"data.{e}") from None
        for key in ("audio_field", "text_field"):
            value = getattr(self, key)
            if not isinstance(value, str) or not value:
                raise ValueError(f"data.{key}: expected a non-empty field name, got {value!r}")

    # -- tokenizer -----------------------------------------------------------------------------------

    @property
    def the_tokenizer(self) -> Tokenizer:
        """The Whisper tokenizer (``tokenizers.Tokenizer``), loaded once per process.

        Raises:
            ValueError: If ``tokenizer`` is not set.
            FileNotFoundError: For a missing file or a folder without ``tokenizer.json``.
        """
        if not self.tokenizer:
            raise ValueError(
                "data.tokenizer is not set: name a Whisper tokenizer (a tokenizer.json, its folder, or a hub id such "
                "as openai/whisper-tiny)"
            )
        return load_data_tokenizer(self.tokenizer)

    @property
    def the_vocab_size(self) -> int:
        """The tokenizer's vocabulary size (with added tokens)."""
        return int(self.the_tokenizer.get_vocab_size(with_added_tokens=True))

    def token_id(self, token: str) -> int:
        """The id of ``token`` in the tokenizer.

        Raises:
            ValueError: naming ``data.tokenizer`` if the tokenizer lacks it.
        """
        found = self.the_tokenizer.token_to_id(token)
        if found is None:
            raise ValueError(f"data.tokenizer: {self.tokenizer} has no token {token!r}; is it a Whisper tokenizer?")
        return int(found)

    @property
    def prompt_ids(self) -> list[int]:
        """The decoder prompt of transcription: ``<|startoftranscript|> <|lang|> <|task|> <|notimestamps|>``."""
        return [self.token_id(t) for t in whisper_prefix_tokens(self.language, self.task, self.timestamps)]

    @property
    def pad_id(self) -> int:
        """The id that pads token rows: ``<|endoftext|>`` (as Whisper pads)."""
        return self.token_id("<|endoftext|>")

    @property
    def frames(self) -> int:
        """Feature frames per clip: ``100 * chunk_seconds``."""
        return chunk_frames(self.chunk_seconds)

    def processor(self, split: str) -> AudioTranscriptProcessor:
        """The datacache processor of ``split`` (its config is part of the cache fingerprint).

        Raises:
            ValueError: naming the key, if the tokenizer lacks a token the settings need.
        """
        try:
            return AudioTranscriptProcessor(
                self.the_tokenizer,
                audio_field=self.audio_field,
                text_field=self.text_field,
                n_mels=self.n_mels,
                language=self.language,
                task=self.task,
                timestamps=self.timestamps,
                audio_root=self._audio_root(split),
                max_label_tokens=self.max_label_tokens,
                chunk_seconds=self.chunk_seconds,
            )
        except ValueError as e:
            raise ValueError(f"data.{e}") from None

    def _audio_root(self, split: str) -> str | None:
        if self.audio_root is not None:
            return resolve_url(self.audio_root)
        urls = self.train_urls if split == "train" else self.validation_urls
        if not urls:
            return None
        first = resolve_url(urls[0])
        return posixpath.dirname(first) if "://" in first else _local_dirname(first)

    # -- caches --------------------------------------------------------------------------------------

    def build_caches(self, split: str, *, background: bool = True, progress: bool = True) -> CacheDataset:
        """Build (or resume, or open) the cache of ``split`` at `cache_path` (as ``LMDatasetConfig.build_caches``).

        Raises:
            ValueError: If the config has no source for ``split``.
        """
        source = self.source(split)
        if source is None:
            raise ValueError(
                f"no {split} data: set data.{split}_urls"
                + (" or data.id" if split == "train" else " (or data.id with data.validation_split)")
            )
        return open_or_build(
            self.cache_path(split),
            background=background,
            inputs=source,
            processor=self.processor(split),
            text_key=self.text_field,
            workers=self.workers,
            bad_records=self.bad_records,
            progress=progress,
        )

    def build_all_caches(self, *, progress: bool = True) -> dict[str, CacheDataset]:
        """Build every split that has a source, in this thread; returns ``{split: finished cache}``."""
        return {s: self.build_caches(s, background=False, progress=progress) for s in SPLITS if self.has_split(s)}

    # -- datasets ------------------------------------------------------------------------------------

    def rows(self, cache: CacheDataset) -> AsrExampleDataset:
        """The fixed-shape examples of a cache of this config (see the module docstring)."""
        return AsrExampleDataset(
            cache, max_label_tokens=self.max_label_tokens, pad_id=self.pad_id, n_mels=self.n_mels, frames=self.frames
        )

    def train_set(self, *, seed: int, batch_size: int | None = None) -> Dataset[dict[str, Any]]:
        """The training examples, shuffled per ``shuffle`` (the cache builds in the background if needed).

        Args:
            seed: Root seed of the shuffle.
            batch_size: Unused (the signature of the other data configs).
        """
        del batch_size
        return shuffled(self.rows(self.build_caches("train")), self.shuffle, derive_seed(seed, "train"))

    def validation_sets(self) -> dict[str, AsrExampleDataset]:
        """The validation examples (unshuffled) by name: ``{cache_name: dataset}`` or ``{}``."""
        if not self.has_split("validation"):
            return {}
        return {self.cache_name: self.rows(self.build_caches("validation"))}


def _local_dirname(path: str) -> str:
    import os

    return os.path.dirname(os.path.abspath(path))
