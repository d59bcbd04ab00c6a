"""The command line of an entry point: logging set up one way, the configuration parsed and its inputs checked,
``--version``, and errors reported as one line with an exit status.

Every console script runs its ``main`` in :func:`ponente.datacache.errors.run_cli`: a user error prints
``error: <message>`` on stderr and exits 1 (2 for a configuration error), Ctrl-C exits 130, and a traceback is
printed only with ``--debug`` or ``PONENTE_DEBUG=1``. :func:`check_inputs` checks, right after parsing and before
any slow work (JAX compiling, caches building, models loading), that the files a configuration names exist and
the folders it writes to can be written.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

from ponente.datacache.errors import run_cli

from ._result import TrainResult, print_result

__all__ = [
    "LOG_FORMAT",
    "LOG_LEVEL_ENV",
    "check_inputs",
    "command_line_main",
    "parse_command_line",
    "print_versions",
    "run_cli",
    "tool_main",
]

T = TypeVar("T")

LOG_FORMAT = "%(levelname)s %(name)s: %(message)s"
"""How entry points format log lines on stderr."""

LOG_LEVEL_ENV = "PONENTE_LOG_LEVEL"
"""Environment variable with the log level of entry points (default ``INFO``; e.g. ``DEBUG``)."""

# Keys (dotted, from the root config) of each kind of input or output; keys a config lacks are skipped.
_INPUT_FILES = ("prompts_file", "documents")
_INPUT_PATHS = ("include_path",)  # a file or a folder
_TOKENIZERS = ("data.tokenizer", "tokenizer")
_MODEL_FOLDERS = ("initialize_from_hf", "hf_checkpoint")
_CHECKPOINTS = ("checkpoint_path", "trainer.initialize_from", "trainer.load_checkpoint_path")
_OUTPUT_FOLDERS = ("data.cache_dir", "trainer.checkpointer.base_path", "trainer.run_dir", "hf_save_path", "output_dir")
_OUTPUT_FILES = ("output", "output_path")


def parse_command_line(config_class: type[T], argv: Sequence[str] | None, *, prog: str, check: bool = True) -> T:
    """Set up logging, build the entry point's configuration from the command line and check its inputs.

    Args:
        config_class: the root config dataclass.
        argv: the arguments (None: ``sys.argv[1:]``): ``--config_path``, dotted overrides, ``--help``.
        prog: the program name ``--help`` shows.
        check: run :func:`check_inputs` on the configuration.

    Returns:
        The configuration.

    Raises:
        SystemExit: after ``--help`` (status 0).
        ponente.trainer.config.ConfigError: on a bad configuration (exit status 2 under :func:`run_cli`).
        FileNotFoundError: if a file or checkpoint the configuration names does not exist.
        OSError: if a folder the run writes to cannot be created or written.
    """
    from ponente.trainer.config import parse_config

    logging.basicConfig(level=os.environ.get(LOG_LEVEL_ENV, "INFO"), format=LOG_FORMAT)
    _quiet_backend_discovery()
    config = parse_config(config_class, list(sys.argv[1:] if argv is None else argv), prog=prog, exit_on_error=False)
    if check:
        check_inputs(config)
    return config


def _quiet_backend_discovery() -> None:
    """Keep JAX's INFO lines about optional backends it did not find off the console, unless the level is DEBUG.

    On a machine without a TPU, JAX logs ``Unable to initialize backend 'tpu': ...`` at INFO (and so for any
    other optional plugin); those would be the first lines a CPU user sees. JAX's warnings stay: a GPU or TPU
    that is present but cannot be used is a WARNING (``An NVIDIA GPU may be present on this machine...``), and a
    backend named in ``JAX_PLATFORMS`` that fails is an error. ``JAX_PLATFORMS`` itself is never touched.
    """
    if logging.getLogger().getEffectiveLevel() > logging.DEBUG:
        logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)


def _get(config: Any, dotted: str) -> Any:
    value = config
    for name in dotted.split("."):
        value = getattr(value, name, None)
        if value is None:
            return None
    return value


def _is_remote(path: str) -> bool:
    return "://" in path and not path.startswith("file://")


def _local(path: str) -> str:
    return os.path.expanduser(path.removeprefix("file://"))


def _surely_local(name: str) -> bool:
    """Whether ``name`` can only be a local path (not a hub id like ``gpt2`` or ``org/model@rev``)."""
    if name.startswith("file://"):
        return True
    if "://" in name:
        return False
    if name.startswith(("/", ".", "~")) or name.count("/") >= 2 or (os.sep != "/" and os.sep in name):
        return True
    return name.endswith((".json", ".jsonl", ".yaml", ".safetensors"))


def _data_sections(data: Any) -> Iterator[tuple[str, Any]]:
    # (key prefix, single-source data config): the config itself, or each component of a mixture
    components = getattr(data, "configs", None)
    if isinstance(components, dict):
        for name, component in components.items():
            yield f"data.configs.{name}", component
    else:
        yield "data", data


def _check_urls(urls: Sequence[str], key: str) -> None:
    from ponente.datacache import expand_inputs
    from ponente.trainer.data import resolve_url

    for url in urls:
        try:
            resolved = resolve_url(url)
        except FileNotFoundError as exc:
            raise FileNotFoundError(f"{exc} ({key})") from exc
        if _is_remote(resolved):
            continue  # checked by the cache builder: listing a bucket here would cost a round trip per URL
        try:
            names = expand_inputs(resolved)
        except FileNotFoundError as exc:
            raise FileNotFoundError(f"no file matches {url} ({key})") from exc
        for name in names:
            if not os.path.exists(name):
                raise FileNotFoundError(f"no such file: {name} ({key})")
            if os.path.isdir(name):
                raise IsADirectoryError(f"{name} is a folder, not a data file ({key}); use a glob like {name}/*.jsonl")


def _check_input_file(path: str, key: str) -> None:
    if _is_remote(path):
        return
    local = _local(path)
    if not os.path.exists(local):
        raise FileNotFoundError(f"no such file: {path} ({key})")
    if os.path.isdir(local):
        raise IsADirectoryError(f"{path} is a folder, not a file ({key})")
    if not os.access(local, os.R_OK):
        raise PermissionError(f"cannot read {path} ({key}): permission denied")


def _check_local_source(name: str, key: str, what: str) -> None:
    # a tokenizer or model given as a local path must exist; hub ids are resolved (and reported) by the loaders
    from ponente.trainer.data import resolve_url

    try:
        name = resolve_url(name)
    except FileNotFoundError as exc:
        raise FileNotFoundError(f"{exc} ({key})") from exc
    if _is_remote(name) or not _surely_local(name) or os.path.exists(_local(name)):
        return
    raise FileNotFoundError(f"no such {what}: {name} ({key})")


def _check_hf_checkpoint(reference: str, allow_pickle: bool) -> None:
    """A Hugging Face checkpoint the run starts from: a folder with weights it may load (safetensors, or pickle
    weights with ``allow_pickle``), or a hub id that resolves (from the local hub cache first; offline and not
    cached is one line). Only a hub id's ``config.json`` is fetched here: its weights wait until the run needs them."""
    from ponente.models.hf import resolve_checkpoint

    local = os.path.isdir(_local(reference))
    resolve_checkpoint(reference, allow_pickle=allow_pickle, weights=local, key="initialize_from_hf")


