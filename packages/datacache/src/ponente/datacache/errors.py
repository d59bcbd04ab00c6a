"""Exceptions raised by ponente.datacache, the kinds of bad input the builder counts, and how commands report errors.

:class:`PonenteUserError` is the base of the errors a user causes and can fix, shared by every Ponente package
above this one; :func:`run_cli` is the one wrapper every console script (``ponente-cache`` and the trainer's)
runs its ``main`` in: one line ``error: <message>`` on stderr, exit status 2 for configuration errors and 1 for
other failures, a traceback only with ``--debug`` or ``PONENTE_DEBUG=1``.
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable, Sequence
from typing import Final

MALFORMED_JSON: Final = "malformed_json"
MISSING_FIELD: Final = "missing_field"
WRONG_TYPE: Final = "wrong_type"
INVALID_UTF8: Final = "invalid_utf8"
TRUNCATED_FILE: Final = "truncated_file"
UNREADABLE_PATH: Final = "unreadable_path"
EMPTY: Final = "empty"
BLANK_LINE: Final = "blank_line"
BAD_AUDIO: Final = "bad_audio"
BAD_PAIR: Final = "bad_pair"

BAD_RECORD_KINDS: Final = (
    MALFORMED_JSON,
    MISSING_FIELD,
    WRONG_TYPE,
    INVALID_UTF8,
    TRUNCATED_FILE,
    UNREADABLE_PATH,
    BAD_AUDIO,
    BAD_PAIR,
)
"""Kinds of bad input that the ``bad_records`` policy (``"error"`` or ``"skip"``) applies to."""

SKIP_KINDS: Final = (*BAD_RECORD_KINDS, EMPTY, BLANK_LINE)
"""Every kind counted in a ledger's ``skipped`` table (empty documents and blank lines are never errors)."""


class PonenteUserError(Exception):
    """Base class of the failures a user causes and can fix: a missing file, corrupt data, a bad setting.

    The message is one line naming what is at fault (the key, file, row or step). The console scripts print it
    as ``error: <message>`` on stderr, without a traceback, and exit with :attr:`exit_code`.

    Attributes:
        exit_code: The process exit status a console script returns for this error (1; 2 for configuration).
    """

    exit_code: int = 1


class PonenteConfigError(PonenteUserError, ValueError):
    """A configuration or command-line error: an unknown or missing key, a wrong type, a bad value (exit 2).

    The message starts with the dotted key or the option at fault.
    """

    exit_code = 2


class DataCacheError(PonenteUserError):
    """Base class of the errors of ponente.datacache (all of them user errors)."""


class BadRecordError(DataCacheError):
    """Bad input met under the ``bad_records="error"`` policy.

    Attributes:
        kind: One of :data:`BAD_RECORD_KINDS`.
        location: Where: the file (shard) name and the line or row.
    """

    def __init__(self, kind: str, location: str, detail: str) -> None:
        self.kind = kind
        self.location = location
        super().__init__(_bad_record_message(kind, location, detail))


def _bad_record_message(kind: str, location: str, detail: str) -> str:
    """One line saying what is wrong at ``location`` and the advice that fits the cause."""
    resumable = "The cache is left resumable: "
    if kind == UNREADABLE_PATH:
        # a file that cannot be opened is not a bad record: the fix is the path, not the skip policy
        if "No such file" in detail or "not found" in detail.lower():
            return f"no such file: {location}. {resumable}fix the input path and run again."
        return f"{location}: cannot read the file: {detail}. {resumable}check the path and its permissions."
    if kind == TRUNCATED_FILE:
        return (
            f"{location}: truncated or damaged file: {detail}. {resumable}replace the file and rebuild, or run "
            "again with bad_records='skip' (--bad-records skip) to keep the rows before the damage and count it."
        )
    return (
        f"{location}: {kind.replace('_', ' ')}: {detail}. {resumable}fix the input and rebuild, or run again "
        "with bad_records='skip' (--bad-records skip) to skip and count such records."
    )


class FingerprintMismatchError(DataCacheError):
    """A cache exists at the output location but was built from other inputs, processor or format."""


class CacheNotFoundError(DataCacheError, FileNotFoundError):
    """No cache (no ledger) exists at the given location."""


class CacheCorruptError(DataCacheError):
    """The stored bytes of a cache are damaged: a chunk's crc32c checksum does not match, or it does not decode.

    Raised before the data reaches the caller; the message names the cache location, the field and the shard
    file. ``ponente-cache verify LOCATION`` re-reads every chunk and lists all damage.
    """


class MissingExtraError(DataCacheError, ImportError):
    """An optional dependency is needed; the message names the extra to install."""


DEBUG_FLAG: Final = "--debug"
"""Command-line flag of every console script: print the traceback of an error (removed before parsing)."""

DEBUG_ENV: Final = "PONENTE_DEBUG"
"""Environment variable: ``1`` (or ``true``/``yes``) prints the traceback of an error, like ``--debug``."""

