"""Speech-recognition records -> cache rows: Whisper log-mel features and the tokenised transcript.

A record holds an audio clip and its transcript. The audio field may be

- a path (local or an fsspec URL; a relative path is resolved against ``audio_root``),
- encoded bytes (WAV/FLAC/OGG), or a dict ``{"bytes": ..., "path": ...}`` as Hugging Face ``Audio`` columns
  store them (``bytes`` may also be base64 text, so JSON lines can carry the audio inline),
- decoded samples ``{"array": [...], "sampling_rate": rate}`` (a decoded Hugging Face ``Audio`` value of
  ``datasets`` < 4), or a ``torchcodec`` ``AudioDecoder`` (what ``datasets`` >= 4 decodes ``Audio`` to).

Decoded samples at another rate are resampled to 16 kHz. Reading an ``Audio`` column with ``decode=False`` hands
the encoded ``{"bytes", "path"}`` to this processor, which decodes it with ``soundfile`` (no ``torchcodec``).

Each row has ``input_features`` (float32, ``n_mels * frames`` values: the ``[n_mels, frames]`` log-mel
spectrogram flattened mel-major, ``frames = 100 * chunk_seconds``, 3000 for Whisper's 30-second window) and
``input_ids`` (int32): Whisper's prefix ``<|startoftranscript|> <|lang|> <|task|>`` (then ``<|notimestamps|>``,
or with timestamps the transcript between ``<|0.00|>`` and the clip's rounded end time), the transcript's tokens
and ``<|endoftext|>``. Clips are zero-padded or cut to ``chunk_seconds``.

`AsrExampleDataset` turns such a cache into fixed-shape training rows: the features, the token ids padded to
``max_label_tokens`` and a mask of the real tokens.

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
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from ponente.datacache.audio import (
    HOP_LENGTH,
    SAMPLE_RATE,
    AudioDecodeError,
    decode_audio,
    log_mel_spectrogram,
    resample,
)
from ponente.datacache.dataset import Dataset, Indices, _as_index, _as_index_array
from ponente.datacache.errors import BAD_AUDIO, EMPTY, MISSING_FIELD, WRONG_TYPE, MissingExtraError
from ponente.datacache.processor import load_tokenizer

if TYPE_CHECKING:
    from tokenizers import Tokenizer

__all__ = ["TASKS", "AsrExampleDataset", "AudioTranscriptProcessor", "chunk_frames", "whisper_prefix_tokens"]

TASKS = ("transcribe", "translate")
"""Whisper's tasks."""

_FRAMES_PER_SECOND = SAMPLE_RATE // HOP_LENGTH


def chunk_frames(chunk_seconds: float) -> int:
    """Feature frames of a ``chunk_seconds`` window (100 per second: 3000 for Whisper's 30 s).

    Raises:
        ValueError: naming ``chunk_seconds`` if it is not positive or not a whole number of 10 ms frames.
    """
    frames = round(chunk_seconds * _FRAMES_PER_SECOND)
    if chunk_seconds <= 0 or abs(frames - chunk_seconds * _FRAMES_PER_SECOND) > 1e-6:
        raise ValueError(f"chunk_seconds: expected a positive multiple of 0.01 s, found {chunk_seconds}")
    return frames


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


