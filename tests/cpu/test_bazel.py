"""BUILD.bazel is valid Starlark (as far as Python's parser and a stub evaluation can
tell; no Bazel here) and stays in step with the CMake build: the same FFI sources, every
kernel source, the kernels of kernels/config.py, every Python module."""

import ast
import glob
import pathlib
import re

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
# Python constructs Starlark does not have.
NOT_STARLARK = (ast.Import, ast.ImportFrom, ast.ClassDef, ast.While, ast.Try, ast.Lambda,
                ast.JoinedStr, ast.Global, ast.Nonlocal, ast.Yield, ast.With, ast.AsyncFunctionDef)


@pytest.fixture(scope="module")
def build():
    source = (REPO / "BUILD.bazel").read_text()
    tree = ast.parse(source, "BUILD.bazel")
    python_only = [type(n).__name__ for n in ast.walk(tree) if isinstance(n, NOT_STARLARK)]
    assert not python_only, f"not Starlark: {python_only}"

    rules = {}

    def rule(kind):
        def record(name, **attrs):
            assert name not in rules, f"duplicate target {name}"
            rules[name] = (kind, attrs)
        return record

    def stub_glob(patterns):
        return sorted({str(pathlib.Path(p).relative_to(REPO))
                       for pat in patterns for p in glob.glob(str(REPO / pat), recursive=True)})

    env = {"load": lambda *args: None, "package": lambda **kw: None, "glob": stub_glob,
           "requirement": lambda name: f"@pypi//{name}"}
    for kind in ("py_binary", "py_library", "genrule", "cc_library", "cc_import",
                 "nanobind_extension"):
        env[kind] = rule(kind)
    exec(compile(tree, "BUILD.bazel", "exec"), env)
    return rules, env


def test_names_every_source_cmake_builds(build):
    rules, _ = build
    cmake = (REPO / "CMakeLists.txt").read_text()
    cmake_sources = set(re.findall(r"\bffi/\w+\.cc\b", cmake))
    kind, ext = rules["jax_fa4/_ffi"]
    assert kind == "nanobind_extension"
    assert cmake_sources == {s for s in ext["srcs"] if s.endswith(".cc")}
    headers = {str(p.relative_to(REPO)) for p in (REPO / "ffi").glob("*.h")}
    assert headers <= set(ext["srcs"])
    kernel_sources = {str(p.relative_to(REPO)) for p in (REPO / "kernels").rglob("*.py")}
    assert kernel_sources == set(rules["exported_kernels"][1]["srcs"])
    assert kernel_sources == set(rules["export_kernels"][1]["srcs"])


def test_lists_the_manifest_kernels(build, monkeypatch):
    _, env = build
    monkeypatch.syspath_prepend(str(REPO))
    from kernels.config import MANIFEST

    assert env["KERNELS"] == [cfg.name for cfg in MANIFEST]


def test_packages_every_module(build):
    rules, _ = build
    modules = {str(p.relative_to(REPO)) for p in (REPO / "jax_fa4").glob("*.py")}
    assert modules == set(rules["jax_fa4"][1]["srcs"])
    assert rules["jax_fa4"][1]["data"] == [":jax_fa4/_ffi"]
