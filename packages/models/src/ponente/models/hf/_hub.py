"""Hugging Face Hub ids, offline-first: a checkpoint id resolves from the local Hub cache before the network.

A reference is a local folder or a Hub id, optionally pinned to a revision with ``@`` (Levanter's spelling):
``"org/name"``, ``"org/name@v1.0"``, ``"org/name@<commit sha>"``. An id is looked up in the Hugging Face cache
(``HF_HUB_CACHE``, else ``HF_HOME/hub``, else ``~/.cache/huggingface/hub``) first, with no network at all; only
what is not cached is downloaded, and never with ``HF_HUB_OFFLINE=1``. The environment is read at each call, so
a process that changes it (a test, a notebook) gets what it set.

Only what Ponente reads is fetched: ``config.json``, safetensors weights and tokenizer files, plus
``pytorch_model*.bin`` when pickle checkpoints are allowed. Python files (custom modelling code) never are.
"""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
from collections.abc import Iterator
from pathlib import Path

__all__ = [
    "HubUnavailableError",
    "PickleCheckpointError",
    "hub_cache_dir",
    "hub_offline",
    "resolve_checkpoint",
    "split_revision",
]

_TRUE = ("1", "true", "yes", "on")
CONFIG_FILES = ["config.json", "generation_config.json"]
SAFETENSORS_FILES = ["*.safetensors", "model.safetensors.index.json"]
PICKLE_FILES = ["pytorch_model*.bin", "pytorch_model.bin.index.json"]
TOKENIZER_FILES = ["tokenizer*", "special_tokens_map.json", "*.model", "*.txt", "vocab.json", "merges.txt"]


class HubUnavailableError(FileNotFoundError):
    """A Hub id that is not in the local cache and cannot be downloaded (offline, unknown id, no network)."""


class PickleCheckpointError(ValueError):
    """A checkpoint whose weights exist only as pickle files (``pytorch_model*.bin``), which are not allowed."""


def hub_offline() -> bool:
    """Whether ``HF_HUB_OFFLINE`` (or ``TRANSFORMERS_OFFLINE``) is set to a true value now."""
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return value.strip().lower() in _TRUE


def hub_cache_dir() -> Path:
    """The Hugging Face Hub cache folder as the environment says now (the same rules as ``huggingface_hub``)."""
    explicit = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if explicit:
        return Path(os.path.expandvars(explicit)).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "huggingface"
    )
    return Path(os.path.expandvars(home)).expanduser() / "hub"


def split_revision(reference: str) -> tuple[str, str | None]:
    """Split ``"org/name@revision"`` into ``("org/name", "revision")``; no ``@``: ``(reference, None)``.

    Hub ids cannot contain ``@``, so the first one separates the revision (which may contain ``/``, e.g.
    ``refs/pr/1``).

    Example:
        ```python
        from ponente.models.hf import split_revision

        assert split_revision("gpt2@main") == ("gpt2", "main")
        assert split_revision("org/name") == ("org/name", None)
        ```
    """
    repo_id, at, revision = reference.partition("@")
    return repo_id, (revision or None) if at else None


def looks_like_repo_id(name: str) -> bool:
    """Whether ``name`` (without ``@revision``) has the form of a Hub id: ``name`` or ``org/name``."""
    parts = name.split("/")
    return 1 <= len(parts) <= 2 and all(parts) and not name.startswith((".", "~")) and "\\" not in name


@contextlib.contextmanager
def _quiet_hub() -> Iterator[None]:
    """Silence ``huggingface_hub``'s warnings and retry chatter: failures reach the user as one line from us."""
    hub_logger = logging.getLogger("huggingface_hub")
    level = hub_logger.level
    hub_logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        hub_logger.setLevel(level)


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:300]}" if text else type(exc).__name__


def _has_weights(directory: Path, allow_pickle: bool) -> bool:
    if (directory / "model.safetensors").is_file() or (directory / "model.safetensors.index.json").is_file():
        return True
    return allow_pickle and any(directory.glob("pytorch_model*.bin"))


def _cached_snapshot(repo_id: str, revision: str | None, patterns: list[str]) -> Path | None:
    """The cached snapshot folder of ``repo_id`` at ``revision``, with no network access; None if not cached."""
    from huggingface_hub import snapshot_download

    try:
        with _quiet_hub():
            local = snapshot_download(
                repo_id,
                revision=revision,
                cache_dir=hub_cache_dir(),
                allow_patterns=patterns,
                local_files_only=True,
            )
    except Exception:  # not cached, or an incomplete snapshot: both mean "ask the network, if allowed"
        return None
    return Path(local)


def _download(repo_id: str, revision: str | None, patterns: list[str], where: str) -> Path:
    from huggingface_hub import snapshot_download

    endpoint = os.environ.get("HF_ENDPOINT") or None
    try:
        with _quiet_hub():
            local = snapshot_download(
                repo_id,
                revision=revision,
                cache_dir=hub_cache_dir(),
                allow_patterns=patterns,
                endpoint=endpoint,
            )
    except Exception as e:  # network, authentication, unknown repository or revision: all mean "cannot get it"
        raise HubUnavailableError(
            f"{where} is not in the Hugging Face cache {hub_cache_dir()} and could not be downloaded "
            f"({_one_line(e)}); check the id, revision, network and token (`hf auth login` for gated models)"
        ) from e
    return Path(local)


