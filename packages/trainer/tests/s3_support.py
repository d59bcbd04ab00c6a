"""The ``s3_bucket`` fixture: a local S3 server (moto) with one bucket, the AWS environment pointed at it.

Import it into a test module with ``from s3_support import s3_bucket_fixture`` (see ``ponente.datacache.testing``).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from ponente.datacache.testing import S3Bucket, local_s3_bucket

BUCKET = "ponente-test"


@pytest.fixture(name="s3_bucket")
def s3_bucket_fixture(monkeypatch: pytest.MonkeyPatch) -> Iterator[S3Bucket]:
    """A moto S3 server on a free local port with one empty bucket; the AWS environment points at it."""
    with local_s3_bucket(monkeypatch.setenv, monkeypatch.delenv, bucket=BUCKET) as bucket:
        yield bucket
