"""Where data lives: local paths and object-store URLs (``s3://``, ``gs://``) for TensorStore and fsspec.

Caches and checkpoints are written through TensorStore key-value stores; input files and exports go through
fsspec. Both read the standard environment of each store, so one set of variables configures both:

* ``s3://bucket/path``: ``AWS_ENDPOINT_URL_S3`` (or ``AWS_ENDPOINT_URL``) for an S3-compatible server other
  than AWS, ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` (/ ``AWS_SESSION_TOKEN``),
  ``AWS_REGION`` / ``AWS_DEFAULT_REGION``. fsspec needs the ``s3`` extra (``s3fs``).
* ``gs://bucket/path``: Google application-default credentials; ``STORAGE_EMULATOR_HOST`` or
  ``GCS_ENDPOINT`` for an emulator. fsspec needs the ``gcs`` extra (``gcsfs``).

This module never imports JAX: the cache builder and the trainer's checkpoints share it.
"""

from __future__ import annotations

import os
import re
from typing import Any

from .errors import PonenteUserError

__all__ = ["StorageError", "check_access", "filesystem", "is_remote", "kvstore_spec", "storage_error"]

_EXTRAS = {"s3": ("s3fs", "s3"), "gs": ("gcsfs", "gcs"), "gcs": ("gcsfs", "gcs")}
"""URL scheme -> (the fsspec implementation it needs, the ponente extra that installs it)."""

_REMOTE = ("s3", "gs")


class StorageError(PonenteUserError):
    """An object store refused an operation: no such bucket, credentials refused, a missing fsspec extra.

    The message is one line naming the URL.
    """


def _split(url: str) -> tuple[str, str]:
    scheme, sep, rest = str(url).partition("://")
    return (scheme, rest) if sep else ("", str(url))


def is_remote(url: str | os.PathLike[str]) -> bool:
    """Whether ``url`` is on an object store (``s3://`` or ``gs://``)."""
    return _split(os.fspath(url))[0] in _REMOTE


def _s3_spec(bucket: str, path: str) -> dict[str, Any]:
    spec: dict[str, Any] = {"driver": "s3", "bucket": bucket, "path": path}
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if endpoint:
        spec["endpoint"] = endpoint
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    if region:
        spec["aws_region"] = region
    if os.environ.get("AWS_ACCESS_KEY_ID") and os.environ.get("AWS_SECRET_ACCESS_KEY"):
        # keys in the environment: use them, without the default chain's search for ~/.aws profile files
        # (which logs an error line per missing file)
        spec["aws_credentials"] = {"type": "environment"}
    return spec


def _gcs_spec(bucket: str, path: str) -> dict[str, Any]:
    emulator = os.environ.get("GCS_ENDPOINT") or os.environ.get("STORAGE_EMULATOR_HOST")
    if emulator and "TENSORSTORE_GCS_HTTP_URL" not in os.environ:
        # TensorStore's gcs driver has no endpoint member in its spec: it reads this variable
        os.environ["TENSORSTORE_GCS_HTTP_URL"] = emulator if "://" in emulator else f"http://{emulator}"
    return {"driver": "gcs", "bucket": bucket, "path": path}


def kvstore_spec(url: str | os.PathLike[str], *, what: str = "location") -> dict[str, Any]:
    """The TensorStore kvstore spec of a location, as a directory (its ``path`` ends with ``/``).

    The cache store (``ponente.datacache.store``) and the trainer's checkpoints both open their
    locations through this function, so an object-store endpoint set in the environment applies to both.

    Args:
        url: A local path, ``file://path``, ``memory://name``, ``s3://bucket/path`` or ``gs://bucket/path``.
        what: What the location is for, in the error message (e.g. ``"cache location"``).

    Returns:
        The spec: ``{"driver": "file", "path": "/abs/path/"}``, ``{"driver": "memory", ...}``,
        ``{"driver": "s3", "bucket": ..., "path": ..., "endpoint": ..., "aws_region": ...}`` (endpoint and
        region only when set in the environment) or ``{"driver": "gcs", "bucket": ..., "path": ...}``.

    Raises:
        ValueError: For any other URL scheme, or an ``s3://``/``gs://`` URL without a bucket.

    Example:
        >>> kvstore_spec("gs://bucket/caches/train")
        {'driver': 'gcs', 'bucket': 'bucket', 'path': 'caches/train/'}
    """
    text = os.fspath(url)
    scheme, rest = _split(text)
    if scheme in ("", "file"):
        return {"driver": "file", "path": os.path.abspath(rest).rstrip("/") + "/"}
    if scheme == "memory":
        return {"driver": "memory", "path": rest.strip("/") + "/"}
    if scheme in _REMOTE:
        bucket, _, path = rest.partition("/")
        if not bucket:
            raise ValueError(f"{text!r} names no bucket: use {scheme}://BUCKET/PATH")
        path = path.strip("/") + "/" if path.strip("/") else ""
        return _s3_spec(bucket, path) if scheme == "s3" else _gcs_spec(bucket, path)
    raise ValueError(f"unsupported {what} {text!r}: use a local path, memory://, gs:// or s3://")


