"""Run records: what exactly ran (git commit, resolved config, installed packages, versions).

:func:`log_run_info` sends them to a tracker as hyperparameters and, given a run folder, writes
``config.yaml``, ``pip_freeze.txt``, ``git.txt`` and ``versions.json`` there (and logs those files as
artifacts).
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import os
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from ponente.trainer.tracker.tracker import Tracker, write_text_atomic
from ponente.trainer.versions import ponente_versions, runtime_versions

__all__ = ["flatten_config", "git_info", "log_run_info", "pip_freeze"]

logger = logging.getLogger(__name__)


def git_info(path: str | os.PathLike[str] | None = None) -> dict[str, Any] | None:
    """The git commit checked out at ``path`` and whether the work tree has uncommitted changes.

    Args:
        path: a folder inside the repository (default: the working directory).

    Returns:
        ``{"sha": "<40 hex digits>", "dirty": bool}``, or None if ``path`` is not inside a git work
        tree with at least one commit, or ``git`` is not installed.
    """
    cwd = os.fspath(path) if path is not None else None
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "--verify", "HEAD"], cwd=cwd, capture_output=True, text=True, check=False
        )
        if sha.returncode != 0:
            return None
        status = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=cwd,
            capture_output=True,
            text=True,
            check=False,
        )
    except (FileNotFoundError, NotADirectoryError, PermissionError) as exc:
        logger.info("no git information for %s: %s", cwd or os.getcwd(), exc)
        return None
    return {"sha": sha.stdout.strip(), "dirty": status.returncode != 0 or bool(status.stdout.strip())}


def pip_freeze() -> str:
    """The installed distributions, one ``name==version`` line each, sorted by name (like ``pip freeze``).

    Editable installs are written ``-e <location>`` preceded by a comment with name and version.
    Read with ``importlib.metadata``, so no ``pip`` subprocess is needed.
    """
    lines: dict[str, str] = {}
    for dist in importlib.metadata.distributions():
        name = dist.metadata["Name"]
        if not name or name in lines:
            continue  # the first distribution on sys.path wins, as for imports
        lines[name] = _requirement_line(dist, name)
    return "".join(lines[name] + "\n" for name in sorted(lines, key=str.lower))


def _requirement_line(dist: importlib.metadata.Distribution, name: str) -> str:
    pinned = f"{name}=={dist.version}"
    direct_url = dist.read_text("direct_url.json")
    if not direct_url:
        return pinned
    try:
        info = json.loads(direct_url)
    except json.JSONDecodeError:
        return pinned
    url = info.get("url")
    if not isinstance(url, str):
        return pinned
    if info.get("dir_info", {}).get("editable"):
        return f"# Editable install: {pinned}\n-e {url.removeprefix('file://')}"
    return f"{name} @ {url}"


def flatten_config(config: Mapping[str, Any], *, sep: str = ".") -> dict[str, Any]:
    """Flatten nested mappings into dotted keys: ``{"trainer": {"seed": 0}}`` -> ``{"trainer.seed": 0}``.

    Lists and other values are kept as they are.

    Example:
        >>> flatten_config({"trainer": {"seed": 0, "tags": ["a"]}, "lr": 0.1})
        {'trainer.seed': 0, 'trainer.tags': ['a'], 'lr': 0.1}
    """
    flat: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, Mapping):
            for inner, inner_value in flatten_config(value, sep=sep).items():
                flat[f"{key}{sep}{inner}"] = inner_value
        else:
            flat[str(key)] = value
    return flat


def log_run_info(
    tracker: Tracker,
    config: Mapping[str, Any],
    *,
    run_dir: str | os.PathLike[str] | None = None,
    git_dir: str | os.PathLike[str] | None = None,
) -> dict[str, Any]:
    """Record the run: log the flattened config and run facts as hyperparameters, and write the run files.

    Hyperparameters logged: each dotted config key, plus ``run_info.git_sha``, ``run_info.git_dirty``
    (None outside a git repository) and ``run_info.versions.<distribution>``.

    Args:
        tracker: where to log.
        config: the resolved config as a (nested) mapping, e.g. ``config_to_dict(cfg)``.
        run_dir: if given, write ``config.yaml``, ``pip_freeze.txt``, ``git.txt`` and ``versions.json``
            there and log them as artifacts.
        git_dir: the folder whose git repository is recorded (default: the working directory).

    Returns:
        ``{"config": dict, "git": {"sha", "dirty"} or None, "versions": dict, "pip_freeze": str,
        "files": {name: path}}``, what was recorded.

    Raises:
        TypeError: if ``config`` is not a mapping.
    """
    if not isinstance(config, Mapping):
        raise TypeError(f"log_run_info expects the config as a mapping (config_to_dict(cfg)), got {type(config)}")
    plain_config = _plain(config)
    git = git_info(git_dir)
    versions = {**ponente_versions(), **runtime_versions()}
    freeze = pip_freeze()
    hparams = flatten_config(plain_config)
    hparams["run_info.git_sha"] = git["sha"] if git else None
    hparams["run_info.git_dirty"] = git["dirty"] if git else None
    hparams.update({f"run_info.versions.{dist}": version for dist, version in versions.items()})
    tracker.log_hyperparameters(hparams)

    files: dict[str, str] = {}
    if run_dir is not None:
        folder = Path(run_dir)
        folder.mkdir(parents=True, exist_ok=True)
        git_text = f"sha: {git['sha']}\ndirty: {str(git['dirty']).lower()}\n" if git else "sha: unknown\n"
        contents = {
            "config.yaml": ("config", yaml.safe_dump(plain_config, sort_keys=False)),
            "pip_freeze.txt": ("requirements", freeze),
            "git.txt": ("git", git_text),
            "versions.json": ("versions", json.dumps(versions, indent=2) + "\n"),
        }
        for file_name, (kind, text) in contents.items():
            path = folder / file_name
            write_text_atomic(path, text)  # a reader (or a second writer) never sees half a file
            files[file_name] = str(path)
            tracker.log_artifact(path, name=file_name, type=kind)
    return {"config": plain_config, "git": git, "versions": versions, "pip_freeze": freeze, "files": files}


def _plain(value: Any) -> Any:
    """Tuples to lists and mappings to dicts, recursively, so ``yaml.safe_dump`` can write the config."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value
