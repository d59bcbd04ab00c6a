"""Benchmark suites: each module defines ``run(rec: benchmarks.harness.Recorder) -> None``."""
