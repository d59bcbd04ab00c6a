"""Compare two JUnit XML reports of Haliax's test suite: real Haliax (the denominator) vs ponente.namedtensor.

Prints ``compat: P/N (x %) of the tests that pass on Haliax pass on ponente.namedtensor``, the same per test file,
and the ids that fail on Ponente only; exits non-zero if the overall rate or any file's rate is below its threshold.

Tests listed on the namedtensor docs page "Differences from Haliax" (``docs/namedtensor/docs/differences.md``, each
excluded id in backquotes on a line starting with ``- `tests/``) are deliberate differences: they are removed from
the denominator and counted separately.

Usage::

    python report.py HALIAX.xml PONENTE.xml --min-rate 97 --min-file-rate 90 --differences differences.md
"""

from __future__ import annotations

import argparse
import collections
import re
import sys
import xml.etree.ElementTree as ET
from pathlib import Path


def outcomes(junit: Path) -> dict[str, str]:
    """Test id (``file.py::name[param]``) -> ``passed``, ``failed``, ``error`` or ``skipped``."""
    if not junit.is_file():
        raise SystemExit(f"compat: no test report at {junit} (did pytest run?)")
    result: dict[str, str] = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        classname = case.get("classname", "")
        file = classname.split(".")[0] + ".py" if classname else case.get("file", "?")
        # classes inside a test file: classname is "module.Class"
        rest = classname.split(".")[1:]
        test_id = "::".join([file, *rest, case.get("name", "?")])
        status = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                status = "failed"
            elif child.tag == "skipped":
                status = "skipped"
        # a test that passed but whose teardown errored appears twice; any failure wins
        if result.get(test_id) == "failed":
            continue
        result[test_id] = status
    return result


def excluded_ids(page: Path | None) -> set[str]:
    """The test ids the differences page lists (``- `tests/FILE::NAME` ...`` lines)."""
    if page is None:
        return set()
    ids = set()
    for line in page.read_text().splitlines():
        m = re.match(r"\s*[-*]\s+`tests/([^`]+)`", line)
        if m:
            ids.add(m.group(1))
    return ids


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("haliax", type=Path, help="JUnit XML of the run against real Haliax")
    parser.add_argument("ponente", type=Path, help="JUnit XML of the run against ponente.namedtensor")
    parser.add_argument("--min-rate", type=float, default=0.0, help="fail below this overall pass rate (percent)")
    parser.add_argument("--min-file-rate", type=float, default=0.0, help="fail if a file is below this (percent)")
    parser.add_argument("--differences", type=Path, default=None, help="the 'Differences from Haliax' docs page")
    parser.add_argument("--list-failures", action="store_true", help="print every failing id")
    args = parser.parse_args(argv)

    reference = outcomes(args.haliax)
    ours = outcomes(args.ponente)
    excluded = excluded_ids(args.differences)
    unknown = sorted(t for t in excluded if t not in reference)
    if unknown:
        print(f"compat: the differences page lists ids that are not Haliax tests: {unknown}")
        return 2
    denominator = sorted(t for t, s in reference.items() if s == "passed" and t not in excluded)
    passed = [t for t in denominator if ours.get(t) == "passed"]
    failing = [t for t in denominator if ours.get(t) != "passed"]
    if len(excluded) > 0.02 * (len(denominator) + len(excluded)):
        print(f"compat: {len(excluded)} excluded ids are more than 2 % of the suite")
        return 2

    per_file: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
    for t in denominator:
        counts = per_file[t.split("::")[0]]
        counts[1] += 1
        counts[0] += ours.get(t) == "passed"
    width = max((len(f) for f in per_file), default=10)
    print(f"{'file':<{width}}  passed/total   rate")
    bad_files = []
    for f in sorted(per_file):
        p, n = per_file[f]
        rate = 100.0 * p / n
        flag = "" if rate >= args.min_file_rate else f"   < {args.min_file_rate:g} %"
        if flag:
            bad_files.append(f)
        print(f"{f:<{width}}  {p:>6}/{n:<6} {rate:6.1f} %{flag}")
    if args.list_failures or failing:
        print("\nfailing on ponente.namedtensor only:")
        for t in failing:
            print(f"  {t}  [{ours.get(t, 'not run')}]")
    total_rate = 100.0 * len(passed) / max(len(denominator), 1)
    skipped_ref = sum(1 for s in reference.values() if s != "passed")
    print(
        f"\n({len(reference)} Haliax tests collected; {skipped_ref} fail or skip on Haliax itself and "
        f"{len(excluded)} are listed differences -- neither counts)"
    )
    print(
        f"compat: {len(passed)}/{len(denominator)} ({total_rate:.1f} %) of the tests that pass on Haliax "
        "pass on ponente.namedtensor"
    )
    if total_rate < args.min_rate:
        print(f"compat: FAILED -- overall rate below the threshold {args.min_rate:g} %")
        return 1
    if bad_files:
        print(f"compat: FAILED -- files below {args.min_file_rate:g} %: {', '.join(bad_files)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
