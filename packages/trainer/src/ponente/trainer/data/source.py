"""The source stage of the data pipeline: where the splits of a corpus come from (files or a Hugging Face dataset)
and where their caches live. Pure descriptions; the builder opens them."""

from __future__ import annotations

import os
import posixpath

from ponente.datacache import HFSource
from ponente.trainer.data.cache_build import resolve_url

__all__ = ["SPLITS", "SplitSources", "check_shuffle", "join_path"]

SPLITS = ("train", "validation")


def check_shuffle(shuffle: bool | int, where: str) -> None:
    """Raise ``ValueError`` naming ``<where>.shuffle`` unless it is a bool or an era length >= 1."""
    if isinstance(shuffle, bool):
        return
    if not isinstance(shuffle, int) or shuffle < 1:
        raise ValueError(
            f"{where}.shuffle: expected false, true (a full shuffle) or an era length >= 1, got {shuffle!r}"
        )


def join_path(base: str, *parts: str) -> str:
    """Join cache path parts with ``/`` (also for URLs such as ``gs://``), ignoring trailing slashes."""
    return "/".join([base.rstrip("/"), *(p.strip("/") for p in parts)])


class SplitSources:
    """Where the splits of a single-source data config come from and are cached (shared by the LM and ASR configs).

    The class using it has the fields ``train_urls``, ``validation_urls``, ``cache_dir``, ``id``, ``name``,
    ``train_split``, ``validation_split`` and ``shuffle``.
    """

    train_urls: list[str]
    validation_urls: list[str]
    cache_dir: str
    id: str | None
    name: str | None
    train_split: str
    validation_split: str | None
    shuffle: bool | int

    def _check_sources(self) -> None:
        """``train_urls``/``validation_urls`` are lists of strings and ``shuffle`` is valid (named ``data.<key>``)."""
        for key in ("train_urls", "validation_urls"):
            value = getattr(self, key)
            if isinstance(value, str) or not all(isinstance(u, str) for u in value):
                raise ValueError(f"data.{key}: expected a list of URL strings, got {value!r}")
        check_shuffle(self.shuffle, "data")

    @property
    def cache_name(self) -> str:
        """The cache folder name under ``cache_dir``: ``name``, else ``id``, else ``"default"``."""
        return self.name or self.id or "default"

    def cache_path(self, split: str) -> str:
        """Where split ``split`` is cached: ``<cache_dir>/<cache_name>/<split>``."""
        return join_path(self.cache_dir, self.cache_name, split)

    def has_split(self, split: str) -> bool:
        """Whether this config has a source for ``split`` (``"train"`` or ``"validation"``)."""
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r}: expected one of {list(SPLITS)}")
        urls = self.train_urls if split == "train" else self.validation_urls
        hf_split = self.train_split if split == "train" else self.validation_split
        return bool(urls) or (self.id is not None and hf_split is not None)

    def source(self, split: str) -> list[str] | HFSource | None:
        """The datacache inputs of ``split``: resolved file URLs, a Hugging Face source, or ``None`` (no split)."""
        if not self.has_split(split):
            return None
        urls = self.train_urls if split == "train" else self.validation_urls
        hf_split = self.train_split if split == "train" else self.validation_split
        if urls or self.id is None or hf_split is None:
            return [resolve_url(u) for u in urls]
        return HFSource(self.id, split=hf_split, name=self.name)

    def folder(self, split: str) -> str | None:
        """The folder of the first file of ``split`` (relative paths inside its records resolve against it), or
        ``None`` for a Hugging Face dataset or no split."""
        source = self.source(split)
        if not isinstance(source, list) or not source:
            return None
        first = source[0]
        return posixpath.dirname(first) if "://" in first else os.path.dirname(os.path.abspath(first))
