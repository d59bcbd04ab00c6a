"""Caches on object stores: ``s3://`` against a real S3 API served locally (moto), ``gs://`` by spec only.

The S3 tests build a cache whose inputs and output are both in the bucket and compare every row with a
local build of the same files; the error tests check that a missing bucket, refused credentials and a
missing ``s3fs`` each give one line naming the URL.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import numpy as np
import pytest
import tensorstore as ts
from s3_support import S3Bucket, s3_bucket_fixture  # noqa: F401  (the s3_bucket fixture)

from ponente.datacache import build_cache, open_cache
from ponente.datacache.storage import StorageError, check_access, filesystem, kvstore_spec, storage_error
from ponente.datacache.store import kvstore_spec as store_kvstore_spec


def test_s3_spec_takes_endpoint_region_and_keys_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://127.0.0.1:9")
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://ignored:1")
    monkeypatch.setenv("AWS_REGION", "eu-west-3")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")
    spec = kvstore_spec("s3://bucket/caches/train/")
    assert spec == {
        "driver": "s3",
        "bucket": "bucket",
        "path": "caches/train/",
        "endpoint": "http://127.0.0.1:9",
        "aws_region": "eu-west-3",
        "aws_credentials": {"type": "environment"},
    }
    assert store_kvstore_spec("s3://bucket/caches/train") == spec  # the cache store uses the same function
    ts.KvStore.Spec(spec)  # TensorStore accepts it

    monkeypatch.delenv("AWS_ENDPOINT_URL_S3")
    monkeypatch.delenv("AWS_REGION")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-west-2")
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    spec = kvstore_spec("s3://bucket")
    assert spec == {
        "driver": "s3",
        "bucket": "bucket",
        "path": "",
        "endpoint": "http://ignored:1",
        "aws_region": "us-west-2",
    }


def test_gs_spec_and_emulator(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TENSORSTORE_GCS_HTTP_URL", raising=False)
    monkeypatch.delenv("GCS_ENDPOINT", raising=False)
    monkeypatch.delenv("STORAGE_EMULATOR_HOST", raising=False)
    assert kvstore_spec("gs://bucket/some/dir") == {"driver": "gcs", "bucket": "bucket", "path": "some/dir/"}
    ts.KvStore.Spec(kvstore_spec("gs://bucket/some/dir"))
    import os

    assert "TENSORSTORE_GCS_HTTP_URL" not in os.environ
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", "localhost:4443")
    kvstore_spec("gs://bucket/x")
    assert os.environ["TENSORSTORE_GCS_HTTP_URL"] == "http://localhost:4443"


def test_local_memory_and_bad_locations(tmp_path: Path) -> None:
    assert kvstore_spec(tmp_path / "c") == {"driver": "file", "path": f"{tmp_path}/c/"}
    assert kvstore_spec(f"file://{tmp_path}/c/") == {"driver": "file", "path": f"{tmp_path}/c/"}
    assert kvstore_spec("memory://a/b") == {"driver": "memory", "path": "a/b/"}
    with pytest.raises(ValueError, match="ftp://x"):
        kvstore_spec("ftp://x")
    with pytest.raises(ValueError, match="names no bucket"):
        kvstore_spec("s3:///path")


def test_s3_path_without_s3fs_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    import fsspec  # noqa: F401

    implementations = sys.modules["fsspec.registry"]._registry  # the classes fsspec has already imported
    monkeypatch.setitem(sys.modules, "s3fs", None)  # import s3fs -> ImportError
    monkeypatch.delitem(implementations, "s3", raising=False)
    monkeypatch.delitem(implementations, "s3a", raising=False)
    with pytest.raises(StorageError) as info:
        filesystem("s3://bucket/train.jsonl")
    message = str(info.value)
    assert "\n" not in message
    assert "s3://bucket/train.jsonl" in message
    assert "ponente-datacache[s3]" in message


class _Refuse(BaseHTTPRequestHandler):
    """An S3 endpoint that refuses every request's credentials."""

    def _refuse(self) -> None:
        body = b"<?xml version='1.0'?><Error><Code>InvalidAccessKeyId</Code><Message>no such key</Message></Error>"
        self.send_response(403)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    do_GET = do_PUT = do_HEAD = do_POST = do_DELETE = _refuse

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def refusing_endpoint(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    server = HTTPServer(("127.0.0.1", 0), _Refuse)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    endpoint = f"http://127.0.0.1:{server.server_port}"
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "wrong")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    yield endpoint
    server.shutdown()


def test_refused_credentials_are_one_line_naming_the_url(refusing_endpoint: str) -> None:
    with pytest.raises(StorageError) as info:
        check_access("s3://ponente-test/caches/train")
    assert str(info.value) == "accessing s3://ponente-test/caches/train: the credentials were refused"
    # the same translation applies to what TensorStore raises during a write
    store = ts.KvStore.open(kvstore_spec("s3://ponente-test/caches/train")).result()
    with pytest.raises(ValueError) as raw:
        store.write("x", b"1").result()
    assert "\n" in str(raw.value) or "http_response" in str(raw.value)  # what a user would see without it
    error = storage_error("s3://ponente-test/caches/train", raw.value, "writing")
    assert error is not None
    assert str(error) == "writing s3://ponente-test/caches/train: the credentials were refused"
    assert storage_error("s3://b/x", ValueError("Invalid shape")) is None  # other errors are not object-store ones


@pytest.mark.integration
def test_missing_bucket_is_one_line_naming_the_url(s3_bucket: S3Bucket) -> None:
    check_access(s3_bucket.url("caches/train"))  # the existing bucket passes
    with pytest.raises(StorageError) as info:
        check_access("s3://no-such-bucket/caches/train")
    assert str(info.value) == "accessing s3://no-such-bucket/caches/train: the bucket does not exist"
    check_access("/nonexistent/local/dir")  # local locations are not checked here


@pytest.mark.integration
def test_build_on_s3_from_s3_inputs_matches_a_local_build(
    s3_bucket: S3Bucket, tmp_path: Path, tokenizer_path: Path, write_jsonl: object, helpers: type
) -> None:
    docs = [helpers.make_documents(40, seed=1), helpers.make_documents(30, seed=2)]  # type: ignore[attr-defined]
    local_inputs = [write_jsonl(f"part-{i}.jsonl", d) for i, d in enumerate(docs)]  # type: ignore[operator]
    fs, _ = filesystem(s3_bucket.url())
    for path in local_inputs:
        fs.put_file(str(path), f"{s3_bucket.bucket}/raw/{path.name}")

    options = {"tokenizer": tokenizer_path, "workers": 0, "progress": False, "batch_rows": 16, "eos": "<eos>"}
    reference = build_cache([str(p) for p in local_inputs], tmp_path / "local", **options)  # type: ignore[arg-type]
    location = s3_bucket.url("caches/train")
    built = build_cache([s3_bucket.url("raw/part-{0,1}.jsonl")], location, **options)  # type: ignore[arg-type]

    # the cache lives in the bucket (boto3 lists it, independently of TensorStore)
    keys = s3_bucket.keys("caches/train/")
    assert any(k.startswith("caches/train/input_ids/data/") for k in keys), keys
    assert not (tmp_path / "caches").exists()

    reopened = open_cache(location)
    assert len(reference) == len(built) == len(reopened) == 70
    expected = reference.get_batch(range(len(reference)))
    for cache in (built, reopened):
        got = cache.get_batch(range(len(cache)))
        for want, row in zip(expected, got, strict=True):
            assert want.keys() == row.keys()
            for name in want:
                np.testing.assert_array_equal(row[name], want[name])
