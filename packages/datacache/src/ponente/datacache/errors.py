"""Exceptions raised by ponente.datacache, and the kinds of bad input the builder counts."""

from __future__ import annotations

from typing import Final

MALFORMED_JSON: Final = "malformed_json"
MISSING_FIELD: Final = "missing_field"
WRONG_TYPE: Final = "wrong_type"
INVALID_UTF8: Final = "invalid_utf8"
TRUNCATED_FILE: Final = "truncated_file"
UNREADABLE_PATH: Final = "unreadable_path"
EMPTY: Final = "empty"
BLANK_LINE: Final = "blank_line"

BAD_RECORD_KINDS: Final = (MALFORMED_JSON, MISSING_FIELD, WRONG_TYPE, INVALID_UTF8, TRUNCATED_FILE, UNREADABLE_PATH)
"""Kinds of bad input that the ``bad_records`` policy (``"error"`` or ``"skip"``) applies to."""

SKIP_KINDS: Final = (*BAD_RECORD_KINDS, EMPTY, BLANK_LINE)
"""Every kind counted in a ledger's ``skipped`` table (empty documents and blank lines are never errors)."""


class DataCacheError(Exception):
    """Base class of the errors of ponente.datacache."""


class BadRecordError(DataCacheError):
    """Bad input met under the ``bad_records="error"`` policy.

    Attributes:
        kind: One of :data:`BAD_RECORD_KINDS`.
        location: Where: the file (shard) name and the line or row.
    """

    def __init__(self, kind: str, location: str, detail: str) -> None:
        self.kind = kind
        self.location = location
        super().__init__(
            f"{location}: {kind.replace('_', ' ')}: {detail}. The cache is left resumable: fix the input and "
            "rebuild, or run again with bad_records='skip' (--bad-records skip) to skip and count such records."
        )


class FingerprintMismatchError(DataCacheError):
    """A cache exists at the output location but was built from other inputs, processor or format."""


class CacheNotFoundError(DataCacheError, FileNotFoundError):
    """No cache (no ledger) exists at the given location."""


class MissingExtraError(DataCacheError, ImportError):
    """An optional dependency is needed; the message names the extra to install."""