def _check_checkpoint(path: str, key: str) -> None:
    if _is_remote(path):
        return
    local = _local(path)
    if not os.path.exists(local):
        raise FileNotFoundError(f"no checkpoint at {path} ({key})")
    if not os.access(local, os.R_OK | os.X_OK if os.path.isdir(local) else os.R_OK):
        raise PermissionError(f"cannot read the checkpoint at {path} ({key}): permission denied")
    from ponente.trainer.checkpoint import latest_checkpoint_path

    try:
        found = latest_checkpoint_path(local)
    except ValueError:  # the storage refuses to list it: a plain file
        found = None
    if found is None:
        raise FileNotFoundError(
            f"no committed checkpoint at {path} ({key}): neither a step folder with metadata.json nor a run folder "
            "holding one"
        )


def _check_writable_folder(path: str, key: str) -> None:
    if _is_remote(path) or path.startswith("memory://"):
        return
    folder = os.path.abspath(_local(path.split("{", 1)[0] or "."))
    existing = folder
    while not os.path.exists(existing):
        parent = os.path.dirname(existing)
        if parent == existing:
            break
        existing = parent
    if not os.path.isdir(existing):
        raise NotADirectoryError(f"cannot create the folder {path} ({key}): {existing} is a file")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise PermissionError(f"cannot write to {path} ({key}): {existing} is not writable")


def _check_output_file(path: str, key: str) -> None:
    if _is_remote(path):
        return
    local = os.path.abspath(_local(path))
    if os.path.isdir(local):
        raise IsADirectoryError(f"cannot write {path} ({key}): it is a folder")
    if os.path.exists(local) and not os.access(local, os.W_OK):
        raise PermissionError(f"cannot write {path} ({key}): permission denied")
    _check_writable_folder(os.path.dirname(local), key)


