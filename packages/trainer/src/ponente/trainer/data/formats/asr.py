"""``data.format: asr``: speech recognition, an audio clip and its transcript per record (``ponente-train-asr``)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, ClassVar, Literal

from ponente.datacache import AsrExampleDataset, AudioTranscriptProcessor, CacheDataset
from ponente.datacache.asr import TASKS, chunk_frames, whisper_prefix_tokens
from ponente.trainer.data.cache_build import resolve_url
from ponente.trainer.data.formats._base import LmDatasetFormat, check_field_name

if TYPE_CHECKING:
    from tokenizers import Tokenizer

    from ponente.trainer.data.tokens import TokenizerSpec

__all__ = ["AsrDatasetFormat"]


@LmDatasetFormat.register_subclass("asr")
@dataclasses.dataclass(frozen=True)
class AsrDatasetFormat(LmDatasetFormat):
    """Speech recognition: Whisper log-mel features of a clip and its tokenised transcript after Whisper's prompt.

    The cache holds the features and the tokens (``ponente.datacache.AudioTranscriptProcessor``); the rows have a
    fixed shape whatever ``seq_len`` (``ponente.datacache.AsrExampleDataset``): ``{"input_features":
    float32[n_mels * frames], "input_ids": int32[max_label_tokens], "loss_mask": int32[max_label_tokens]}``, padded
    with ``<|endoftext|>``. ``data.tokenizer`` must be a Whisper tokenizer; ``data.enforce_bos``/``enforce_eos`` do
    not apply (the prompt and ``<|endoftext|>`` are Whisper's). The flat keys of older ASR configs
    (``data.n_mels``, ``data.max_label_tokens``, ...) are read into it.

    Attributes:
        audio_field: The record field holding the audio (a path, bytes, or ``{"bytes", "path"}``).
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

    Example:
        ```yaml
        data:
          train_urls: [speech/train.jsonl]
          tokenizer: openai/whisper-tiny
          format: {type: asr, n_mels: 80, chunk_seconds: 30, max_label_tokens: 448}
        ```
    """

    has_loss_mask: ClassVar[bool] = True

    audio_field: str = "audio"
    text_field: str = "text"
    audio_root: str | None = None
    n_mels: int = 80
    chunk_seconds: float = 30.0
    language: str | None = "en"
    task: Literal["transcribe", "translate"] = "transcribe"
    timestamps: bool = False
    max_label_tokens: int = 448

    def __post_init__(self) -> None:
        """Raises ``ValueError`` naming the ``data.format`` key of a value that cannot work."""
        check_field_name(self, "audio_field", "text_field")
        if self.task not in TASKS:
            raise ValueError(f"data.format.task: expected one of {list(TASKS)}, got {self.task!r}")
        if self.n_mels < 1:
            raise ValueError(f"data.format.n_mels: expected a positive number of mel bins, got {self.n_mels}")
        if self.max_label_tokens < 8:
            raise ValueError(f"data.format.max_label_tokens: expected at least 8, got {self.max_label_tokens}")
        try:
            chunk_frames(self.chunk_seconds)
        except ValueError as e:
            raise ValueError(f"data.format.{e}") from None

    @property
    def txt_key(self) -> str:
        """``text_field``."""
        return self.text_field

    @property
    def frames(self) -> int:
        """Feature frames per clip: ``100 * chunk_seconds``."""
        return chunk_frames(self.chunk_seconds)

    def token_id(self, tokenizer: Tokenizer, token: str) -> int:
        """The id of ``token`` in the data's tokenizer.

        Raises:
            ValueError: naming ``data.tokenizer`` if the tokenizer lacks it.
        """
        found = tokenizer.token_to_id(token)
        if found is None:
            raise ValueError(f"data.tokenizer: the tokenizer has no token {token!r}; is it a Whisper tokenizer?")
        return int(found)

    def prompt_ids(self, tokenizer: Tokenizer) -> list[int]:
        """The decoder prompt: ``<|startoftranscript|> <|lang|> <|task|> <|notimestamps|>`` (per the settings)."""
        return [self.token_id(tokenizer, t) for t in whisper_prefix_tokens(self.language, self.task, self.timestamps)]

    def processor(self, tokens: TokenizerSpec, folder: str | None) -> AudioTranscriptProcessor:
        """An `AudioTranscriptProcessor`; relative audio paths resolve against ``audio_root``, else ``folder``.

        Raises:
            ValueError: naming the key, if the tokenizer lacks a token the settings need.
        """
        try:
            return AudioTranscriptProcessor(
                tokens.tokenizer,
                audio_field=self.audio_field,
                text_field=self.text_field,
                n_mels=self.n_mels,
                language=self.language,
                task=self.task,
                timestamps=self.timestamps,
                audio_root=folder if self.audio_root is None else resolve_url(self.audio_root),
                max_label_tokens=self.max_label_tokens,
                chunk_seconds=self.chunk_seconds,
            )
        except ValueError as e:
            where = "data." if str(e).startswith("tokenizer:") else "data.format."
            raise ValueError(f"{where}{e}") from None

    def rows(self, cache: CacheDataset, seq_len: int, tokenizer: Tokenizer) -> AsrExampleDataset:
        """The fixed-shape examples of the cache (``seq_len`` does not apply), padded with ``<|endoftext|>``."""
        del seq_len
        return AsrExampleDataset(
            cache,
            max_label_tokens=self.max_label_tokens,
            pad_id=self.token_id(tokenizer, "<|endoftext|>"),
            n_mels=self.n_mels,
            frames=self.frames,
        )