def filesystem(url: str | os.PathLike[str]) -> tuple[Any, str]:
    """The fsspec filesystem of ``url`` and the path within it (``fsspec.core.url_to_fs``).

    Raises:
        StorageError: ``url`` needs an fsspec implementation that is not installed (the message names the
            ponente extra that installs it, e.g. ``pip install 'ponente-datacache[s3]'``).
    """
    import fsspec

    text = os.fspath(url)
    scheme = _split(text)[0]
    try:
        return fsspec.core.url_to_fs(text)
    except ImportError as e:
        module, extra = _EXTRAS.get(scheme, (None, None))
        if module is None:
            raise StorageError(f"{text}: the {scheme}:// filesystem is not available ({e})") from e
        raise StorageError(
            f"{text}: {scheme}:// paths need {module}: pip install 'ponente-datacache[{extra}]' "
            f"(or 'ponente-trainer[{extra}]')"
        ) from e


_CAUSES = (
    (re.compile(r"NoSuchBucket|bucket does not exist"), "the bucket does not exist"),
    (
        re.compile(r"InvalidAccessKeyId|SignatureDoesNotMatch|ExpiredToken|InvalidToken|UNAUTHENTICATED"),
        "the credentials were refused",
    ),
    (re.compile(r"AccessDenied|PERMISSION_DENIED|Forbidden|403"), "access denied (check the credentials)"),
    (re.compile(r"UNAVAILABLE|Connection refused|Could not resolve|Couldn't connect"), "the store is unreachable"),
)


def storage_error(url: str | os.PathLike[str], exc: BaseException, action: str = "accessing") -> StorageError | None:
    """A one-line :class:`StorageError` for an object-store failure ``exc``, or None if it is not one.

    TensorStore reports object-store errors as ``ValueError`` with the HTTP response attached; this
    keeps the cause (no such bucket, credentials refused, access denied, unreachable) and the URL.

    Args:
        url: The location that was being accessed (named in the message).
        exc: The exception TensorStore or fsspec raised.
        action: What was being done, e.g. ``"writing checkpoint"``.
    """
    text = str(exc)
    if isinstance(exc, PermissionError):
        return StorageError(f"{action} {os.fspath(url)}: access denied (check the credentials)")
    for pattern, cause in _CAUSES:
        if pattern.search(text):
            return StorageError(f"{action} {os.fspath(url)}: {cause}")
    return None


def check_access(url: str | os.PathLike[str]) -> None:
    """Fail fast, with one line naming ``url``, if an object store refuses to list it.

    Local and ``memory://`` locations are not checked. An ``s3://`` bucket that does not exist, credentials
    the store refuses, or an unreachable endpoint raise :class:`StorageError` before any slow work starts.

    Raises:
        StorageError: The store refused or could not be reached.
    """
    if not is_remote(url):
        return
    import tensorstore as ts

    spec = kvstore_spec(url)
    try:
        store = ts.KvStore.open(spec).result()
        # listing an S3 bucket that does not exist is an error, unlike reading a key of it
        store.list(ts.KvStore.KeyRange("", "\x00")).result()
    except ValueError as e:
        raise storage_error(url, e) or StorageError(f"accessing {os.fspath(url)}: {_first_line(e)}") from e


def _first_line(exc: BaseException) -> str:
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return text.split(" [")[0]
