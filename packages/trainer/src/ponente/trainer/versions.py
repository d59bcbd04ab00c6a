"""Versions of the Ponente packages and the libraries they run on, for run records and bug reports."""

from __future__ import annotations

import importlib
import importlib.metadata

PONENTE_PACKAGES: tuple[str, ...] = ("namedtensor", "datacache", "models", "trainer")
"""The four Ponente packages, in dependency order."""

_RUNTIME_DISTRIBUTIONS: tuple[str, ...] = ("jax", "jaxlib", "equinox", "optax", "numpy", "tensorstore")


def ponente_versions() -> dict[str, str]:
    """Return ``{"ponente-<name>": version}`` for each Ponente package, read from the imported module.

    Reading ``__version__`` from the module (not the installed metadata) reports what actually runs,
    which differs from the metadata when a source tree shadows an installed wheel.

    Raises:
        ImportError: if one of the packages is not importable; the message names the distribution.
    """
    versions: dict[str, str] = {}
    for name in PONENTE_PACKAGES:
        try:
            module = importlib.import_module(f"ponente.{name}")
        except ImportError as exc:
            raise ImportError(
                f"ponente-{name} is not installed (needed by ponente-trainer); install it with "
                f"`pip install ./packages/{name}` from the repository root"
            ) from exc
        versions[f"ponente-{name}"] = module.__version__
    return versions


def runtime_versions() -> dict[str, str]:
    """Return the installed versions of the third-party libraries training depends on.

    A library that is not installed is reported as ``"not installed"`` rather than omitted, so a
    run record always has the same keys.
    """
    found: dict[str, str] = {}
    for dist in _RUNTIME_DISTRIBUTIONS:
        try:
            found[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            found[dist] = "not installed"
    return found
