"""The cross-package matrix: ``nox`` runs every default session; ``nox -s NAME`` runs one.

Every session installs the packages from their local folders (never from an index, so a package of
the same name elsewhere can never shadow ours) into a fresh virtualenv. pip's cache is left on, so
reruns on the same machine reuse the downloaded wheels.
"""

from __future__ import annotations

import glob
import os
import shutil
import sys
import tempfile
from pathlib import Path

import nox

nox.options.error_on_missing_interpreters = True
nox.needs_version = ">=2024.3.2"

ROOT = Path(__file__).parent
PACKAGES = ("namedtensor", "datacache", "models", "trainer")
# Our own packages each one depends on (everything else comes from its pyproject.toml).
SIBLINGS: dict[str, tuple[str, ...]] = {
    "namedtensor": (),
    "datacache": (),
    "models": ("namedtensor",),
    "trainer": ("namedtensor", "datacache", "models"),
}
# Extras each package's own tests need besides `test` (e.g. the Ray backend of the cache builder).
TEST_EXTRAS: dict[str, tuple[str, ...]] = {
    "namedtensor": ("test",),
    "datacache": ("test", "ray", "hf"),
    "models": ("test", "torch"),
    "trainer": ("test", "wandb", "ray"),
}
# What mypy and the docs examples need: the packages and the extras the examples import, without the parity
# stack (torch, transformers), Ray or wandb -- each full-stack venv is ~2.4 GB, and a CI disk is not infinite.
LEAN_EXTRAS: dict[str, tuple[str, ...]] = {"datacache": ("hf",)}
PYTEST_NO_TESTS_COLLECTED = 5


def _requirement(package: str, extras: tuple[str, ...] = (), *, editable: bool = False) -> list[str]:
    spec = f"./packages/{package}"
    if extras:
        spec += f"[{','.join(extras)}]"
    return ["-e", spec] if editable else [spec]


def _install_all(
    session: nox.Session, *, editable: bool = False, extras: dict[str, tuple[str, ...]] = TEST_EXTRAS
) -> None:
    """Install the four packages with the given extras (default: the extras their tests use)."""
    args: list[str] = []
    for package in PACKAGES:
        args += _requirement(package, extras.get(package, ()), editable=editable)
    session.install(*args)


def _pytest_each_package(session: nox.Session, *pytest_args: str) -> None:
    """Run pytest in each package's folder; fail if no package had a test to run.

    Per-package runs keep each package's pytest configuration and conftest files separate.
    """
    ran = []
    for package in PACKAGES:
        with session.chdir(ROOT / "packages" / package):
            code = session.run("pytest", *pytest_args, success_codes=[0, PYTEST_NO_TESTS_COLLECTED])
        if code != PYTEST_NO_TESTS_COLLECTED:
            ran.append(package)
    if not ran:
        session.error(f"no test selected by {' '.join(pytest_args)} in any package")
    session.log(f"ran tests in: {', '.join(ran)}")


@nox.session
@nox.parametrize("package", list(PACKAGES))
def tests(session: nox.Session, package: str) -> None:
    """One package alone: a fresh venv with only that package, what it declares, and its test extras."""
    args: list[str] = []
    for sibling in SIBLINGS[package]:
        args += _requirement(sibling)
    session.install(*args, *_requirement(package, TEST_EXTRAS[package]))
    with session.chdir(ROOT / "packages" / package):
        # Each package's pytest configuration deselects `multidevice` and `integration` tests by default.
        session.run("pytest", *session.posargs)


@nox.session
def multidevice(session: nox.Session) -> None:
    """Tests marked `multidevice`, with 8 simulated CPU devices."""
    _install_all(session)
    session.env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    _pytest_each_package(session, "-m", "multidevice", *session.posargs)


@nox.session
def integration(session: nox.Session) -> None:
    """All four packages together; end-to-end tests marked `integration`."""
    _install_all(session)
    session.env["RAY_AUTH_MODE"] = "disabled"
    _pytest_each_package(session, "-m", "integration", *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff check and ruff format --check over the whole repository."""
    session.install("ruff>=0.8")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
def typecheck(session: nox.Session) -> None:
    """mypy over the sources of all four packages (configuration in mypy.ini)."""
    _install_all(session, editable=True, extras=LEAN_EXTRAS)
    session.install("mypy>=1.13", "types-PyYAML")
    session.run("mypy", *session.posargs)


@nox.session
def docs(session: nox.Session) -> None:
    """Build each package's site with --strict, then run every Python example in the docs."""
    _install_all(session, extras=LEAN_EXTRAS)
    session.install("mkdocs>=1.6", "mkdocs-material>=9.5", "mkdocstrings[python]>=0.27")
    session.env["NO_MKDOCS_2_WARNING"] = "1"
    for package in PACKAGES:
        session.run(
            "mkdocs", "build", "--strict", "-f", f"docs/{package}/mkdocs.yml", "-d", str(ROOT / "site" / package)
        )
    session.run("python", "docs/run_examples.py", *PACKAGES)


@nox.session
def build(session: nox.Session) -> None:
    """Build wheels and sdists, twine-check them, then install each wheel alone in a fresh venv and import it."""
    session.install("build>=1.2", "twine>=5")
    dist = ROOT / "dist"
    shutil.rmtree(dist, ignore_errors=True)
    for package in PACKAGES:
        session.run("python", "-m", "build", "--outdir", str(dist), f"packages/{package}")
    session.run("twine", "check", "--strict", *sorted(glob.glob(str(dist / "*"))))

    def wheel(package: str) -> str:
        (found,) = glob.glob(str(dist / f"ponente_{package}-*.whl"))
        return found

    for package in PACKAGES:
        with tempfile.TemporaryDirectory(prefix=f"ponente-{package}-") as venv:
            session.run(sys.executable, "-m", "venv", venv)
            python = os.path.join(venv, "bin", "python")
            # Siblings are passed as wheel files so the resolver cannot take them from an index.
            wheels = [wheel(p) for p in (*SIBLINGS[package], package)]
            session.run(python, "-m", "pip", "install", "--quiet", *wheels, external=True)
            session.run(
                python,
                "-c",
                f"import ponente.{package} as m; print('ponente-{package}', m.__version__, 'from', m.__file__)",
                external=True,
            )


@nox.session(default=False)
def bench(session: nox.Session) -> None:
    """The benchmark harness: `nox -s bench -- SUITE...` (default: every suite). Not run by default."""
    _install_all(session)
    suites = session.posargs or ["all"]
    out = ROOT / "bench-results"
    out.mkdir(exist_ok=True)
    for suite in suites:
        session.run("python", "-m", "benchmarks", "run", suite, "--output", str(out / f"{suite}.jsonl"))
