"""Where a GPU part's minutes go, from the JUnit XML that run_parts.sh writes for it
(build/gpu-parts/PART.xml, or JUNIT_DIR/PART.xml):

    python tests/gpu/part_times.py build/gpu-parts/*.xml [--top 15]

Per test file: its tests and the seconds they took (summed over the workers, so the
files of a part add up to more than its wall time, which is printed beside them), then
the slowest tests. Reads only the XML: runs anywhere.
"""

import argparse
import xml.etree.ElementTree as ET
from collections import defaultdict


def cases(path):
    """(file, test id, seconds) of each test case in a JUnit XML report, and the
    report's wall seconds."""
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    rows, wall = [], 0.0
    for suite in suites:
        wall += float(suite.get("time", 0))
        for case in suite.iter("testcase"):
            # classname is the module's dotted path: tests.gpu.test_gpu_numerics
            module = case.get("classname", "").rsplit(".", 1)[-1]
            rows.append((f"{module}.py", case.get("name", ""), float(case.get("time", 0))))
    return rows, wall


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("reports", nargs="+")
    ap.add_argument("--top", type=int, default=15)
    args = ap.parse_args(argv)
    every = []
    for path in args.reports:
        rows, wall = cases(path)
        every += rows
        per_file = defaultdict(lambda: [0, 0.0])
        for file, _, seconds in rows:
            per_file[file][0] += 1
            per_file[file][1] += seconds
        total = sum(s for _, s in per_file.values())
        print(f"{path}: {len(rows)} tests, {wall:.1f} s wall, {total:.1f} s of test time")
        for file, (count, seconds) in sorted(per_file.items(), key=lambda kv: -kv[1][1]):
            share = 100 * seconds / total if total else 0.0
            print(f"  {file:36s} {count:5d} tests {seconds:8.1f} s  {share:5.1f}%")
    print(f"slowest {args.top}:")
    for file, name, seconds in sorted(every, key=lambda r: -r[2])[:args.top]:
        print(f"  {seconds:7.2f} s  {file}::{name}")


if __name__ == "__main__":
    main()
