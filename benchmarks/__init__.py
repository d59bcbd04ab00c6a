"""Ponente's benchmark harness, shared by all packages.

``python -m benchmarks run SUITE [--output FILE]`` runs ``benchmarks/suites/SUITE.py`` and writes one JSON
line per measurement; ``python -m benchmarks compare A.jsonl B.jsonl`` prints B/A ratios. See
``benchmarks/README.md``.
"""