def resolve_checkpoint(
    reference: str | os.PathLike[str],
    *,
    revision: str | None = None,
    allow_pickle: bool = False,
    weights: bool = True,
    key: str = "load_pretrained",
) -> Path:
    """The local folder of a Hugging Face checkpoint: a local folder as it is, a Hub id from the cache or the Hub.

    A Hub id is looked up in the local Hub cache first (no network); only a missing snapshot, or one without
    the files needed, is downloaded, and never while ``HF_HUB_OFFLINE`` is set. Only configuration, tokenizer and
    weight files are fetched (never Python code).

    Args:
        reference: a local checkpoint folder, or a Hub id ``"org/name"`` optionally with ``"@revision"``.
        revision: the Hub revision (branch, tag or commit); overrides one given in ``reference``.
        allow_pickle: also accept (and fetch) ``pytorch_model*.bin`` weights when there are no safetensors.
        weights: whether the weights are needed (False: ``config.json`` suffices, e.g. to read the architecture).
        key: the config key or function that named ``reference``, for error messages.

    Returns:
        The folder holding ``config.json`` (and the weights, when asked for).

    Raises:
        FileNotFoundError: if ``reference`` is neither a folder nor a Hub id, or the folder has no ``config.json``.
        HubUnavailableError: (a ``FileNotFoundError``) if a Hub id is not cached and cannot be downloaded.
        PickleCheckpointError: if the weights are only pickle files and ``allow_pickle`` is false.
        ImportError: if a Hub id needs ``huggingface_hub`` and it is not installed.

    Example:
        ```py
        folder = resolve_checkpoint("HuggingFaceTB/SmolLM2-135M@main", key="initialize_from_hf")
        ```
    """
    directory = Path(reference)
    if directory.is_dir():
        _check_folder(directory, allow_pickle=allow_pickle, weights=weights, key=key)
        return directory
    name = os.fspath(reference)
    repo_id, pinned = split_revision(name)
    revision = revision or pinned
    if directory.exists() or not looks_like_repo_id(repo_id):
        raise FileNotFoundError(
            f"{key}: {name!r} is not a local directory, nor a Hugging Face Hub id of the form 'org/name[@revision]'"
        )
    where = f"{key}: {repo_id!r}" + (f" (revision {revision})" if revision else "")
    try:
        import huggingface_hub  # noqa: F401
    except ImportError:
        raise ImportError(
            f"{where} is not a local directory; reading it from the Hugging Face Hub needs the `huggingface_hub` "
            "package (pip install 'ponente-models[hf]'), or pass a local checkpoint directory"
        ) from None
    patterns = CONFIG_FILES + TOKENIZER_FILES + (SAFETENSORS_FILES if weights else [])
    cached = _cached_snapshot(repo_id, revision, patterns)
    if (
        cached is not None
        and (cached / "config.json").is_file()
        and (not weights or _has_weights(cached, allow_pickle))
    ):
        return cached
    if hub_offline():
        if cached is not None and (cached / "config.json").is_file():
            _check_folder(cached, allow_pickle=allow_pickle, weights=weights, key=key)  # says what the copy lacks
        raise HubUnavailableError(
            f"{where} is not a local directory nor in the Hugging Face cache {hub_cache_dir()}, and HF_HUB_OFFLINE "
            f"is set; download it while online (`hf download {repo_id}`) or unset HF_HUB_OFFLINE"
        )
    directory = _download(repo_id, revision, patterns, where)
    if weights and allow_pickle and not _has_weights(directory, allow_pickle=False):
        # no safetensors in the repository: fetch the pickle weights (only now, so a repo with both gets one copy)
        directory = _download(repo_id, revision, patterns + PICKLE_FILES, where)
    _check_folder(directory, allow_pickle=allow_pickle, weights=weights, key=key, hub=True)
    return directory


def _check_folder(directory: Path, *, allow_pickle: bool, weights: bool, key: str, hub: bool = False) -> None:
    """Raise if ``directory`` lacks ``config.json`` or (when ``weights``) weights Ponente may load."""
    if not (directory / "config.json").is_file():
        raise FileNotFoundError(f"{key}: {directory / 'config.json'} does not exist")
    if not weights or _has_weights(directory, allow_pickle):
        return
    raise missing_weights_error(directory, key, hub=hub)


def missing_weights_error(directory: Path, key: str, *, hub: bool = False) -> Exception:
    """The error for a checkpoint folder without safetensors: pickle weights not allowed, or no weights at all."""
    if any(directory.glob("pytorch_model*.bin")) or hub:
        # a Hub download fetches pickle files only when they are allowed, so "no safetensors" may mean "only .bin"
        return PickleCheckpointError(
            f"{key}: {directory} has no safetensors weights (model.safetensors or model.safetensors.index.json), "
            "only pickle weights (pytorch_model*.bin) or none; set allow_pickle: true to load pickle weights with "
            "torch (weights_only=True)"
        )
    return FileNotFoundError(
        f"{key}: {directory} has neither model.safetensors nor model.safetensors.index.json (nor pytorch_model*.bin)"
    )
