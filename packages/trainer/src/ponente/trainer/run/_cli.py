"""The command line of an entry point: logging set up one way, the configuration parsed, ``--version``."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable, Sequence
from typing import TypeVar

from ._result import TrainResult, print_result

__all__ = ["LOG_FORMAT", "LOG_LEVEL_ENV", "command_line_main", "parse_command_line", "print_versions"]

T = TypeVar("T")

LOG_FORMAT = "%(levelname)s %(name)s: %(message)s"
"""How entry points format log lines on stderr."""

LOG_LEVEL_ENV = "PONENTE_LOG_LEVEL"
"""Environment variable with the log level of entry points (default ``INFO``; e.g. ``DEBUG``)."""


def parse_command_line(config_class: type[T], argv: Sequence[str] | None, *, prog: str) -> T:
    """Set up logging and build the entry point's configuration from the command line.

    Args:
        config_class: the root config dataclass.
        argv: the arguments (None: ``sys.argv[1:]``): ``--config_path``, dotted overrides, ``--help``.
        prog: the program name ``--help`` shows.

    Returns:
        The configuration.

    Raises:
        SystemExit: after ``--help`` (status 0) or on a bad configuration (status 2, the error on stderr).
    """
    from ponente.trainer.config import parse_config

    logging.basicConfig(level=os.environ.get(LOG_LEVEL_ENV, "INFO"), format=LOG_FORMAT)
    return parse_config(config_class, list(sys.argv[1:] if argv is None else argv), prog=prog)


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
    train: Callable[[T], TrainResult], config_class: type[T], argv: Sequence[str] | None, *, prog: str
) -> int:
    """The ``main`` of a training entry point: ``--version``, or parse the config, train, and report.

    Args:
        train: the entry point's ``train(config) -> TrainResult``.
        config_class: its root config dataclass.
        argv: the arguments (None: ``sys.argv[1:]``).
        prog: the program name ``--help`` shows (the console script, e.g. ``ponente-sft``).

    Returns:
        The process exit code (see :func:`print_result`).
    """
    if "--version" in (sys.argv[1:] if argv is None else argv):
        print_versions()
        return 0
    return print_result(train(parse_command_line(config_class, argv, prog=prog)))
