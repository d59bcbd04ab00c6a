"""End to end: the installed `ponente-train` console script, with all four packages installed together."""

import importlib.metadata
import shutil
import subprocess

import pytest

pytestmark = pytest.mark.integration


def test_console_script_reports_all_four_installed_packages():
    """`ponente-train --version` names each installed package with its version."""
    exe = shutil.which("ponente-train")
    assert exe is not None, "the ponente-train console script is not on PATH"
    out = subprocess.run([exe, "--version"], check=True, capture_output=True, text=True).stdout
    for dist in ("ponente-namedtensor", "ponente-datacache", "ponente-models", "ponente-trainer"):
        assert f"{dist} {importlib.metadata.version(dist)}" in out.splitlines()
