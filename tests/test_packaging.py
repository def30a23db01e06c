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
