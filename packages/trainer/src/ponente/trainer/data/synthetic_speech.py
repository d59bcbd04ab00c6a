"""A small synthetic speech set: formant-synthesised spoken digits, their transcripts and a tiny Whisper tokenizer.

It is the offline example of ``ponente-train-asr`` (``docs/trainer/docs/speech.md``): a tiny Whisper learns to
transcribe it within a CPU-minute or two. Each digit word (``zero`` … ``nine``) is a fixed sequence of sounds —
vowels and glides given by their formants, nasals, fricatives as band-limited noise, stops as a closure and a
burst — spoken by a random "speaker" (pitch, vocal-tract scale, loudness) with a little random variation of
duration, pitch contour and background noise. A clip says two to four digits in at most two seconds.

```bash
python -m ponente.trainer.data.synthetic_speech digits --train 1000 --validation 100 --seed 0
```

writes

```text
digits/train.jsonl          {"audio": "clips/train-00000.wav", "text": "three one four"} per line
digits/validation.jsonl
digits/clips/*.wav          16 kHz mono, 16-bit PCM
digits/tokenizer/tokenizer.json         byte-level BPE: the digit words + Whisper's special tokens
digits/tokenizer/tokenizer_config.json  so that transformers' AutoTokenizer loads it as a Whisper tokenizer
```

The output depends only on the arguments: the same seed gives the same bytes, and clip ``i`` of a split does
not depend on how many clips are written.

A training configuration names the set in a ``synthetic_data:`` section (a :class:`SyntheticSpeechConfig`, as the
packaged ``whisper_tiny_digits`` does); :func:`write_missing_synthetic_speech` then writes it on the first run, so
``ponente-train-asr --config_path whisper_tiny_digits`` runs as one command.

Only NumPy and the standard library are used (``wave`` writes the WAV files).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import wave
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = [
    "DIGITS",
    "MAX_SECONDS",
    "SAMPLE_RATE",
    "WHISPER_LANGUAGES",
    "SyntheticSpeechConfig",
    "SyntheticSpeechFiles",
    "main",
    "speak_digits",
    "whisper_special_tokens",
    "write_missing_synthetic_speech",
    "write_synthetic_speech",
    "write_tokenizer",
]

logger = logging.getLogger(__name__)

SAMPLE_RATE = 16_000
"""Sample rate of the clips (Whisper's)."""
MAX_SECONDS = 2.0
"""The longest a clip can be; train with ``chunk_seconds: 2.0`` (200 mel frames)."""
DIGITS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
"""The words of the set, ``DIGITS[d]`` for digit ``d``."""

WHISPER_LANGUAGES = (
    "en", "zh", "de", "es", "ru", "ko", "fr", "ja", "pt", "tr", "pl", "ca", "nl", "ar", "sv", "it", "id", "hi",
    "fi", "vi", "he", "uk", "el", "ms", "cs", "ro", "da", "hu", "ta", "no", "th", "ur", "hr", "bg", "lt", "la",
    "mi", "ml", "cy", "sk", "te", "fa", "lv", "bn", "sr", "az", "sl", "kn", "et", "mk", "br", "eu", "is", "hy",
    "ne", "mn", "bs", "kk", "sq", "sw", "gl", "mr", "pa", "si", "km", "sn", "yo", "so", "af", "oc", "ka", "be",
    "tg", "sd", "gu", "am", "yi", "lo", "uz", "fo", "ht", "ps", "tk", "nn", "mt", "sa", "lb", "my", "bo", "tl",
    "mg", "as", "tt", "haw", "ln", "ha", "ba", "jw", "su",
)  # fmt: skip
"""Whisper's language codes in its token order (the 99 of the multilingual ``tiny`` … ``large-v2`` models)."""

_SPLITS = ("train", "validation")
_WORD_SECONDS = 0.25

# Formant frequencies (Hz) of the voiced sounds, roughly those of an adult speaker (Peterson & Barney).
_FORMANTS: dict[str, tuple[float, float, float]] = {
    "iy": (270, 2290, 3010),
    "ih": (390, 1990, 2550),
    "eh": (530, 1840, 2480),
    "ah": (640, 1190, 2390),
    "aa": (730, 1090, 2440),
    "ao": (570, 840, 2410),
    "uw": (300, 870, 2240),
    "ow": (480, 900, 2300),
    "w": (300, 610, 2200),
    "r": (420, 1300, 1600),
    "n": (250, 1700, 2500),
}
# Noise sounds: (low Hz, high Hz, loudness relative to a vowel, voicing mixed in).
_NOISES: dict[str, tuple[float, float, float, float]] = {
    "s": (4000, 7800, 0.45, 0.0),
    "z": (4000, 7800, 0.30, 0.25),
    "f": (1500, 7500, 0.18, 0.0),
    "v": (1500, 7500, 0.12, 0.30),
    "th": (2000, 7500, 0.10, 0.0),
    "t": (3000, 7000, 0.50, 0.0),  # a stop's burst (its closure is "-")
    "k": (1500, 3500, 0.50, 0.0),
}
# Each word: (sound, share of the word's duration). "-" is a stop's closure (silence).
_WORDS: dict[str, tuple[tuple[str, float], ...]] = {
    "zero": (("z", 0.18), ("ih", 0.20), ("r", 0.20), ("ow", 0.42)),
    "one": (("w", 0.20), ("ah", 0.50), ("n", 0.30)),
    "two": (("-", 0.10), ("t", 0.10), ("uw", 0.80)),
    "three": (("th", 0.25), ("r", 0.20), ("iy", 0.55)),
    "four": (("f", 0.25), ("ao", 0.45), ("r", 0.30)),
    "five": (("f", 0.20), ("aa", 0.30), ("iy", 0.30), ("v", 0.20)),
    "six": (("s", 0.30), ("ih", 0.30), ("-", 0.10), ("k", 0.05), ("s", 0.25)),
    "seven": (("s", 0.25), ("eh", 0.25), ("v", 0.15), ("ah", 0.15), ("n", 0.20)),
    "eight": (("eh", 0.35), ("iy", 0.35), ("-", 0.15), ("t", 0.15)),
    "nine": (("n", 0.20), ("aa", 0.35), ("iy", 0.20), ("n", 0.25)),
}
_FORMANT_GAINS = np.array([1.0, 0.5, 0.25])
_FORMANT_WIDTHS = np.array([70.0, 100.0, 140.0])  # standard deviation of each formant's spectral bump (Hz)
_NASAL_LOUDNESS = 0.35
_ENVELOPE_STEP = 16  # samples between two computations of the spectral envelope (1 ms)


@dataclass(frozen=True)
class SyntheticSpeechFiles:
    """The files :func:`write_synthetic_speech` wrote.

    Attributes:
        train: ``train.jsonl``.
        validation: ``validation.jsonl``.
        tokenizer: ``tokenizer/tokenizer.json``.
    """

    train: Path
    validation: Path
    tokenizer: Path


def _smooth(x: np.ndarray, seconds: float) -> np.ndarray:
    """``x`` convolved with a unit-sum Hann window of ``seconds`` (no clicks at the sound boundaries)."""
    n = max(3, int(seconds * SAMPLE_RATE) | 1)
    window = np.hanning(n + 2)[1:-1]
    return np.convolve(x, window / window.sum(), mode="same")


def _band_noise(rng: np.random.Generator, n: int, low: float, high: float) -> np.ndarray:
    """``n`` samples of white noise kept between ``low`` and ``high`` Hz, at unit RMS."""
    spectrum = np.fft.rfft(rng.standard_normal(n))
    freqs = np.fft.rfftfreq(n, 1 / SAMPLE_RATE)
    spectrum[(freqs < low) | (freqs > high)] = 0
    noise = np.fft.irfft(spectrum, n)
    return noise / (np.sqrt(np.mean(noise**2)) + 1e-12)


def _speak_word(word: str, rng: np.random.Generator, pitch: float, tract: float) -> np.ndarray:
    """One word: harmonics of a falling pitch shaped by the formant tracks, plus the noise sounds."""
    sounds = _WORDS[word]
    n = int(_WORD_SECONDS * rng.uniform(0.85, 1.15) * SAMPLE_RATE)
    bounds = np.round(np.cumsum([0.0] + [share for _, share in sounds]) * n).astype(int)
    voicing = np.zeros(n)
    noise = np.zeros(n)
    keys: list[float] = []
    targets: list[tuple[float, float, float]] = []
    for (sound, _), start, stop in zip(sounds, bounds[:-1], bounds[1:], strict=True):
        if sound in _FORMANTS:
            voicing[start:stop] = _NASAL_LOUDNESS if sound == "n" else 1.0
            keys.append((start + stop) / 2)
            targets.append(_FORMANTS[sound])
        elif sound in _NOISES:
            low, high, loudness, voiced_share = _NOISES[sound]
            length = stop - start
            fade = np.hanning(length + 2)[1:-1] ** 0.5
            noise[start:stop] += loudness * rng.uniform(0.8, 1.2) * fade * _band_noise(rng, length, low, high)
            voicing[start:stop] = voiced_share
    t = np.arange(n)
    formants = np.stack([np.interp(t, keys, [f[i] for f in targets]) for i in range(3)]) * tract  # [3, n]
    f0 = pitch * np.linspace(rng.uniform(1.0, 1.08), rng.uniform(0.88, 0.96), n)
    f0 = f0 * (1 + 0.01 * np.sin(2 * np.pi * rng.uniform(4, 6) * t / SAMPLE_RATE))
    phase = 2 * np.pi * np.cumsum(f0) / SAMPLE_RATE
    harmonics = np.arange(1, int(7600 / f0.min()) + 1)[:, None]
    # The spectral envelope changes slowly: compute it every millisecond and interpolate in time.
    coarse = np.arange(0, n + _ENVELOPE_STEP, _ENVELOPE_STEP).clip(max=n - 1)
    freqs = harmonics * f0[None, coarse]  # [harmonic, coarse time]
    shape: np.ndarray = sum(
        gain * np.exp(-0.5 * ((freqs - formants[i][None, coarse]) / width) ** 2)
        for i, (gain, width) in enumerate(zip(_FORMANT_GAINS, _FORMANT_WIDTHS, strict=True))
    )
    shape = shape * (freqs < 7800) / np.sqrt(harmonics)
    step, rest = np.divmod(t, _ENVELOPE_STEP)
    frac = rest / _ENVELOPE_STEP
    envelope = shape[:, step] * (1 - frac) + shape[:, step + 1] * frac  # [harmonic, n]
    waves = np.sin(((harmonics * phase[None, :]) % (2 * np.pi)).astype(np.float32))
    voiced = np.sum(envelope * waves, axis=0, dtype=np.float64)
    voiced = voiced / (np.sqrt(np.mean(voiced**2)) + 1e-12)
    return _smooth(voicing, 0.01) * voiced + noise


def speak_digits(digits: Sequence[int], rng: np.random.Generator) -> np.ndarray:
    """A clip saying ``digits`` (float32 samples at 16 kHz, peak below 1, at most ``MAX_SECONDS``).

    Args:
        digits: The digits to say, two to four of them for clips that fit ``MAX_SECONDS``.
        rng: The random generator of the speaker and the small variations.

    Returns:
        float32 ``[samples]``.

    Raises:
        ValueError: If ``digits`` is empty, holds a value outside 0..9, or makes a clip longer than ``MAX_SECONDS``
            (more than about five digits).

    Example:
        ```python
        import numpy as np

        from ponente.trainer.data.synthetic_speech import SAMPLE_RATE, speak_digits

        clip = speak_digits([3, 1, 4], np.random.default_rng(0))
        assert clip.dtype == np.float32 and clip.size <= 2 * SAMPLE_RATE
        ```
    """
    if not digits or not all(0 <= d <= 9 for d in digits):
        raise ValueError(f"digits: expected one or more digits 0..9, got {list(digits)}")
    pitch = rng.uniform(95, 180)
    tract = rng.uniform(0.92, 1.08)
    parts = [np.zeros(int(rng.uniform(0.05, 0.15) * SAMPLE_RATE))]
    for d in digits:
        parts.append(rng.uniform(0.7, 1.0) * _speak_word(DIGITS[d], rng, pitch * rng.uniform(0.97, 1.03), tract))
        parts.append(np.zeros(int(rng.uniform(0.02, 0.08) * SAMPLE_RATE)))
    parts.append(np.zeros(int(rng.uniform(0.02, 0.1) * SAMPLE_RATE)))
    clip = np.concatenate(parts)
    if clip.size > MAX_SECONDS * SAMPLE_RATE:
        raise ValueError(f"{len(digits)} digits make a clip longer than {MAX_SECONDS} s; say at most 5")
    clip += rng.standard_normal(clip.size) * 10 ** (-rng.uniform(30, 40) / 20) * np.sqrt(np.mean(clip**2))
    return (clip * rng.uniform(0.3, 0.6) / np.max(np.abs(clip))).astype(np.float32)


def _write_wav(path: Path, samples: np.ndarray) -> None:
    """Mono 16-bit PCM at ``SAMPLE_RATE``."""
    pcm = np.round(np.clip(samples, -1, 1) * 32767).astype("<i2")
    with wave.open(str(path), "wb") as f:
        f.setnchannels(1)
        f.setsampwidth(2)
        f.setframerate(SAMPLE_RATE)
        f.writeframes(pcm.tobytes())


def _byte_alphabet() -> list[str]:
    """The byte-level BPE alphabet: the character of each byte 0..255, in the GPT-2/Whisper vocabulary order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: chr(b) for b in printable}
    others = [b for b in range(256) if b not in chars]
    chars.update({b: chr(256 + i) for i, b in enumerate(others)})
    return [chars[b] for b in [*printable, *others]]


def whisper_special_tokens() -> list[str]:
    """Whisper's special tokens in its order: end of text, start of transcript, languages, tasks, timestamps.

    Returns:
        ``["<|endoftext|>", "<|startoftranscript|>", "<|en|>", …, "<|translate|>", "<|transcribe|>",
        "<|startoflm|>", "<|startofprev|>", "<|nocaptions|>", "<|notimestamps|>", "<|0.00|>", …, "<|30.00|>"]``.
    """
    return [
        "<|endoftext|>",
        "<|startoftranscript|>",
        *[f"<|{code}|>" for code in WHISPER_LANGUAGES],
        "<|translate|>",
        "<|transcribe|>",
        "<|startoflm|>",
        "<|startofprev|>",
        "<|nocaptions|>",
        "<|notimestamps|>",
        *[f"<|{i * 0.02:.2f}|>" for i in range(1501)],
    ]


def _tokenizer_json() -> dict:
    """A byte-level BPE in which each digit word, with or without a leading space, is one token."""
    alphabet = _byte_alphabet()
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    merges: list[str] = []
    space = chr(256 + ord(" "))  # the byte-level character of " " ("Ġ": bytes 0..32 map to 256 + byte)
    # Spaced forms first: their merges all start with the space character, so they never split a bare word.
    for word in [space + w for w in DIGITS] + list(DIGITS):
        token = word[0]
        for ch in word[1:]:
            if token + ch not in vocab:
                merges.append(f"{token} {ch}")
                vocab[token + ch] = len(vocab)
            token += ch
    added = [
        {
            "id": len(vocab) + i,
            "content": token,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
        for i, token in enumerate(whisper_special_tokens())
    ]
    byte_level = {"add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", **byte_level},
        "post_processor": {"type": "ByteLevel", **byte_level, "trim_offsets": False},
        "decoder": {"type": "ByteLevel", **byte_level},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": vocab,
            "merges": merges,
        },
    }


def write_tokenizer(folder: str | os.PathLike[str]) -> Path:
    """Write the tiny Whisper tokenizer of the set to ``folder`` (``tokenizer.json`` + ``tokenizer_config.json``).

    A byte-level BPE (any text can be encoded) whose merges make each digit word one token, followed by
    Whisper's special tokens in Whisper's order (:func:`whisper_special_tokens`); about 1,900 tokens in all.

    Args:
        folder: Where to write (created if missing).

    Returns:
        The path of ``tokenizer.json``.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    spec = _tokenizer_json()
    path = folder / "tokenizer.json"
    path.write_text(json.dumps(spec, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    eos = "<|endoftext|>"
    config = {
        "tokenizer_class": "WhisperTokenizer",
        "bos_token": eos,
        "eos_token": eos,
        "unk_token": eos,
        "pad_token": eos,
        "model_max_length": 448,
        "vocab_size": len(spec["model"]["vocab"]) + len(spec["added_tokens"]),
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=1) + "\n", encoding="utf-8")
    return path


def write_synthetic_speech(
    out_dir: str | os.PathLike[str], *, train: int = 1000, validation: int = 100, seed: int = 0
) -> SyntheticSpeechFiles:
    """Write the synthetic spoken-digit set (clips, ``train.jsonl``/``validation.jsonl``, tokenizer) to ``out_dir``.

    Args:
        out_dir: The output folder (created if missing; files of the same names are overwritten).
        train: Number of training clips.
        validation: Number of validation clips.
        seed: Seed of the random digits, speakers and variations.

    Returns:
        The paths of the two jsonl files and of ``tokenizer.json``.

    Raises:
        ValueError: If a count is negative.
    """
    out = Path(out_dir)
    counts = {"train": train, "validation": validation}
    for name, count in counts.items():
        if count < 0:
            raise ValueError(f"--{name} must be >= 0, got {count}")
    (out / "clips").mkdir(parents=True, exist_ok=True)
    paths = {}
    for split_id, split in enumerate(_SPLITS):
        lines = []
        for i in range(counts[split]):
            rng = np.random.default_rng([seed, split_id, i])
            digits = rng.integers(0, 10, size=int(rng.integers(2, 5))).tolist()
            clip = f"clips/{split}-{i:05d}.wav"
            _write_wav(out / clip, speak_digits(digits, rng))
            lines.append(json.dumps({"audio": clip, "text": " ".join(DIGITS[d] for d in digits)}) + "\n")
        paths[split] = out / f"{split}.jsonl"
        paths[split].write_text("".join(lines), encoding="utf-8")
    tokenizer = write_tokenizer(out / "tokenizer")
    return SyntheticSpeechFiles(train=paths["train"], validation=paths["validation"], tokenizer=tokenizer)


@dataclass(frozen=True)
class SyntheticSpeechConfig:
    """The synthetic spoken-digit set a run trains on, written where the run reads it when it is not there yet.

    Attributes:
        out_dir: the folder of the set (``train.jsonl``, ``validation.jsonl``, ``clips/``, ``tokenizer/``).
        train: training clips.
        validation: validation clips.
        seed: seed of the random digits, speakers and variations.
    """

    out_dir: str = "ponente_speech/data"
    train: int = 1000
    validation: int = 100
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("train", "validation"):
            if getattr(self, name) < 0:
                raise ValueError(f"synthetic_data.{name}: must be >= 0, got {getattr(self, name)}")


def write_missing_synthetic_speech(config: SyntheticSpeechConfig, reads: Sequence[str]) -> SyntheticSpeechFiles | None:
    """Write the set of ``config`` into ``config.out_dir`` if the run reads from there and the set is incomplete.

    Args:
        config: the set.
        reads: the paths of the run's training data (``data.train_urls``); the set is written only when one of
            them lies in ``config.out_dir``, so a run pointed at other training data never writes it.

    Returns:
        The files written, or None when nothing was (the set is complete, or the run does not read it).
    """
    out = Path(config.out_dir).expanduser().resolve()
    inside = [p for p in reads if "://" not in p and Path(p).expanduser().resolve().is_relative_to(out)]
    missing = [out / name for name in _SET_FILES if not (out / name).is_file()]
    if not inside or not missing:
        return None
    logger.info(
        "%s is missing: writing the synthetic spoken-digit set (%d training and %d validation clips, seed %d) to %s; "
        "this takes about a minute, once",
        missing[0],
        config.train,
        config.validation,
        config.seed,
        out,
    )
    files = write_synthetic_speech(out, train=config.train, validation=config.validation, seed=config.seed)
    logger.info("wrote %s, %s, %s and the clips in %s", files.train, files.validation, files.tokenizer, out / "clips")
    return files


_SET_FILES = ("train.jsonl", "validation.jsonl", "tokenizer/tokenizer.json", "tokenizer/tokenizer_config.json")
"""The files of a complete set (:func:`write_synthetic_speech` writes the tokenizer last)."""


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m ponente.trainer.data.synthetic_speech OUT_DIR [--train N] [--validation M] [--seed S]``."""
    parser = argparse.ArgumentParser(
        prog="python -m ponente.trainer.data.synthetic_speech",
        description="Write a synthetic spoken-digit speech set (WAV clips, jsonl transcripts, a Whisper tokenizer).",
    )
    parser.add_argument("out_dir", help="output folder")
    parser.add_argument("--train", type=int, default=1000, help="training clips (default 1000)")
    parser.add_argument("--validation", type=int, default=100, help="validation clips (default 100)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    args = parser.parse_args(argv)
    files = write_synthetic_speech(args.out_dir, train=args.train, validation=args.validation, seed=args.seed)
    print(f"wrote {files.train}, {files.validation} and {files.tokenizer}")


if __name__ == "__main__":
    main()