def _decoded_problem(value: Mapping[str, Any]) -> str | None:
    """What is wrong with decoded samples ``{"array", "sampling_rate"}``, or None."""
    rate = value.get("sampling_rate")
    if not isinstance(rate, int | np.integer) or rate <= 0:
        return f"decoded audio needs a positive integer 'sampling_rate', found {rate!r}"
    if np.size(value["array"]) == 0:
        return "decoded audio 'array' is empty"
    return None


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
        chunk_seconds: the window every clip is zero-padded or cut to (Whisper: 30 s); the features have
            ``100 * chunk_seconds`` frames, which the encoder must accept (``2 * max_source_positions``).

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
        chunk_seconds: float = 30.0,
    ) -> None:
        from tokenizers import Tokenizer

        self.tokenizer = tokenizer if isinstance(tokenizer, Tokenizer) else load_tokenizer(tokenizer)
        if n_mels < 1:
            raise ValueError(f"n_mels: expected a positive number of mel bins, found {n_mels}")
        if max_label_tokens < 8:
            raise ValueError(f"max_label_tokens: expected at least 8, found {max_label_tokens}")
        self.frames = chunk_frames(chunk_seconds)
        self.chunk_seconds = float(chunk_seconds)
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
            "chunk_seconds": self.chunk_seconds,
            "frames": self.frames,
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
        if hasattr(value, "get_all_samples"):  # a torchcodec AudioDecoder: what datasets >= 4 decodes Audio to
            decoded = value.get_all_samples()
            value = {"array": np.asarray(decoded.data), "sampling_rate": int(decoded.sample_rate)}
        if isinstance(value, Mapping):
            if value.get("array") is not None:
                problem = _decoded_problem(value)
                if problem is not None:
                    raise AudioDecodeError(problem)
                samples = np.asarray(value["array"], dtype=np.float32)
                if samples.ndim == 2:  # [channels, samples] as datasets decodes multi-channel audio
                    samples = samples.mean(axis=0)
                if samples.ndim != 1 or samples.size == 0:
                    raise AudioDecodeError(f"decoded audio 'array' must be non-empty 1-D, found {samples.shape}")
                return resample(samples, int(value["sampling_rate"]))
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
        if hasattr(value, "get_all_samples"):
            return None  # a decoder: decoding reports problems
        if isinstance(value, Mapping) and value.get("array") is not None:  # decoded (16 kHz: no soundfile, no scipy)
            return _decoded_problem(value)
        try:
            import soundfile
        except ImportError as exc:
            raise MissingExtraError("reading audio needs soundfile: pip install 'ponente-datacache[audio]'") from exc
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
            # timestamps come every 20 ms up to 30 s; the clip's end is cut to the window like its audio
            end = min(round(seconds * 50), self.frames // 2, 1500) * 0.02
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
            n_samples = self.frames * HOP_LENGTH
            features.append(log_mel_spectrogram(samples, n_mels=self.n_mels, n_samples=n_samples).reshape(-1))
            labels.append(self._labels(record[self.text_field], samples.size / SAMPLE_RATE))
        return {"input_features": features, "input_ids": labels}


class FieldStore(Protocol):
    """A cache with several fields, each cut into rows by its own offsets (what `open_cache` returns)."""

    @property
    def is_finished(self) -> bool:
        """Whether no more rows will be committed."""
        ...

    def __len__(self) -> int:
        """Committed rows."""
        ...

    def read_flat(self, start: int, stop: int, field: str = "input_ids") -> np.ndarray:
        """``flat[start:stop]`` of ``field``."""
        ...

    def row_offsets(self, start_row: int, stop_row: int, field: str = "input_ids") -> np.ndarray:
        """Offsets of rows ``start_row..stop_row`` (inclusive) into ``field``'s flat array."""
        ...

    def wait_until(self, *, rows: int | None = None, timeout: float | None = None) -> bool:
        """Block until ``rows`` rows are committed or the store is finished."""
        ...


def _window_of(cache: FieldStore) -> tuple[int, int] | None:
    """``(n_mels, frames)`` as the cache's fingerprint records them, or None if it does not say."""
    ledger = getattr(cache, "ledger", None)
    processor = getattr(ledger, "fingerprint_parts", {}).get("processor", {})
    if isinstance(processor, Mapping) and processor.get("type") == "audio_transcript":
        return int(processor["n_mels"]), int(processor["frames"])
    return None


class AsrExampleDataset(Dataset[dict[str, np.ndarray]]):
    """Fixed-shape speech-recognition examples from an `AudioTranscriptProcessor` cache, one per cache row.

    Example ``i`` is a dict of

    - ``"input_features"``: float32 ``[n_mels * frames]``, the log-mel spectrogram flattened mel-major
      (reshape to ``[n_mels, frames]``);
    - ``"input_ids"``: int32 ``[max_label_tokens]``, the row's tokens (``<|startoftranscript|>`` ...
      ``<|endoftext|>``) then ``pad_id``; longer rows are cut;
    - ``"loss_mask"``: int32 ``[max_label_tokens]``, 1 on the row's tokens and 0 on padding.

    The dataset grows with a cache that is still being built, like `PackedExampleDataset`.

    Args:
        cache: a cache built with `AudioTranscriptProcessor` (e.g. from `open_cache` or `build_cache`).
        max_label_tokens: the token rows' length.
        pad_id: the token id of padding.
        n_mels: the mel bins of the features; None reads them (and the frames) from the cache's fingerprint.
        frames: the frames of the features; None reads them from the cache's fingerprint.

    Raises:
        ValueError: if ``max_label_tokens < 1``, or ``n_mels``/``frames`` are None and the cache does not record them.

    Example:
        ```py
        cache = build_cache("train.jsonl", "cache/", processor=AudioTranscriptProcessor("tokenizer.json"))
        ds = AsrExampleDataset(cache, max_label_tokens=448, pad_id=50257)
        ds[0]["input_features"].reshape(ds.n_mels, ds.frames)  # [80, 3000]
        ```
    """

    def __init__(
        self,
        cache: FieldStore,
        *,
        max_label_tokens: int,
        pad_id: int,
        n_mels: int | None = None,
        frames: int | None = None,
    ) -> None:
        """Wrap ``cache``."""
        if max_label_tokens < 1:
            raise ValueError(f"max_label_tokens: expected at least 1, found {max_label_tokens}")
        if n_mels is None or frames is None:
            recorded = _window_of(cache)
            if recorded is None:
                raise ValueError(
                    "n_mels/frames: the cache does not record them (not built by AudioTranscriptProcessor?); pass both"
                )
            n_mels, frames = n_mels or recorded[0], frames or recorded[1]
        self.cache = cache
        self.max_label_tokens = int(max_label_tokens)
        self.pad_id = int(pad_id)
        self.n_mels, self.frames = int(n_mels), int(frames)

    @property
    def is_finished(self) -> bool:
        """Whether the cache is finished (and so the length final)."""
        return self.cache.is_finished

    def __len__(self) -> int:
        """Rows committed to the cache so far."""
        return len(self.cache)

    def wait_for_length(self, length: int | None = None, *, timeout: float | None = None) -> bool:
        """Block until ``length`` rows are committed or the cache is finished (waits on the cache)."""
        return self.cache.wait_until(rows=length, timeout=timeout)

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        """Example ``index`` as ``{"input_features", "input_ids", "loss_mask"}``."""
        _as_index(index, len(self), name="AsrExampleDataset")
        batch = self.get_batch_arrays([index])
        return {key: value[0] for key, value in batch.items()}

    def get_batch(self, indices: Indices) -> list[dict[str, np.ndarray]]:
        """Examples at ``indices``, one dict per example (views into one batch array; see `get_batch_arrays`)."""
        batch = self.get_batch_arrays(indices)
        return [{key: value[k] for key, value in batch.items()} for k in range(batch["input_ids"].shape[0])]

    def get_batch_arrays(self, indices: Indices) -> dict[str, np.ndarray]:
        """Examples at ``indices`` stacked: ``[batch, n_mels * frames]`` features, ``[batch, max_label_tokens]`` ids.

        Raises:
            IndexError: naming the first index that is negative or not (yet) committed.
            ValueError: naming the row if its features do not have ``n_mels * frames`` values.
        """
        idx = _as_index_array(indices, len(self), name="AsrExampleDataset")
        width = self.n_mels * self.frames
        out = {
            "input_features": np.empty((idx.size, width), dtype=np.float32),
            "input_ids": np.full((idx.size, self.max_label_tokens), self.pad_id, dtype=np.int32),
            "loss_mask": np.zeros((idx.size, self.max_label_tokens), dtype=np.int32),
        }
        for k, row in enumerate(idx.tolist()):
            lo, hi = (int(v) for v in self.cache.row_offsets(row, row + 1, "input_features"))
            if hi - lo != width:
                raise ValueError(
                    f"AsrExampleDataset: row {row} has {hi - lo} feature values, expected n_mels * frames = "
                    f"{self.n_mels} * {self.frames}"
                )
            out["input_features"][k] = self.cache.read_flat(lo, hi, "input_features")
            lo, hi = (int(v) for v in self.cache.row_offsets(row, row + 1, "input_ids"))
            hi = min(hi, lo + self.max_label_tokens)
            out["input_ids"][k, : hi - lo] = self.cache.read_flat(lo, hi, "input_ids")
            out["loss_mask"][k, : hi - lo] = 1
        return out
