"""The ``ponente-cache`` command: build, inspect and verify caches.

.. code-block:: text

    ponente-cache build --output DIR --tokenizer TOK [--text-key text] [--backend local|ray] [--workers N]
                        [--bad-records error|skip] INPUT...
    ponente-cache info DIR
    ponente-cache verify DIR

Every subcommand accepts ``--debug`` (or ``PONENTE_DEBUG=1``): print the traceback of an error. Without it an
error is one line ``error: <message>`` on stderr; the exit status is 1 (2 for a usage error, 130 for Ctrl-C).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from collections.abc import Sequence

from ponente.datacache.backends import BACKENDS
from ponente.datacache.builder import BAD_RECORD_POLICIES, build_cache
from ponente.datacache.errors import run_cli
from ponente.datacache.source import FORMATS, expand_inputs
from ponente.datacache.store import open_cache
from ponente.datacache.verify import verify_cache


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ponente-cache", description="Build, inspect and verify token caches.")
    sub = parser.add_subparsers(dest="command", required=True)
    build = sub.add_parser(
        "build", help="build or resume a cache", description=(build_cache.__doc__ or "").split("\n")[0]
    )
    build.add_argument("inputs", nargs="+", metavar="INPUT", help="paths, globs or URLs (brace expansion allowed)")
    build.add_argument("--output", "-o", required=True, help="cache location (directory, memory://, gs://, s3://)")
    build.add_argument("--tokenizer", required=True, help="tokenizer.json, a directory containing one, or a hub id")
    build.add_argument("--text-key", default="text", help="record field holding the text (default: text)")
    build.add_argument("--backend", choices=BACKENDS, default="local", help="default: local")
    build.add_argument("--workers", type=int, default=None, help="workers (0: in process; default: CPU count)")
    build.add_argument("--bad-records", choices=BAD_RECORD_POLICIES, default="error", help="default: error")
    build.add_argument("--keep-empty", action="store_true", help="keep empty documents as rows")
    build.add_argument("--rebuild", action="store_true", help="delete an existing cache at --output first")
    build.add_argument("--txt-mode", choices=("file", "line"), default="file", help="documents of .txt files")
    build.add_argument("--format", choices=FORMATS, default=None, help="force the input format")
    build.add_argument("--bos", default=None, help="token to put before every document")
    build.add_argument("--eos", default=None, help="token to put after every document")
    build.add_argument("--no-progress", action="store_true", help="no progress bar")
    info = sub.add_parser("info", help="rows, tokens, shards, state, skipped records, fingerprint")
    info.add_argument("location", metavar="DIR")
    info.add_argument("--json", action="store_true", help="print the whole ledger as JSON")
    verify = sub.add_parser("verify", help="re-read everything; exit 1 on damage")
    verify.add_argument("location", metavar="DIR")
    return parser


def _check_inputs(inputs: list[str]) -> list[str]:
    """The files of ``inputs`` (globs and braces expanded), each local one checked to exist before any work."""
    names = expand_inputs(inputs)
    for name in names:
        if "://" in name and not name.startswith("file://"):
            continue  # remote: opened (and reported) by the builder
        local = name.removeprefix("file://")
        if not os.path.exists(local):
            raise FileNotFoundError(f"no such file: {name} (INPUT)")
        if os.path.isdir(local):
            raise IsADirectoryError(f"{name} is a folder, not a data file (INPUT); use a glob like {name}/*.jsonl")
    return names


def _build(args: argparse.Namespace) -> int:
    _check_inputs(args.inputs)
    cache = build_cache(
        args.inputs,
        args.output,
        tokenizer=args.tokenizer,
        text_key=args.text_key,
        bos=args.bos,
        eos=args.eos,
        backend=args.backend,
        workers=args.workers,
        bad_records=args.bad_records,
        keep_empty=args.keep_empty,
        rebuild=args.rebuild,
        txt_mode=args.txt_mode,
        format=args.format,
        progress=not args.no_progress,
    )
    ledger = cache.ledger
    skipped = sum(ledger.skipped.values())
    print(f"built {args.output}: {ledger.rows} rows, {ledger.lengths} elements, {skipped} records skipped")
    return 0


def _info(args: argparse.Namespace) -> int:
    cache = open_cache(args.location)
    ledger = cache.ledger
    if args.json:
        print(ledger.to_bytes().decode("utf-8"), end="")
        return 0
    done = sum(s.finished for s in ledger.shards)
    print(f"cache:       {args.location}")
    print(f"state:       {'finished' if ledger.finished else 'not finished (building or interrupted)'}")
    print(f"rows:        {ledger.rows}")
    for field, length in ledger.lengths.items():
        print(f"tokens:      {length} ({field}, {ledger.fields[field]})")
    print(f"shards:      {len(ledger.shards)} ({done} finished)")
    skipped = ", ".join(f"{k}={v}" for k, v in sorted(ledger.skipped.items())) or "none"
    print(f"skipped:     {skipped}")
    for example in ledger.skip_examples[:5]:
        print(f"             {example}")
    print(f"fingerprint: {ledger.fingerprint}")
    print(f"processor:   {json.dumps(ledger.fingerprint_parts.get('processor'), sort_keys=True)}")
    print(f"format:      version {ledger.format_version}")
    return 0


def _verify(args: argparse.Namespace) -> int:
    problems = verify_cache(args.location)
    for problem in problems:
        print(f"DAMAGED: {problem}")
    if problems:
        return 1
    cache = open_cache(args.location)
    print(f"ok: {args.location}: {len(cache)} rows verified")
    return 0


def _run(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    return {"build": _build, "info": _info, "verify": _verify}[args.command](args)


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``ponente-cache``; return the exit status (0 ok, 1 error or damage, 2 usage, 130 Ctrl-C).

    Errors print one line ``error: <message>`` on stderr; ``--debug`` (or ``PONENTE_DEBUG=1``) adds the traceback.
    """
    return run_cli(
        _run, argv, interrupted="interrupted: the cache is left resumable; run the same command again to continue"
    )


if __name__ == "__main__":
    raise SystemExit(main())
