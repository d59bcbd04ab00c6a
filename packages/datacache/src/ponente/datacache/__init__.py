"""Resumable, reproducible on-disk token caches and random-access datasets over them.

This package never imports JAX: everything it returns is NumPy.
"""

__version__ = "0.1.0"
