"""Test helpers: a real S3 API served locally (moto) with one bucket, and a time limit for fuzzed examples.

Needs ``moto[server]`` and ``boto3`` (in the ``test`` extras). Nothing goes to the network: the standard AWS
environment (``AWS_ENDPOINT_URL_S3``, keys, region) is pointed at the local server, so TensorStore, s3fs and any
subprocess a test starts all reach it. A pytest fixture is three lines::

    @pytest.fixture(name="s3_bucket")
    def s3_bucket_fixture(monkeypatch):
        with local_s3_bucket(monkeypatch.setenv, monkeypatch.delenv) as bucket:
            yield bucket
"""

from __future__ import annotations

import contextlib
import signal
import socket
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

__all__ = ["Hung", "S3Bucket", "local_s3_bucket", "time_limit"]


@dataclass(frozen=True)
class S3Bucket:
    """A bucket on a local S3 server.

    Attributes:
        endpoint: ``http://127.0.0.1:PORT``.
        bucket: The bucket name (created empty).
    """

    endpoint: str
    bucket: str

    def url(self, path: str = "") -> str:
        """``s3://<bucket>/<path>``."""
        return f"s3://{self.bucket}/{path.lstrip('/')}"

    def keys(self, prefix: str = "") -> list[str]:
        """Every object key under ``prefix`` (read with boto3, independently of TensorStore and s3fs)."""
        import boto3

        client = boto3.client("s3", endpoint_url=self.endpoint)
        pages = client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix)
        return sorted(item["Key"] for page in pages for item in page.get("Contents", []))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _forget_s3fs() -> None:
    """Drop s3fs's cached filesystems (keyed by arguments, not endpoint) so none points at an old server."""
    try:
        import s3fs
    except ImportError:
        return
    s3fs.S3FileSystem.clear_instance_cache()


@contextlib.contextmanager
def local_s3_bucket(
    setenv: Callable[[str, str], None], delenv: Callable[..., None], *, bucket: str = "ponente-test"
) -> Iterator[S3Bucket]:
    """Serve S3 on a free local port (moto), create ``bucket``, and point the AWS environment at it.

    Args:
        setenv: sets an environment variable for the test (e.g. ``monkeypatch.setenv``, which undoes it).
        delenv: removes one (e.g. ``monkeypatch.delenv``; called with ``raising=False``).
        bucket: the bucket to create.

    Yields:
        The bucket; the server stops when the block ends.
    """
    import boto3
    from moto.server import ThreadedMotoServer

    port = _free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    for name, value in {
        "AWS_ENDPOINT_URL_S3": endpoint,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_REGION": "us-east-1",
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        setenv(name, value)
    for name in ("AWS_ENDPOINT_URL", "AWS_PROFILE", "AWS_SESSION_TOKEN"):
        delenv(name, raising=False)
    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=bucket)
    _forget_s3fs()
    try:
        yield S3Bucket(endpoint, bucket)
    finally:
        _forget_s3fs()
        server.stop()


class Hung(Exception):  # noqa: N818 -- a test outcome, named as the tests read it
    """A block ran longer than its :func:`time_limit`."""


@contextlib.contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Raise :class:`Hung` in the main thread if the block runs longer than ``seconds`` (``SIGALRM``; POSIX).

    Fuzz tests wrap each example in it, so an input that makes a parser hang fails the test instead of the run.
    """

    def on_alarm(signum: int, frame: Any) -> None:
        raise Hung(f"example ran longer than {seconds} s")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
