"""The import contracts (``.importlinter``) catch what they promise to catch.

Each case plants one forbidden import (or an unplaced module) in a copy of the four packages' sources and
runs ``lint-imports`` over the copy: the contract that forbids it must break. The unmodified copy must keep
every contract, so a failure below is the planted import's and not the copy's. Run by ``nox -s lint``
(``pytest tests/test_import_contracts.py``); needs ``import-linter``, not the packages' dependencies.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("namedtensor", "datacache", "models", "trainer")
LINT_IMPORTS = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or shutil.which("lint-imports")

pytestmark = pytest.mark.skipif(LINT_IMPORTS is None, reason="import-linter is not installed (nox -s lint has it)")


def copy_sources(dest: Path) -> Path:
    """Copy ``.importlinter`` and every package's ``src`` folder under ``dest``; return the copied config."""
    for package in PACKAGES:
        shutil.copytree(
            ROOT / "packages" / package / "src",
            dest / package / "src",
            ignore=shutil.ignore_patterns("__pycache__", "*.pyc"),
        )
    config = dest / ".importlinter"
    shutil.copyfile(ROOT / ".importlinter", config)
    return config


def lint_imports(config: Path, *contracts: str) -> subprocess.CompletedProcess[str]:
    """``lint-imports`` over the sources next to ``config`` (only they are on the path), limited to ``contracts``."""
    sources = [str(config.parent / package / "src") for package in PACKAGES]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sources)}
    args = [LINT_IMPORTS or "lint-imports", str(config), "--no-cache", "--no-logo"]
    for contract in contracts:
        args += ["--contract", contract]
    return subprocess.run(args, cwd=config.parent, env=env, capture_output=True, text=True, check=False)


def plant(config: Path, relative: str, code: str) -> None:
    """Append ``code`` to the module ``relative`` (``<package>/<path below src/ponente/<package>>``), or create it."""
    package, _, rest = relative.partition("/")
    path = config.parent / package / "src" / "ponente" / package / rest
    before = path.read_text() if path.exists() else '"""A module planted by the test."""\n'
    path.write_text(before + "\n\n" + code + "\n")


@pytest.fixture(scope="module")
def unmodified_sources_keep_every_contract(tmp_path_factory: pytest.TempPathFactory) -> None:
    result = lint_imports(copy_sources(tmp_path_factory.mktemp("unmodified")))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


def test_the_unmodified_sources_keep_every_contract(unmodified_sources_keep_every_contract: None) -> None:
    """The fixture checks it, once for every test below."""


# (contract id, module to edit, code to add): each must break exactly the contract named.
VIOLATIONS = {
    "datacache imports jax": ("datacache-standalone", "datacache/dataset.py", "import jax"),
    "datacache imports our models": ("datacache-standalone", "datacache/ledger.py", "import ponente.models"),
    "models import the trainer": (
        "models-see-only-namedtensor",
        "models/rotary.py",
        "def _late():\n    from ponente.trainer import state  # function-level imports count",
    ),
    "trainer imports a private module of models": (
        "public-interfaces-only",
        "trainer/lm.py",
        "from ponente.models import _layer_types",
    ),
    "trainer imports a private module of namedtensor": (
        "public-interfaces-only",
        "trainer/sample.py",
        "from ponente.namedtensor import _parsing",
    ),
    "a cycle in models": (
        "no-cycles",
        "models/attention/_mask.py",
        "def _late():\n    from ponente.models.attention import backends",
    ),
    "a cycle in a trainer subpackage": (
        "no-cycles",
        "trainer/checkpoint/_location.py",
        "def _late():\n    from ponente.trainer.checkpoint import _io",
    ),
    "a trainer foundation imports a component above it": (
        "trainer-layers",
        "trainer/state.py",
        "import ponente.trainer.data",
    ),
    "the loop imports the entry points": ("trainer-layers", "trainer/trainer/_loop.py", "import ponente.trainer.main"),
    "attention imports the model interface": (
        "models-layers",
        "models/attention/flash.py",
        "import ponente.models.lm",
    ),
    "the reference backend imports the backends by name": (
        "models-attention-layers",
        "models/attention/reference.py",
        "import ponente.models.attention.backends",
    ),
    "a loss kernel imports the next-token loss": (
        "models-loss-layers",
        "models/loss/blockwise.py",
        "import ponente.models.loss.next_token",
    ),
    "a new model module placed in no layer": ("models-layers", "models/newmodel.py", "import ponente.models.config"),
    "datacache errors import the builder": (
        "datacache-layers",
        "datacache/errors.py",
        "import ponente.datacache.builder",
    ),
}


@pytest.mark.parametrize("case", sorted(VIOLATIONS))
def test_a_planted_violation_breaks_its_contract(
    unmodified_sources_keep_every_contract: None, tmp_path: Path, case: str
) -> None:
    contract, module, code = VIOLATIONS[case]
    config = copy_sources(tmp_path)
    plant(config, module, code)
    after = lint_imports(config, contract)
    assert after.returncode == 1, f"{case}: contract {contract} still kept:\n{after.stdout}{after.stderr}"
    assert "1 broken" in after.stdout, after.stdout
