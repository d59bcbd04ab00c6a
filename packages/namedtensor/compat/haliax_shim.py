"""Import shim: makes ``import haliax`` (and its submodules) resolve to ``ponente.namedtensor``.

Used only by the ``compat`` nox session, which runs Haliax's own test suite against Ponente. The shim maps
module *names*; it implements no behaviour. A Haliax module that has a Ponente counterpart of the same
name maps to it (``haliax.nn.scan`` -> ``ponente.namedtensor.nn.scan``); modules that live under another
name in Ponente are listed in :data:`RENAMED`. A Haliax module with no counterpart fails to import with a
``ModuleNotFoundError`` naming both sides, so the compat report shows the gap.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from types import ModuleType

PREFIX = "haliax"
TARGET = "ponente.namedtensor"

# Haliax module -> Ponente module, where the names differ (private implementation modules, mostly).
RENAMED: dict[str, str] = {
    "haliax._src.parsing": f"{TARGET}._parsing",
    "haliax._src.rearrange": f"{TARGET}.rearrange",
    "haliax._src.einsum": f"{TARGET}.einsum",
    "haliax._src.dot": f"{TARGET}.dot",
    "haliax._src.state_dict": f"{TARGET}.state_dict",
    "haliax._src.scan": f"{TARGET}.nn.scan",
    "haliax._src.fp8": f"{TARGET}.dot_general",
    "haliax._src.util": f"{TARGET}.util",
    "haliax._src.compile_utils": f"{TARGET}.jax_utils",
    "haliax.tree": f"{TARGET}.tree_util",
}

# Haliax packages that only hold (renamed) submodules. They become empty packages: were one an alias of a
# Ponente package, importing a submodule would set it as an attribute of that package (``haliax._src.einsum``
# would replace the function ``ponente.namedtensor.einsum`` with the module).
EMPTY_PACKAGES: frozenset[str] = frozenset({"haliax._src"})


def target_of(name: str) -> str:
    """The Ponente module that Haliax module ``name`` maps to."""
    if name in RENAMED:
        return RENAMED[name]
    return TARGET + name[len(PREFIX) :]


class _Alias(importlib.abc.Loader):
    def __init__(self, target: str) -> None:
        self.target = target

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return importlib.import_module(self.target)

    def exec_module(self, module: ModuleType) -> None:
        pass  # the Ponente module is already executed


class _EmptyPackage(importlib.abc.Loader):
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        return None  # the default: a fresh, empty module

    def exec_module(self, module: ModuleType) -> None:
        pass


class HaliaxFinder(importlib.abc.MetaPathFinder):
    """Finds ``haliax`` and ``haliax.*`` by loading the Ponente module they map to."""

    def find_spec(
        self, fullname: str, path: object = None, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != PREFIX and not fullname.startswith(PREFIX + "."):
            return None
        if fullname in EMPTY_PACKAGES:
            return importlib.util.spec_from_loader(fullname, _EmptyPackage(), is_package=True)
        mapped = target_of(fullname)
        try:
            found = importlib.util.find_spec(mapped)
        except ModuleNotFoundError:
            found = None
        if found is None:
            raise ModuleNotFoundError(f"{fullname} (no Ponente counterpart: {mapped} does not exist)", name=fullname)
        return importlib.util.spec_from_loader(
            fullname, _Alias(mapped), is_package=found.submodule_search_locations is not None
        )


def install() -> None:
    """Put the finder first on ``sys.meta_path`` (idempotent)."""
    if not any(isinstance(f, HaliaxFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, HaliaxFinder())
