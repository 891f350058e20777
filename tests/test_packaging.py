"""The wheel a user installs carries every module, the files read by name at run time, and the license.

The test suite runs from an editable install, where everything in the checkout is importable and
readable; a pip user gets only what the wheel holds. A data folder the wheel left out once made the
README's first command fail for them (`elixir-ray train tiny`: no such config).
"""

import configparser
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "elixir_ray")


def _setuptools_builds_this_project() -> bool:
    try:
        import setuptools
    except ImportError:
        return False
    return int(setuptools.__version__.split(".")[0]) >= 77  # pyproject's build-system requirement


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    if not _setuptools_builds_this_project():
        pytest.skip("needs setuptools>=77 in this environment to build the wheel without the network")
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md", "LICENSE", "MANIFEST.in"):
        shutil.copy2(os.path.join(ROOT, name), src / name)
    shutil.copytree(PACKAGE, src / "elixir_ray", ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path_factory.mktemp("wheel")
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                            "--disable-pip-version-check", "-q", "-w", str(out), str(src)], capture_output=True, text=True)
    assert built.returncode == 0, f"pip wheel failed:\n{built.stdout}\n{built.stderr}"
    [name] = os.listdir(out)
    with zipfile.ZipFile(out / name) as zf:
        yield zf


def _package_files(suffixes: tuple) -> set[str]:
    found = set()
    for folder, dirs, files in os.walk(PACKAGE):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        for f in files:
            if f.endswith(suffixes):
                found.add(os.path.relpath(os.path.join(folder, f), ROOT).replace(os.sep, "/"))
    return found


def test_the_wheel_holds_every_module_and_every_file_read_by_name(wheel):
    names = set(wheel.namelist())
    assert _package_files((".py",)) <= names
    # what config.shipped_file reads: configs by name, hardware rates by name; the C source that
    # engine/host_kernel.py compiles where it runs
    data = _package_files((".yaml", ".json", ".c"))
    assert {"elixir_ray/configs/tiny.yaml", "elixir_ray/configs/demo.yaml", "elixir_ray/configs/llama-tiny.yaml",
            "elixir_ray/hardware/h100_anchors.json", "elixir_ray/engine/host_adam.c"} <= data
    assert data <= names
    assert not [n for n in names if n.startswith(("tests/", "jobs/", "docs/"))]


def test_the_wheel_names_its_license_and_its_command(wheel):
    names = wheel.namelist()
    [license_file] = [n for n in names if n.endswith(".dist-info/licenses/LICENSE")]
    assert wheel.read(license_file) == open(os.path.join(ROOT, "LICENSE"), "rb").read()
    [metadata] = [n for n in names if n.endswith(".dist-info/METADATA")]
    assert "License-Expression: Apache-2.0" in wheel.read(metadata).decode().splitlines()
    [entry_points] = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
    scripts = configparser.ConfigParser()
    scripts.read_string(wheel.read(entry_points).decode())
    assert scripts["console_scripts"]["elixir-ray"] == "elixir_ray.cli:main"


# what MANIFEST.in reads, beside the package: the sdist is built from a copy of these alone
SDIST_SOURCES = ("pyproject.toml", "README.md", "LICENSE", "MANIFEST.in", "Makefile", "cluster.yaml",
                 "elixir_ray", "tests", "jobs", "docs")


def test_the_sdist_carries_tests_jobs_and_docs_but_not_the_measured_data(tmp_path):
    """The raw results behind docs/benchmarks.md (docs/results/) and the measured runs the tests
    read (tests/data/) stay in the repository: the sdist holds the docs and tests without them."""
    if not _setuptools_builds_this_project():
        pytest.skip("needs setuptools>=77 in this environment to build the sdist without the network")
    src = tmp_path / "src"
    src.mkdir()
    for name in SDIST_SOURCES:
        path = os.path.join(ROOT, name)
        if os.path.isdir(path):
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        else:
            shutil.copy2(path, src / name)
    out = tmp_path / "sdist"
    built = subprocess.run([sys.executable, "-c", "import sys; from setuptools import build_meta; "
                            "print(build_meta.build_sdist(sys.argv[1]))", str(out)],
                           cwd=src, capture_output=True, text=True)
    assert built.returncode == 0, f"build_sdist failed:\n{built.stdout}\n{built.stderr}"
    [name] = os.listdir(out)
    with tarfile.open(out / name) as archive:
        members = {m.split("/", 1)[1] for m in archive.getnames() if "/" in m}
    assert {"docs/architecture.md", "tests/test_packaging.py", "jobs/bench_matrix.sh", "elixir_ray/__init__.py"} <= members
    assert not [m for m in members if m.startswith(("docs/results/", "tests/data/"))]
    if os.path.isdir(os.path.join(ROOT, ".git")):  # in the repository the data is there to leave out
        assert os.listdir(src / "docs" / "results") and os.listdir(src / "tests" / "data")


def test_make_says_it_is_installing_before_the_first_quiet_pip_and_nothing_once_installed(tmp_path):
    """`make demo` on a fresh machine was silent for about 72 s while pip installed quietly. Here the
    venv's python is a stand-in that does nothing, so only what make itself says is checked."""
    if shutil.which("make") is None:
        pytest.skip("needs make")
    python = tmp_path / "venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text("#!/bin/sh\nexit 0\n")
    python.chmod(0o755)

    def venv() -> list[str]:
        made = subprocess.run(["make", "-s", "-C", ROOT, "venv", f"VENV={tmp_path / 'venv'}"], capture_output=True,
                              text=True, timeout=60)
        assert made.returncode == 0, made.stderr
        return made.stdout.splitlines()

    assert venv() == ["installing (first run, about a minute)"]
    assert venv() == []
