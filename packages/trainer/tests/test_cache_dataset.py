"""Tests of the cache_dataset entry point: builds every split of the shipped Shakespeare data config."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from ponente.trainer.config import ConfigError, load_config
from ponente.trainer.data import LMDatasetConfig, LMMixtureDatasetConfig, build_caches, data_tokenizer, resolve_url
from ponente.trainer.main.cache_dataset import CacheDatasetConfig, cache_dataset, main

ASSETS = "package://ponente.trainer.assets/"


def _overrides(cache_dir: Path) -> list[str]:
    return [
        f"--data.validation_urls=[{ASSETS}shakespeare_validation.jsonl.gz]",
        f"--data.tokenizer={ASSETS}shakespeare_tokenizer.json",
        f"--data.cache_dir={cache_dir}",
        "--data.workers=0",
        "--progress=false",
    ]


def test_main_builds_the_validation_cache(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(_overrides(tmp_path)) == 0
    out = capsys.readouterr().out
    assert "validation:" in out
    assert "3 documents" in out
    with gzip.open(resolve_url(f"{ASSETS}shakespeare_validation.jsonl.gz"), "rt") as f:
        works = [json.loads(line)["text"] for line in f]
    cfg = LMDatasetConfig(
        validation_urls=[f"{ASSETS}shakespeare_validation.jsonl.gz"],
        tokenizer=f"{ASSETS}shakespeare_tokenizer.json",
        cache_dir=str(tmp_path),
    )
    cache = build_caches(cfg, "validation", background=False)
    tok = data_tokenizer(cfg)
    assert cache.is_finished
    assert len(cache) == 3
    assert cache[2]["input_ids"].tolist() == [*tok.encode(works[2]).ids, tok.token_to_id("<|endoftext|>")]


def test_cache_dataset_builds_every_component_of_a_mixture(tmp_path: Path) -> None:
    part = LMDatasetConfig(train_urls=[f"{ASSETS}shakespeare_validation.jsonl.gz"], workers=0)
    mix = LMMixtureDatasetConfig(
        configs={"x": part, "y": part},
        train_weights={"x": 1.0, "y": 1.0},
        tokenizer=f"{ASSETS}shakespeare_tokenizer.json",
        cache_dir=str(tmp_path),
    )
    caches = cache_dataset(CacheDatasetConfig(data=mix, progress=False))
    assert sorted(caches) == ["x/train", "y/train"]
    assert all(c.is_finished and len(c) == 3 for c in caches.values())
    assert (tmp_path / "x" / "train" / "ledger.json").is_file()
    with pytest.raises(ValueError, match="nothing to cache"):
        cache_dataset(CacheDatasetConfig(data=LMDatasetConfig(), progress=False))


def test_yaml_keys_parse_into_the_data_configs() -> None:
    cfg = load_config(
        CacheDatasetConfig,
        overrides=[
            "--data.configs={a: {train_urls: [a.jsonl]}}",
            "--data.train_weights={a: 1.0}",
            "--data.shuffle=64",
        ],
    )
    assert isinstance(cfg.data, LMMixtureDatasetConfig)
    assert cfg.data.configs["a"].train_urls == ["a.jsonl"]
    assert cfg.data.shuffle == 64
    single = load_config(CacheDatasetConfig, overrides=["--data.shuffle=true", "--data.train_urls=[b.jsonl]"])
    assert isinstance(single.data, LMDatasetConfig)
    assert single.data.shuffle is True
    with pytest.raises((ConfigError, ValueError), match="shuffle"):
        load_config(CacheDatasetConfig, overrides=["--data.shuffle=-3"])
