"""Every path the READMEs point to exists: markdown links and images, repository paths in
inline code and in command blocks (a script to run, a result file), and each file and folder
the layout table names for its package. Read as text; nothing is run."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
READMES = [ROOT / "README.md", ROOT / "bench" / "README.md"]

LINK = re.compile(r"\]\(([^)\s]+)\)")  # [text](target), ![alt](target)
SPAN = re.compile(r"`([^`]+)`")
# a relative path with at least one folder: bench/micro/gpu.py, bench/results/, models/data/
PATH = re.compile(r"[\w.-]+(?:/[\w.-]+)*/[\w.-]*")
# a layout-table entry: a file (``compile.py``) or a folder (``tools/``), maybe nested
ENTRY = re.compile(r"\w[\w.-]*(?:/[\w.-]+)*(?:/|\.(?:py|c|sh|md|json|png|jinja|txt|toml))")
EXTERNAL = ("http://", "https://", "mailto:", "#")


def repo_path(path: str, bases: list[Path]) -> bool:
    """Whether ``path`` claims to be in the repository: its first part is there, next to the
    README or at the top (``out/run.json`` or ``keys/nodeX`` are what a command writes)."""
    first = path.split("/")[0]
    return not first.startswith(".") and any((b / first).exists() for b in bases)


def resolves(path: str, bases: list[Path]) -> bool:
    return any((base / path).exists() for base in bases)


def links(text: str) -> Iterator[tuple[int, str]]:
    """(line, target) of every relative link, its ``#anchor`` cut off."""
    for number, line in enumerate(text.splitlines(), 1):
        for target in LINK.findall(line):
            if not target.startswith(EXTERNAL):
                yield number, target.split("#")[0]


def code_paths(text: str) -> Iterator[tuple[int, str]]:
    """(line, path) of every path-shaped word in inline code and in fenced blocks."""
    fenced = False
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        code = [line] if fenced else SPAN.findall(line)
        for words in code:
            for word in re.split(r"[\s=]+", words):
                if PATH.fullmatch(word):
                    yield number, word


def layout_rows(text: str) -> Iterator[tuple[list[str], list[str]]]:
    """The layout table's rows: (the row's folders, the files and folders it names in them)."""
    section = text.split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]
    for line in section.splitlines():
        cells = line.split(" | ")
        if not line.startswith("| `") or len(cells) < 2:
            continue
        folders = SPAN.findall(cells[0])
        names = [s for cell in cells[1:] for s in SPAN.findall(cell) if ENTRY.fullmatch(s)]
        yield folders, names


def missing(readme: Path, root: Path = ROOT) -> list[str]:
    """What ``readme`` points to that is not there: links resolve from its folder, paths in
    code from its folder or the repository's top."""
    text = readme.read_text(encoding="utf-8")
    name = readme.relative_to(root)
    bases = [readme.parent, root]
    bad = [f"{name}:{n}: link {t}" for n, t in links(text) if not (readme.parent / t).exists()]
    bad += [
        f"{name}:{n}: {p}"
        for n, p in code_paths(text)
        if repo_path(p, bases) and not resolves(p, bases)
    ]
    return bad


def test_every_link_and_repository_path_in_the_readmes_exists() -> None:
    bad = [line for readme in READMES for line in missing(readme)]
    assert not bad, bad


def test_every_file_the_layout_table_names_is_in_its_package() -> None:
    rows = list(layout_rows((ROOT / "README.md").read_text(encoding="utf-8")))
    bad = []
    for folders, names in rows:
        bases = [ROOT / f for f in folders] + [ROOT]
        assert all(b.is_dir() for b in bases), folders
        bad += [f"{folders}: {n}" for n in names if not resolves(n, bases)]
    assert not bad, bad
    folders = {f for row, _ in rows for f in row}
    assert {"engine/", "models/", "bench/", "bench/experiments/", "bench/micro/"} <= folders


def test_the_checks_find_what_they_check(tmp_path: Path) -> None:
    """What the tests above read is there to read, and a stale path is reported."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    checked = {p for _, p in code_paths(text)}
    assert {"bench/experiments/kv_routing.py", "launch/local.sh", "bench/micro/gpu.py"} <= checked
    assert "bench/results/peers.json" in {t for _, t in links(text)}
    engine = next(names for folders, names in layout_rows(text) if folders == ["engine/"])
    assert "attention/cpu_decode.c" in engine and "fork.py" in engine
    stale = tmp_path / "README.md"
    (tmp_path / "bench").mkdir()
    stale.write_text(
        "See [it](bench/gone.md), run `bench/old.py` or\n```sh\npython bench/x.py --out out/a.json"
        "\n```\n"
    )
    assert [line.split(": ", 1)[1] for line in missing(stale, tmp_path)] == [
        "link bench/gone.md",
        "bench/old.py",
        "bench/x.py",
    ]
