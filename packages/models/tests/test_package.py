"""Packaging checks: version, typing marker, and the declared dependency on ponente-namedtensor."""

import importlib.metadata
import importlib.resources

import ponente.models


def test_version_and_typing_marker():
    assert ponente.models.__version__ == importlib.metadata.version("ponente-models")
    assert importlib.resources.files("ponente.models").joinpath("py.typed").is_file()


def test_namedtensor_is_declared_and_importable():
    requirements = importlib.metadata.requires("ponente-models") or []
    assert any(r.startswith("ponente-namedtensor") for r in requirements), requirements
    import ponente.namedtensor

    assert ponente.namedtensor.__version__
