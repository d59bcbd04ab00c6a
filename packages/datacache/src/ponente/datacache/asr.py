"""Speech-recognition records -> cache rows: Whisper log-mel features and the tokenised transcript.

A record holds an audio clip and its transcript. The audio field may be

- a path (local or an fsspec URL; a relative path is resolved against ``audio_root``),
- encoded bytes (WAV/FLAC/OGG), or a dict ``{"bytes": ..., "path": ...}`` as Hugging Face ``Audio`` columns
  store them (``bytes`` may also be base64 text, so JSON lines can carry the audio inline),
- decoded samples ``{"array": [...], "sampling_rate": rate}`` (a decoded Hugging Face ``Audio`` value).

Each row has ``input_features`` (float32, ``n_mels * 3000`` values: the ``[n_mels, 3000]`` log-mel spectrogram
flattened mel-major) and ``input_ids`` (int32): Whisper's prefix ``<|startoftranscript|> <|lang|> <|task|>``
(then ``<|notimestamps|>``, or with timestamps the transcript between ``<|0.00|>`` and the clip's rounded end
time), the transcript's tokens and ``<|endoftext|>``.

Audio that is missing or cannot be decoded is a bad record of kind ``bad_audio`` (the detail names the file): the
builder's ``bad_records`` switch skips and counts it or stops with the row named.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ponente.datacache.audio import (
    CHUNK_SAMPLES,
    HOP_LENGTH,
    SAMPLE_RATE,
    AudioDecodeError,
    decode_audio,
    log_mel_spectrogram,
    resample,
)
from ponente.datacache.errors import BAD_AUDIO, EMPTY, MISSING_FIELD, WRONG_TYPE, MissingExtraError
from ponente.datacache.processor import load_tokenizer

if TYPE_CHECKING:
    from tokenizers import Tokenizer

__all__ = ["TASKS", "AudioTranscriptProcessor", "whisper_prefix_tokens"]

TASKS = ("transcribe", "translate")
"""Whisper's tasks."""

_FRAMES = CHUNK_SAMPLES // HOP_LENGTH


def whisper_prefix_tokens(language: str | None, task: str, timestamps: bool) -> list[str]:
    """Whisper's decoder prompt: ``<|startoftranscript|>``, the language, the task, ``<|notimestamps|>``.

    Args:
        language: a language code (``"en"``) or None to leave the language to the model (English-only models).
        task: ``"transcribe"`` or ``"translate"``.
        timestamps: whether the model predicts timestamps (then no ``<|notimestamps|>``).
    """
    if task not in TASKS:
        raise ValueError(f"task: expected one of {list(TASKS)}, found {task!r}")
    tokens = ["<|startoftranscript|>"]
    if language is not None:
        tokens.append(f"<|{language}|>")
    tokens.append(f"<|{task}|>")
    if not timestamps:
        tokens.append("<|notimestamps|>")
    return tokens


def _token_id(tokenizer: Tokenizer, token: str, what: str) -> int:
    token_id = tokenizer.token_to_id(token)
    if token_id is None:
        raise ValueError(f"{what}: the tokenizer has no token {token!r} (is it a Whisper tokenizer?)")
    return int(token_id)


