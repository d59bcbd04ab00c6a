"""Packaging checks: version metadata, typing marker, PEP 420 namespace."""

import importlib.metadata
import importlib.resources

import ponente
import ponente.namedtensor


def test_version_matches_distribution_metadata():
    assert ponente.namedtensor.__version__ == importlib.metadata.version("ponente-namedtensor")


def test_ships_py_typed_marker():
    assert importlib.resources.files("ponente.namedtensor").joinpath("py.typed").is_file()


def test_ponente_is_a_namespace_package():
    # A regular package would have __file__ set to its __init__.py and would hide sibling packages.
    assert getattr(ponente, "__file__", None) is None
    assert len(list(ponente.__path__)) >= 1
