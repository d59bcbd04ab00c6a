"""Packaging checks, and the package boundary: ponente.datacache never imports JAX."""

import importlib.metadata
import importlib.resources
import subprocess
import sys

import ponente.datacache


def test_version_and_typing_marker():
    assert ponente.datacache.__version__ == importlib.metadata.version("ponente-datacache")
    assert importlib.resources.files("ponente.datacache").joinpath("py.typed").is_file()


def test_import_does_not_pull_in_jax():
    # A fresh interpreter, so modules imported by other tests do not mask the result.
    code = "import sys, ponente.datacache; print(sorted(m for m in sys.modules if m.startswith('jax')))"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    assert out.strip() == "[]"


def test_jax_is_not_a_declared_dependency():
    requirements = importlib.metadata.requires("ponente-datacache") or []
    core = [r for r in requirements if "extra ==" not in r]
    assert not [r for r in core if r.lower().startswith(("jax", "jaxlib"))], core