EXIT_FAILURE: Final = 1
"""Exit status of a failure that is not a configuration error (missing file, corrupt data, internal error)."""

EXIT_CONFIG: Final = 2
"""Exit status of a configuration or command-line error (bad, missing or unknown key, wrong type, bad value)."""

EXIT_INTERRUPTED: Final = 130
"""Exit status after Ctrl-C (``KeyboardInterrupt``) reached the command."""

_MAX_MESSAGE = 2000
# Failures a user can cause and fix without reading our code: the message is the whole story.
_USER_FAILURES: Final = (PonenteUserError, OSError, ValueError, ImportError)


def debug_requested(argv: Sequence[str] = ()) -> bool:
    """Whether tracebacks are wanted: ``--debug`` among ``argv`` or ``PONENTE_DEBUG`` set to a true value."""
    value = os.environ.get(DEBUG_ENV, "").strip().lower()
    return DEBUG_FLAG in argv or value in ("1", "true", "yes", "on")


def one_line(text: str) -> str:
    """``text`` on one line: its lines stripped and joined with spaces, cut to 2000 characters."""
    joined = " ".join(part.strip() for part in text.splitlines() if part.strip())
    return joined if len(joined) <= _MAX_MESSAGE else joined[: _MAX_MESSAGE - 3] + "..."


def _user_failure(exc: BaseException) -> BaseException | None:
    """``exc`` if it is a user failure, else the first user failure it was raised ``from`` (None: a bug)."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, _USER_FAILURES):
            return current
        seen.add(id(current))
        current = current.__cause__
    return None


def error_message(exc: BaseException) -> str:
    """The one line a command prints for ``exc`` (without the ``error:`` prefix).

    User failures (:class:`PonenteUserError`, ``OSError``, ``ValueError``, ``ImportError``, and any exception
    raised ``from`` one, like a background build's error) print their message; an ``OSError`` from the operating
    system reads ``<reason>: <path>`` (``no such file or directory: a.jsonl``). Anything else is a bug: its type
    is named and the line says how to see the traceback.
    """
    if isinstance(exc, OSError) and not isinstance(exc, PonenteUserError) and exc.strerror and exc.filename:
        reason = exc.strerror[0].lower() + exc.strerror[1:]
        target = f"{exc.filename} -> {exc.filename2}" if exc.filename2 else str(exc.filename)
        return one_line(f"{reason}: {target}")
    text = one_line(str(exc))
    if _user_failure(exc) is not None:
        return text or type(exc).__name__
    detail = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    return f"internal error ({detail}); run with {DEBUG_FLAG} for the traceback"


def exit_code(exc: BaseException) -> int:
    """The exit status of a command that failed with ``exc``: the ``exit_code`` of the user error it is (or was
    raised from; 2 for configuration errors), 130 for ``KeyboardInterrupt``, else 1."""
    if isinstance(exc, KeyboardInterrupt):
        return EXIT_INTERRUPTED
    code = getattr(_user_failure(exc) or exc, "exit_code", EXIT_FAILURE)
    return code if isinstance(code, int) and not isinstance(code, bool) and code > 0 else EXIT_FAILURE


def run_cli(
    main: Callable[[list[str]], int | None],
    argv: Sequence[str] | None = None,
    *,
    interrupted: str = "interrupted",
) -> int:
    """Run a console script's ``main`` and turn what it raises into one line on stderr and an exit status.

    ``--debug`` is removed from the arguments before ``main`` sees them. An exception prints
    ``error: <one line>`` on stderr (preceded by the traceback with ``--debug`` or ``PONENTE_DEBUG=1``) and gives
    exit status 2 for a configuration error (:class:`PonenteConfigError`, e.g. the trainer's ``ConfigError``),
    1 for any other failure, 130 for Ctrl-C. ``SystemExit`` (``--help``, argparse usage errors) passes through.

    Args:
        main: the command: takes the arguments (without ``--debug``), returns its exit status (None: 0).
        argv: the arguments (None: ``sys.argv[1:]``).
        interrupted: the line printed after Ctrl-C.

    Returns:
        The exit status.

    Example:
        >>> def main(args: list[str]) -> int:
        ...     raise FileNotFoundError(f"no such file: {args[0]}")
        >>> run_cli(main, ["a.jsonl"])  # prints "error: no such file: a.jsonl" on stderr
        1
    """
    args = list(sys.argv[1:] if argv is None else argv)
    debug = debug_requested(args)
    args = [arg for arg in args if arg != DEBUG_FLAG]
    try:
        return int(main(args) or 0)
    except KeyboardInterrupt:
        if debug:
            traceback.print_exc()
        print(interrupted, file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as exc:
        if debug:
            traceback.print_exc()
        sys.stdout.flush()
        print(f"error: {error_message(exc)}", file=sys.stderr)
        return exit_code(exc)
