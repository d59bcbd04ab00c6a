"""The ``train_lm`` entry point and the version report it prints."""

import importlib.metadata
import importlib.resources
import subprocess
import sys

import ponente.trainer
from ponente.trainer.main import train_lm
from ponente.trainer.versions import PONENTE_PACKAGES, ponente_versions


def test_version_and_typing_marker():
    assert ponente.trainer.__version__ == importlib.metadata.version("ponente-trainer")
    assert importlib.resources.files("ponente.trainer").joinpath("py.typed").is_file()


def test_reports_every_package_with_its_installed_version():
    versions = ponente_versions()
    expected = {f"ponente-{name}": importlib.metadata.version(f"ponente-{name}") for name in PONENTE_PACKAGES}
    assert versions == expected


def test_main_prints_packages_and_devices(capsys):
    assert train_lm.main([]) == 0
    out = capsys.readouterr().out
    for name in PONENTE_PACKAGES:
        assert f"ponente-{name} " in out
    assert "JAX backend: cpu" in out


def test_runs_as_a_module():
    via_module = subprocess.run(
        [sys.executable, "-m", "ponente.trainer.main.train_lm"], check=True, capture_output=True, text=True
    ).stdout
    assert via_module.splitlines()[0].startswith("ponente-namedtensor ")
