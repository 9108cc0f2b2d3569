"""tests/gpu/part_times.py over a JUnit report that pytest itself writes."""

import importlib.util
import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[2]


def _part_times():
    spec = importlib.util.spec_from_file_location("part_times",
                                                  REPO / "tests/gpu/part_times.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_times_per_file_and_slowest(tmp_path, capsys):
    (tmp_path / "test_slow.py").write_text(
        "import time\n"
        "def test_a():\n    time.sleep(0.3)\n"
        "def test_b():\n    pass\n")
    (tmp_path / "test_fast.py").write_text("def test_c():\n    pass\n")
    report = tmp_path / "part.xml"
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                    f"--junitxml={report}", str(tmp_path)], check=True, cwd=tmp_path,
                   capture_output=True)
    rows, wall = _part_times().cases(report)
    assert sorted((f, n) for f, n, _ in rows) == [
        ("test_fast.py", "test_c"), ("test_slow.py", "test_a"), ("test_slow.py", "test_b")]
    assert wall >= 0.3

    _part_times().main([str(report), "--top", "1"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"{report}: 3 tests, ")
    # the slow file first, with its two tests
    assert lines[1].split()[:3] == ["test_slow.py", "2", "tests"]
    assert lines[2].split()[:3] == ["test_fast.py", "1", "tests"]
    assert lines[3] == "slowest 1:"
    assert lines[4].endswith("test_slow.py::test_a") and len(lines) == 5


def test_report_of_instant_tests(tmp_path, capsys):
    report = tmp_path / "part.xml"
    report.write_text('<testsuites><testsuite time="0.0">'
                      '<testcase classname="tests.gpu.test_gpu_x" name="test_a" time="0.0"/>'
                      '</testsuite></testsuites>')
    _part_times().main([str(report)])
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split() == ["test_gpu_x.py", "1", "tests", "0.0", "s", "0.0%"]
