"""Test configuration: a modest hypothesis profile, and the tests folder on ``sys.path``.

With ``--import-mode=importlib`` test modules are not importable by each other, so shared strategies live
in ``named_strategies.py`` and this file makes that module importable.
"""

import pathlib
import sys

from hypothesis import settings

sys.path.insert(0, str(pathlib.Path(__file__).parent))

settings.register_profile("ponente", max_examples=15, deadline=None)
settings.load_profile("ponente")
