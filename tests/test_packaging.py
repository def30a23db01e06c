"""The wheel holds every package: the folders stay at the top of the repository and
pyproject.toml lists each ``pdserve.*`` package by hand, so a new sub-package it does not list
works in the editable install the suite uses and is missing from a built wheel (the Docker
images install one)."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_package_folder_is_listed() -> None:
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(tool["packages"])
    found = {"pdserve"}
    for top, package in tool["package-dir"].items():
        folder = ROOT / package
        for init in folder.rglob("__init__.py"):
            relative = init.parent.relative_to(folder).parts
            found.add(".".join((top, *relative)))
    assert found - listed == set(), "packages pyproject.toml does not list"
    assert listed - found == set(), "listed packages with no folder"


RUN_TIME_FILES = ("*.c", "*.json", "*.jinja", "*.txt")  # kernels built, data read at run time
NOT_SHIPPED = ("bench/results/",)  # committed figures, read from a checkout by its scripts


def test_every_kernel_and_data_file_is_in_the_wheel() -> None:
    """A C kernel the wheel lacks is not an error: the engine falls back to its torch path,
    several times slower (the Docker images ran so until the kernels were listed)."""
    import fnmatch
    import subprocess

    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    data: dict[str, list[str]] = tool["package-data"]
    folders = {package: top for top, package in tool["package-dir"].items()}
    tracked = subprocess.run(
        ["git", "ls-files", *folders], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    missing = []
    for path in tracked:
        if path.startswith(NOT_SHIPPED) or not any(
            fnmatch.fnmatch(Path(path).name, pattern) for pattern in RUN_TIME_FILES
        ):
            continue
        # the package holding it: its deepest folder with an __init__.py
        home = Path(path).parent
        while not (ROOT / home / "__init__.py").exists():
            home = home.parent
        package = ".".join((folders[home.parts[0]], *home.parts[1:]))
        inside = Path(path).relative_to(home).as_posix()
        if not any(fnmatch.fnmatch(inside, pattern) for pattern in data.get(package, [])):
            missing.append(path)
    assert missing == [], "run-time files no package-data pattern takes into the wheel"