class AudioTranscriptProcessor:
    """Whisper training rows from audio + transcript records (see the module docstring for the formats).

    Args:
        tokenizer: a Whisper ``tokenizers`` tokenizer (object, ``tokenizer.json``, directory or hub id).
        audio_field: the record key of the audio.
        text_field: the record key of the transcript.
        n_mels: mel bins of the features (80; 128 for large-v3).
        language: the language token's code (``"en"``), or None for English-only models (no language token).
        task: ``"transcribe"`` or ``"translate"``.
        timestamps: predict timestamps: the transcript sits between ``<|0.00|>`` and the end time of the clip.
        audio_root: the directory relative audio paths are resolved against (None: the working directory).
        max_label_tokens: the longest token sequence kept (Whisper's decoder has 448 positions); a longer
            transcript is cut and still ends with ``<|endoftext|>``.

    Raises:
        ValueError: if a special token the settings need is not in the tokenizer, or a setting is invalid.
    """

    def __init__(
        self,
        tokenizer: Tokenizer | str | os.PathLike[str],
        *,
        audio_field: str = "audio",
        text_field: str = "text",
        n_mels: int = 80,
        language: str | None = "en",
        task: str = "transcribe",
        timestamps: bool = False,
        audio_root: str | os.PathLike[str] | None = None,
        max_label_tokens: int = 448,
    ) -> None:
        from tokenizers import Tokenizer

        self.tokenizer = tokenizer if isinstance(tokenizer, Tokenizer) else load_tokenizer(tokenizer)
        if n_mels < 1:
            raise ValueError(f"n_mels: expected a positive number of mel bins, found {n_mels}")
        if max_label_tokens < 8:
            raise ValueError(f"max_label_tokens: expected at least 8, found {max_label_tokens}")
        self.audio_field, self.text_field = audio_field, text_field
        self.n_mels, self.language, self.task, self.timestamps = n_mels, language, task, timestamps
        self.audio_root = None if audio_root is None else os.fspath(audio_root)
        self.max_label_tokens = max_label_tokens
        self._prefix = [
            _token_id(self.tokenizer, t, "language" if t == f"<|{language}|>" else "task")
            for t in whisper_prefix_tokens(language, task, timestamps)
        ]
        self._eot = _token_id(self.tokenizer, "<|endoftext|>", "tokenizer")
        self._t0 = _token_id(self.tokenizer, "<|0.00|>", "timestamps") if timestamps else None
        self._digest = hashlib.sha256(self.tokenizer.to_str().encode("utf-8")).hexdigest()

    @property
    def fields(self) -> Mapping[str, str]:
        """``{"input_features": "float32", "input_ids": "int32"}``."""
        return {"input_features": "float32", "input_ids": "int32"}

    def config(self) -> dict[str, Any]:
        """Everything that determines the rows (part of the cache fingerprint)."""
        return {
            "type": "audio_transcript",
            "tokenizer_sha256": self._digest,
            "audio_field": self.audio_field,
            "text_field": self.text_field,
            "n_mels": self.n_mels,
            "frames": _FRAMES,
            "sample_rate": SAMPLE_RATE,
            "language": self.language,
            "task": self.task,
            "timestamps": self.timestamps,
            "audio_root": self.audio_root,
            "max_label_tokens": self.max_label_tokens,
        }

    # -- reading the audio -------------------------------------------------------------------------------------

    def _path(self, path: str) -> str:
        if "://" in path or os.path.isabs(path) or self.audio_root is None:
            return path
        return os.path.join(self.audio_root, path)

    def _load(self, value: Any) -> np.ndarray:
        """Decoded 16 kHz mono samples of an audio field value (raises AudioDecodeError/FileNotFoundError)."""
        if isinstance(value, str):
            return decode_audio(self._path(value))
        if isinstance(value, bytes | bytearray):
            return decode_audio(bytes(value))
        if isinstance(value, Mapping):
            if value.get("array") is not None:
                rate = value.get("sampling_rate")
                if not isinstance(rate, int | np.integer) or rate <= 0:
                    raise AudioDecodeError(f"decoded audio needs a positive integer 'sampling_rate', found {rate!r}")
                samples = np.asarray(value["array"], dtype=np.float32)
                if samples.ndim == 2:  # [channels, samples] as datasets decodes multi-channel audio
                    samples = samples.mean(axis=0)
                if samples.ndim != 1 or samples.size == 0:
                    raise AudioDecodeError(f"decoded audio 'array' must be non-empty 1-D, found {samples.shape}")
                return resample(samples, int(rate))
            name = value.get("path") if isinstance(value.get("path"), str) else None
            data = value.get("bytes")
            if isinstance(data, str):
                try:
                    data = base64.b64decode(data, validate=True)
                except (binascii.Error, ValueError) as exc:
                    raise AudioDecodeError(f"audio 'bytes' of {name or 'the record'} is not base64: {exc}") from exc
            if isinstance(data, bytes | bytearray):
                return decode_audio(bytes(data), name=name)
            if name is not None:
                return decode_audio(self._path(name))
        raise AudioDecodeError(
            f"audio field {self.audio_field!r}: expected a path, bytes, {{'bytes'|'path': ...}} or "
            f"{{'array', 'sampling_rate'}}, found {type(value).__name__}"
        )

    def _probe(self, value: Any) -> str | None:
        """Why the audio cannot be read (a header probe, not a full decode), or None if it looks readable."""
        try:
            import soundfile
        except ImportError as exc:
            raise MissingExtraError("reading audio needs soundfile: pip install 'ponente-datacache[audio]'") from exc
        if isinstance(value, Mapping) and value.get("array") is not None:
            return None  # decoded samples: checked when processed
        try:
            if isinstance(value, str) or (
                isinstance(value, Mapping) and value.get("bytes") is None and isinstance(value.get("path"), str)
            ):
                path = self._path(value if isinstance(value, str) else value["path"])
                if "://" in path:
                    return None  # remote: decoding reports problems
                if not os.path.isfile(path):
                    return f"audio file not found: {path}"
                soundfile.info(path)
                return None
            data = value.get("bytes") if isinstance(value, Mapping) else value
            if isinstance(data, str):
                data = base64.b64decode(data, validate=True)
            if not isinstance(data, bytes | bytearray):
                return f"expected a path, bytes or a decoded array, found {type(value).__name__}"
            soundfile.info(io.BytesIO(bytes(data)))
            return None
        except Exception as exc:
            label = value.get("path") if isinstance(value, Mapping) else value if isinstance(value, str) else "bytes"
            return f"cannot decode audio {label}: {str(exc).strip() or type(exc).__name__}"

    # -- the BatchProcessor protocol -----------------------------------------------------------------------------

    def check(self, record: Mapping[str, Any]) -> tuple[str, str] | None:
        """Require the audio and text fields; audio that is missing or not decodable is ``bad_audio``."""
        if not isinstance(record, Mapping):
            return MISSING_FIELD, f"expected a record with {self.audio_field!r} and {self.text_field!r}"
        for name in (self.audio_field, self.text_field):
            if name not in record:
                return MISSING_FIELD, f"expected a field {name!r}, found keys {sorted(record)}"
        if not isinstance(record[self.text_field], str):
            return WRONG_TYPE, f"expected field {self.text_field!r} to be a string"
        problem = self._probe(record[self.audio_field])
        if problem is not None:
            return BAD_AUDIO, problem
        if not record[self.text_field].strip():
            return EMPTY, "empty transcript"
        return None

    def _labels(self, text: str, seconds: float) -> np.ndarray:
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        body = [*self._prefix]
        if self._t0 is not None:
            end = min(round(seconds / 0.02) * 0.02, 30.0)
            body += [self._t0, *ids, _token_id(self.tokenizer, f"<|{end:.2f}|>", "timestamps")]
        else:
            body += ids
        body = [*body[: self.max_label_tokens - 1], self._eot]
        return np.asarray(body, dtype=np.int32)

    def __call__(self, records: Sequence[Mapping[str, Any]]) -> dict[str, list[np.ndarray]]:
        """Decode, featurise and tokenise each record."""
        features, labels = [], []
        for record in records:
            samples = self._load(record[self.audio_field])
            features.append(log_mel_spectrogram(samples, n_mels=self.n_mels).reshape(-1))
            labels.append(self._labels(record[self.text_field], samples.size / SAMPLE_RATE))
        return {"input_features": features, "input_ids": labels}