def check_inputs(config: Any) -> None:
    """Check, before any slow work, that what a configuration reads exists and what it writes can be written.

    Looks at the keys the configuration has (any entry point's): the data files and globs of
    ``data.train_urls`` and ``data.validation_urls`` (of every mixture component), ``prompts_file``,
    ``documents`` and ``include_path``; the tokenizer (``data.tokenizer``, ``tokenizer``) and model folders
    (``initialize_from_hf``, ``hf_checkpoint``) when given as local paths (hub ids are left to the hub client);
    the checkpoints of ``checkpoint_path``, ``trainer.initialize_from`` and ``trainer.load_checkpoint_path`` (a
    committed checkpoint must be there); the folders ``data.cache_dir``, ``trainer.checkpointer.base_path``,
    ``trainer.run_dir``, ``hf_save_path`` and ``output_dir`` (the nearest existing folder must be writable), and
    the files ``output`` and ``output_path``. Remote paths (``gs://``, ``s3://``) are left to the code that opens
    them.

    Args:
        config: an entry point's root configuration.

    Raises:
        FileNotFoundError: one line naming the path and the key, e.g.
            ``no such file: /data/train.jsonl (data.train_urls)``.
        PermissionError: a path that cannot be read or written, named with its key.
        IsADirectoryError: a folder where a file is expected (or the reverse: NotADirectoryError).
    """
    data = getattr(config, "data", None)
    if data is not None:
        for prefix, section in _data_sections(data):
            for split in ("train_urls", "validation_urls"):
                urls = getattr(section, split, None)
                if isinstance(urls, list | tuple):
                    _check_urls(urls, f"{prefix}.{split}")
    for key in _INPUT_FILES:
        if isinstance(value := _get(config, key), str):
            _check_input_file(value, key)
    for key in _INPUT_PATHS:
        if isinstance(value := _get(config, key), str) and not _is_remote(value) and not os.path.exists(_local(value)):
            raise FileNotFoundError(f"no such file or folder: {value} ({key})")
    for key in _TOKENIZERS:
        if isinstance(value := _get(config, key), str):
            _check_local_source(value, key, "tokenizer")
    for key in _MODEL_FOLDERS:
        if isinstance(value := _get(config, key), str):
            _check_local_source(value, key, "model folder")
    if isinstance(value := _get(config, "initialize_from_hf"), str) and not _is_remote(value):
        _check_hf_checkpoint(value, bool(getattr(config, "allow_pickle", False)))
    trainer = getattr(config, "trainer", None)
    for key in _CHECKPOINTS:
        if key == "trainer.load_checkpoint_path" and getattr(trainer, "load_checkpoint", None) is False:
            continue
        if isinstance(value := _get(config, key), str):
            _check_checkpoint(value, key)
    for key in _OUTPUT_FOLDERS:
        if isinstance(value := _get(config, key), str):
            _check_writable_folder(value, key)
    for key in _OUTPUT_FILES:
        if isinstance(value := _get(config, key), str) and value:
            _check_output_file(value, key)


def print_versions() -> None:
    """Print the versions of the Ponente packages, of the runtime libraries, and the JAX devices (``--version``)."""
    import jax

    from ponente.trainer.versions import ponente_versions, runtime_versions

    for dist, version in ponente_versions().items():
        print(f"{dist} {version}")
    for dist, version in runtime_versions().items():
        print(f"  {dist} {version}")
    devices = jax.devices()
    print(f"JAX backend: {jax.default_backend()} with {len(devices)} device(s): {', '.join(map(str, devices))}")


def command_line_main(
    train: Callable[[T], TrainResult],
    config_class: type[T],
    argv: Sequence[str] | None,
    *,
    prog: str,
    prepare: Callable[[T], None] | None = None,
) -> int:
    """The ``main`` of a training entry point: ``--version``, or parse the config, check its inputs, train, report.

    Runs in :func:`run_cli`: an error prints one line ``error: <message>`` on stderr (the traceback too with
    ``--debug`` or ``PONENTE_DEBUG=1``) and gives exit status 2 for a configuration error, 1 for another.

    Args:
        train: the entry point's ``train(config) -> TrainResult``.
        config_class: its root config dataclass.
        argv: the arguments (None: ``sys.argv[1:]``).
        prog: the program name ``--help`` shows (the console script, e.g. ``ponente-sft``).
        prepare: called with the configuration before its inputs are checked (e.g. to write an example's data).

    Returns:
        The process exit code (see :func:`print_result`).
    """

    def main(args: list[str]) -> int:
        if "--version" in args:
            print_versions()
            return 0
        config = parse_command_line(config_class, args, prog=prog, check=False)
        if prepare is not None:
            prepare(config)
        check_inputs(config)
        return print_result(train(config))

    return run_cli(main, argv)


def tool_main(run: Callable[[T], object], config_class: type[T], argv: Sequence[str] | None, *, prog: str) -> int:
    """The ``main`` of a tool that reads a model (``sample_lm``, ``serve``): ``--version``, or parse the config,
    check its inputs and call ``run(config)``; exit status 0 when it returns.

    Runs in :func:`run_cli` (errors as :func:`command_line_main`'s).

    Args:
        run: the tool's work, ``run(config)`` (its return value is ignored).
        config_class: its root config dataclass.
        argv: the arguments (None: ``sys.argv[1:]``).
        prog: the program name ``--help`` shows (the console script, e.g. ``ponente-serve``).
    """

    def main(args: list[str]) -> int:
        if "--version" in args:
            print_versions()
            return 0
        run(parse_command_line(config_class, args, prog=prog))
        return 0

    return run_cli(main, argv)
