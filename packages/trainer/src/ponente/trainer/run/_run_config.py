"""A run's recorded configuration, and command lines that start from it (export and evaluate a run as it is).

Every checkpoint a training run writes records the run's resolved configuration in its ``metadata.json``
(``metadata.config``, see :attr:`RunRecord.provenance`), so a checkpoint says which model it holds and which
tokenizer and data it was trained on. :func:`parse_run_command_line` builds the configuration of a tool that
reads a checkpoint (``export_lm_to_hf``, ``eval_lm``) from, in increasing precedence:

1. the defaults of the tool's config class;
2. the configuration recorded in the checkpoint given by ``--checkpoint_path`` (a step folder or a run folder),
   restricted to the tool's sections (``model``, ``data``, ...);
3. ``--config_path`` files, e.g. the run's own training file: a section a file gives (``model:``) replaces the
   recorded one, and the training-only sections (``trainer``, ``optimizer``, ...) are ignored, with the file
   named in the log;
4. ``--key value`` overrides.
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Collection, Mapping, Sequence
from typing import Any, TypeVar

from ._cli import LOG_FORMAT, LOG_LEVEL_ENV, check_inputs, parse_command_line
from ._restore import find_checkpoint

__all__ = ["check_run_inputs", "parse_run_command_line", "recorded_config"]

T = TypeVar("T")

logger = logging.getLogger("ponente.trainer.run")

_CONFIG_FLAGS = ("--config_path", "--config")
_CHECKPOINT_FLAG = "--checkpoint_path"


def recorded_config(checkpoint: str) -> dict[str, Any] | None:
    """The resolved configuration the training run recorded in the checkpoint (None if it recorded none).

    Args:
        checkpoint: a committed checkpoint directory (see :func:`find_checkpoint`).

    Returns:
        The configuration as nested plain data (``config_to_dict`` of the run's root config), or None for a
        checkpoint written without one (e.g. by :func:`~ponente.trainer.checkpoint.save_checkpoint` directly).
    """
    from ponente.trainer.checkpoint import read_metadata

    metadata = read_metadata(checkpoint) or {}
    config = (metadata.get("metadata") or {}).get("config")
    return dict(config) if isinstance(config, Mapping) else None


def _scan(argv: Sequence[str]) -> tuple[list[str], list[str], str | None]:
    # (config files, the other arguments in order, the --checkpoint_path value)
    paths: list[str] = []
    rest: list[str] = []
    checkpoint: str | None = None
    i = 0
    while i < len(argv):
        arg = argv[i]
        i += 1
        flag, sep, inline = arg.partition("=")
        if flag in _CONFIG_FLAGS:
            if sep:
                paths.append(inline)
            while not sep and i < len(argv) and not argv[i].startswith("--"):
                paths.append(argv[i])
                i += 1
            continue
        rest.append(arg)
        if flag == _CHECKPOINT_FLAG:
            if sep:
                checkpoint = inline
            elif i < len(argv) and not argv[i].startswith("--"):
                checkpoint = argv[i]
                rest.append(argv[i])
                i += 1
    return paths, rest, checkpoint


def _overridden_types(rest: Sequence[str]) -> set[str]:
    # the sections whose ``type`` the command line sets, e.g. {"model"} for ``--model.type llama``
    sections = set()
    for arg in rest:
        key = arg.partition("=")[0].removeprefix("--")
        if key.endswith(".type"):
            sections.add(key.removesuffix(".type"))
    return sections


def _drop(tree: dict[str, Any], dotted: str) -> None:
    *parents, last = dotted.split(".")
    node: Any = tree
    for key in parents:
        node = node.get(key) if isinstance(node, dict) else None
    if isinstance(node, dict):
        node.pop(last, None)


def parse_run_command_line(
    config_class: type[T],
    argv: Sequence[str] | None,
    *,
    prog: str,
    training_keys: Collection[str] = (),
    required: Collection[str] = ("model",),
) -> T:
    """Build the configuration of a tool that reads a checkpoint, starting from the run's recorded configuration.

    The sources, later wins: ``config_class``'s defaults; the configuration recorded in the checkpoint of
    ``--checkpoint_path`` (its keys that are fields of ``config_class``); the ``--config_path`` files, where a
    top-level section a file gives replaces the recorded section and keys in ``training_keys`` that are not
    fields of ``config_class`` are ignored (logged with the file's name); the ``--key value`` overrides (an
    override of a section's ``type`` drops the recorded section, which described another class).

    Args:
        config_class: the tool's root config dataclass (with a ``checkpoint_path`` field).
        argv: the arguments (None: ``sys.argv[1:]``).
        prog: the program name ``--help`` shows.
        training_keys: top-level keys of the training configs (``trainer``, ``optimizer``, ...) that a
            training file may hold and the tool ignores.
        required: sections that must come from the checkpoint's record, a file or an override when a
            checkpoint is given (the class defaults do not describe any particular checkpoint).

    Returns:
        The configuration; its inputs are not checked (see :func:`check_run_inputs`).

    Raises:
        FileNotFoundError: if ``--checkpoint_path`` holds no committed checkpoint (before anything else is read).
        ConfigError: if a ``required`` section comes from nowhere, or the configuration is invalid.
    """
    import sys

    import yaml

    from ponente.trainer.config import ConfigError, read_config_file

    logging.basicConfig(level=os.environ.get(LOG_LEVEL_ENV, "INFO"), format=LOG_FORMAT)  # as parse_command_line
    args = list(sys.argv[1:] if argv is None else argv)
    want_help = "-h" in args or "--help" in args  # the help shows the values of the recorded configuration
    paths, rest, checkpoint_path = _scan(args)
    fields = set(config_class.__dataclass_fields__)  # type: ignore[attr-defined]
    recorded: dict[str, Any] = {}
    where = None
    if checkpoint_path:
        try:
            where = find_checkpoint(checkpoint_path, "checkpoint_path")
        except FileNotFoundError:
            if not want_help:
                raise
        else:
            recorded = {k: v for k, v in (recorded_config(where) or {}).items() if k in fields}
    files: list[dict[str, Any]] = []
    for path in paths:
        tree = read_config_file(path)
        ignored = [k for k in tree if k not in fields and k in training_keys]
        if ignored:
            logger.info("%s: ignoring the training settings %s (not used by %s)", path, ", ".join(ignored), prog)
        files.append({k: v for k, v in tree.items() if k not in ignored})
    given = {key for tree in files for key in tree}
    base = {k: v for k, v in recorded.items() if k not in given}
    for section in _overridden_types(rest):
        _drop(base, section)
    if where is not None and not want_help:
        overridden = {arg.partition("=")[0].removeprefix("--").split(".")[0] for arg in rest}
        missing = [s for s in required if s not in base and s not in given and s not in overridden]
        if missing:
            raise ConfigError(
                f"{missing[0]}: checkpoint {where} records no configuration; pass the run's training config "
                f"with --config_path (or --{missing[0]}.* options)"
            )
    with tempfile.TemporaryDirectory(prefix="ponente-run-config-") as tmp:
        sources = []
        for i, tree in enumerate([base, *files]):
            if tree:
                sources.append(os.path.join(tmp, f"{i}.yaml"))
                with open(sources[-1], "w", encoding="utf-8") as f:
                    yaml.safe_dump(tree, f, sort_keys=False)
        config_args = ["--config_path", *sources] if sources else []
        return parse_command_line(config_class, [*config_args, *rest], prog=prog, check=False)


def check_run_inputs(config: Any, *, splits: Collection[str]) -> None:
    """:func:`check_inputs` for a tool that reads a checkpoint: only the data splits it reads must exist.

    A run's recorded configuration names its training and validation files; exporting needs neither of them (the
    tokenizer only), evaluating needs one split.

    Args:
        config: the tool's configuration (a frozen dataclass, with or without a ``data`` section).
        splits: the data splits the tool reads (``"train"``, ``"validation"``).

    Raises:
        FileNotFoundError: see :func:`check_inputs`.
    """
    import dataclasses

    data = getattr(config, "data", None)
    if data is not None:
        unused: dict[str, list[str]] = {
            f"{split}_urls": [] for split in ("train", "validation") if split not in splits
        }
        components = getattr(data, "configs", None)
        if isinstance(components, dict):
            data = dataclasses.replace(
                data, configs={name: dataclasses.replace(c, **unused) for name, c in components.items()}
            )
        else:
            data = dataclasses.replace(data, **unused)
        config = dataclasses.replace(config, data=data)
    check_inputs(config)
