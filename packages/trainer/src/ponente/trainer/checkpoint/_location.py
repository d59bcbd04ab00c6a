"""Where checkpoints live: local paths and tensorstore URLs turned into key-value stores.

Every file operation of the checkpoint module (arrays, the commit marker, listing, deleting) goes
through a tensorstore key-value store, so a local directory, ``memory://`` and ``gs://`` behave the
same way and one protocol (write the marker last) covers them all. ``s3://`` and ``gs://`` locations
take their endpoint and credentials from the environment, like the data caches
(:func:`ponente.datacache.storage.kvstore_spec`).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import tensorstore as ts

from ponente.datacache import storage

# Resources shared by every checkpoint operation of this process; above all the ``memory://`` store,
# which must outlive the single open that wrote it.
_ROOT_CONTEXT = ts.Context()

_SCHEMES = ("file", "memory", "gs", "s3")

PathLike = str | os.PathLike[str]
"""A checkpoint location: a local path or a tensorstore URL (``memory://``, ``gs://``, ``s3://``)."""


def context() -> ts.Context:
    """A fresh tensorstore context: new caches, but the process-wide ``memory://`` store.

    Fresh caches per operation mean a checkpoint deleted and rewritten at the same path is never read
    through a stale cached manifest.
    """
    return ts.Context({"cache_pool": {}, "data_copy_concurrency": {}, "file_io_concurrency": {}}, parent=_ROOT_CONTEXT)


def normalize(path: PathLike) -> str:
    """``path`` without a trailing slash; local paths made absolute (``file://`` prefix dropped)."""
    text = os.fspath(path)
    if text.startswith("file://"):
        text = text[len("file://") :]
    scheme, sep, _ = text.partition("://")
    if sep:
        if scheme not in _SCHEMES:
            raise ValueError(
                f"unsupported checkpoint location {text!r}: scheme {scheme!r} is not one of "
                f"{', '.join(s + '://' for s in _SCHEMES)} or a local path"
            )
        return text.rstrip("/") if text.rstrip("/") != f"{scheme}:/" else f"{scheme}://"
    return os.path.abspath(text)


def join(path: str, *parts: str) -> str:
    """Join ``parts`` to a normalized location with ``/``."""
    out = path
    for part in parts:
        out = out + part if out.endswith("/") else f"{out}/{part}"
    return out


def is_local(path: str) -> bool:
    """Whether a normalized location is a local directory."""
    return "://" not in path


def kvstore_spec(path: str) -> dict[str, Any]:
    """The tensorstore kvstore spec of a normalized location, as a directory (path ends with ``/``).

    Object-store endpoints and credentials come from the environment (``AWS_ENDPOINT_URL_S3``, ``AWS_REGION``,
    ...): see :func:`ponente.datacache.storage.kvstore_spec`, which the data caches use too.
    """
    return storage.kvstore_spec(path)


def open_kvstore(path: str, ctx: ts.Context | None = None) -> ts.KvStore:
    """Open the key-value store rooted at a normalized location."""
    return ts.KvStore.open(kvstore_spec(path), context=ctx if ctx is not None else context()).result()


@contextlib.contextmanager
def remote_errors(path: str, action: str) -> Iterator[None]:
    """Turn an object store's refusal (no such bucket, credentials refused) into one line naming ``path``.

    Raises:
        ponente.datacache.storage.StorageError: The store refused the operation; other errors pass unchanged.
    """
    try:
        yield
    except ValueError as e:
        if is_local(path):
            raise
        error = storage.storage_error(path, e, action)
        if error is None:
            raise
        raise error from e


def read_bytes(path: str, key: str) -> bytes | None:
    """The value stored under ``key`` in the directory ``path``, or None if there is none."""
    with remote_errors(path, "reading"):
        result = open_kvstore(path).read(key).result()
    if result.state != "value":
        return None
    return bytes(result.value)


def write_bytes(path: str, key: str, value: bytes) -> None:
    """Store ``value`` under ``key`` in the directory ``path``; atomic on every supported store.

    The file driver writes a temporary file and renames it into place; object stores (GCS, S3) and
    the memory store replace a value in one operation.
    """
    with remote_errors(path, "writing"):
        open_kvstore(path).write(key, value).result()


def delete_key(path: str, key: str) -> None:
    """Delete ``key`` in the directory ``path``; a missing key is not an error."""
    with remote_errors(path, "deleting from"):
        open_kvstore(path).delete_range(ts.KvStore.KeyRange(key, key + "\x00")).result()


def list_keys(path: str) -> list[str]:
    """All keys below the directory ``path`` (recursively), relative to it."""
    with remote_errors(path, "listing"):
        return [k.decode() for k in open_kvstore(path).list().result()]


def delete_tree(path: str) -> None:
    """Delete the directory ``path`` and everything below it; a missing directory is not an error."""
    with remote_errors(path, "deleting"):
        open_kvstore(path).delete_range(ts.KvStore.KeyRange()).result()
    if is_local(path):
        # the file driver deletes files but leaves their (now empty) directories behind
        for root, dirs, _files in os.walk(path, topdown=False):
            for d in dirs:
                with contextlib.suppress(OSError):
                    os.rmdir(os.path.join(root, d))
        with contextlib.suppress(OSError):
            os.rmdir(path)
