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
