"""Packages depend one way, as the README's "Layout" states it, read from the source with ``ast``
(no package is imported here): ``protocol`` imports nothing of pdserve, each package imports
only the packages below it, no two packages import each other, what the torch-free roles
load at import time never reaches torch, and the gateway's sub-packages (``gateway/tools/``,
``gateway/tenancy/``) never reach the gateway's HTTP app."""

from __future__ import annotations

import ast
import functools
import re
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# package -> the packages it may import (README, "Layout"); ``pdserve`` (the namespace's root:
# ``pdserve.envs``) is open to every package but ``protocol``.
BELOW: dict[str, set[str]] = {
    "protocol": set(),
    "models": set(),
    "runtime": {"protocol"},
    "engine": {"protocol", "models"},
    "kvtransfer": {"protocol", "runtime", "engine"},
    "worker": {"protocol", "runtime", "engine", "kvtransfer", "models"},
    "prefill": {"protocol", "runtime", "engine", "kvtransfer", "worker"},
    "decode": {"protocol", "runtime", "engine", "kvtransfer", "worker"},
    "coordinator": {"protocol", "runtime", "kvtransfer"},
    "gateway": {"protocol", "runtime", "engine"},
    "sim": {"protocol", "coordinator"},  # the coordinator's own policies and profiles
}
TOP = {"launch", "bench"}  # entry points and tools: they may import any package
# at import time, transitively
TORCH_FREE = ["protocol", "runtime", "coordinator", "gateway", "sim"]
# The gateway's HTTP app: endpoints, middleware, response bodies, the server. A sub-package of
# the gateway is a concern the app uses, never one that uses the app.
GATEWAY_APP = [
    "app",
    "main",
    "admission",
    "api_extras",
    "drain",
    "headers",
    "http_limits",
    "responses",
]


def package_dirs() -> dict[str, Path]:
    """Installed package name (``protocol``) -> its folder, from pyproject's package-dir."""
    text = (ROOT / "pyproject.toml").read_text()
    pairs = re.findall(r'^"pdserve\.([a-z_]+)" = "([a-z_]+)"$', text, flags=re.M)
    return {name: ROOT / folder for name, folder in pairs}


PACKAGES = package_dirs()


def module_file(module: str) -> Path | None:
    """The source file of ``pdserve.<package>.<...>``, or None (not ours, or not a module)."""
    parts = module.split(".")
    if parts[0] != "pdserve":
        return None
    if len(parts) == 1:
        base = ROOT / "pdserve"
    elif parts[1] in PACKAGES:
        base = PACKAGES[parts[1]].joinpath(*parts[2:])
    else:
        base = ROOT / "pdserve" / Path(*parts[1:])
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def module_name(path: Path) -> str:
    for name, folder in PACKAGES.items():
        if path.is_relative_to(folder):
            rest = path.relative_to(folder).with_suffix("").parts
            rest = rest[:-1] if rest[-1] == "__init__" else rest
            return ".".join(("pdserve", name, *rest))
    raise AssertionError(f"{path} is in no package")


def imports(tree: ast.AST) -> Iterator[tuple[str, bool]]:
    """(module, imported when the file is) for every import in ``tree``: one inside a function
    or under ``if TYPE_CHECKING`` runs later or never. ``from a import b`` yields ``a`` and
    ``a.b`` (a submodule, or a name the caller fails to find a file for)."""

    def visit(node: ast.AST, now: bool) -> Iterator[tuple[str, bool]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                yield from ((a.name, now) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                assert child.level == 0 and child.module, "relative imports are not used"
                yield child.module, now
                yield from ((f"{child.module}.{a.name}", now) for a in child.names)
            elif isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
                yield from visit(child, False)
            elif isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                for stmt in child.body:
                    yield from visit(ast.Module(body=[stmt], type_ignores=[]), False)
                for stmt in child.orelse:
                    yield from visit(ast.Module(body=[stmt], type_ignores=[]), now)
            else:
                yield from visit(child, now)

    yield from visit(tree, True)


def sources(package: str) -> list[Path]:
    return sorted(PACKAGES[package].rglob("*.py"))


@functools.cache
def parsed(path: Path) -> list[tuple[str, bool]]:
    return list(imports(ast.parse(path.read_text(), filename=str(path))))


def package_of(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "pdserve":
        return None
    return parts[1] if len(parts) > 1 and parts[1] in PACKAGES else "pdserve"


@functools.cache
def package_graph() -> dict[str, dict[str, str]]:
    """package -> {package it imports: the first file that does}."""
    graph: dict[str, dict[str, str]] = {}
    for package in PACKAGES:
        edges = graph.setdefault(package, {})
        for path in sources(package):
            for module, _ in parsed(path):
                other = package_of(module)
                if other is not None and other != package:
                    edges.setdefault(other, str(path.relative_to(ROOT)))
    return graph


def test_the_table_names_every_package() -> None:
    unknown = sorted(set(PACKAGES) - set(BELOW) - TOP)
    assert not unknown, f"packages with no place in the dependency direction: {unknown}"


def test_protocol_imports_nothing_of_pdserve_but_itself() -> None:
    assert package_graph()["protocol"] == {}


def test_every_package_imports_only_those_below_it() -> None:
    graph = package_graph()
    wrong = {
        f"{package} -> {other} ({where})"
        for package, allowed in BELOW.items()
        for other, where in graph[package].items()
        if other not in allowed and not (other == "pdserve" and package != "protocol")
    }
    assert not wrong, sorted(wrong)


def test_no_import_cycle_between_packages() -> None:
    graph = package_graph()

    def cycle_from(start: str) -> list[str] | None:
        stack = [(start, [start])]
        seen: set[str] = set()
        while stack:
            node, path = stack.pop()
            for nxt in graph.get(node, {}):
                if nxt == start:
                    return [*path, start]
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, [*path, nxt]))
        return None

    cycles = [c for p in graph if (c := cycle_from(p)) is not None]
    assert not cycles, [" -> ".join(c) for c in cycles]


def loaded_at_import(path: Path) -> Iterator[tuple[str, list[str]]]:
    """Every module importing ``path`` loads (parent packages' ``__init__`` included), with the
    chain of pdserve modules that leads to it."""
    start = module_name(path)
    parts = start.split(".")
    parents = [".".join(parts[:i]) for i in range(1, len(parts))]
    chains = {name: [name] for name in [*parents, start]}
    yield from ((name, chains[name]) for name in parents)
    todo = [*parents, start]
    while todo:
        module = todo.pop()
        file = module_file(module)
        if file is None:
            continue
        for imported, now in parsed(file):
            if not now:
                continue
            parts = imported.split(".")
            for i in range(1, len(parts) + 1):  # a.b.c loads a, a.b and a.b.c
                name = ".".join(parts[:i])
                if name not in chains:
                    chains[name] = [*chains[module], name]
                    yield name, chains[name]
                    if module_file(name) is not None:
                        todo.append(name)


def test_the_torch_free_packages_never_load_torch_or_a_torch_module() -> None:
    bad = set()
    for package in TORCH_FREE:
        for path in sources(package):
            for name, chain in loaded_at_import(path):
                if name == "torch" or name.startswith("torch."):
                    bad.add(" -> ".join(chain))
    assert not bad, sorted(bad)


def gateway_subpackages() -> list[Path]:
    return sorted(init.parent for init in PACKAGES["gateway"].glob("*/__init__.py"))


def test_the_gateways_subpackages_never_import_its_http_app() -> None:
    """Not directly (at any time: in a function, under ``TYPE_CHECKING``), nor through what a
    module loads at import time."""
    app = {f"pdserve.gateway.{name}" for name in GATEWAY_APP}
    bad = set()
    for folder in gateway_subpackages():
        for path in sorted(folder.rglob("*.py")):
            here = str(path.relative_to(ROOT))
            bad |= {f"{here} -> {module}" for module, _ in parsed(path) if module in app}
            bad |= {" -> ".join(chain) for name, chain in loaded_at_import(path) if name in app}
    assert not bad, sorted(bad)


def test_coordinator_protocol_and_runtime_import_no_engine() -> None:
    graph = package_graph()
    for package in ("protocol", "runtime", "coordinator"):
        assert "engine" not in graph[package], (package, graph[package])


def test_the_checks_see_what_they_check() -> None:
    """Each check above can fail: the parser finds a lazy import, a TYPE_CHECKING one, and the
    chains through a package's ``__init__``."""
    tree = ast.parse(
        "import a\nfrom b import c\nif TYPE_CHECKING:\n    import torch\ndef f():\n    import d\n"
    )
    assert list(imports(tree)) == [
        ("a", True),
        ("b", True),
        ("b.c", True),
        ("torch", False),
        ("d", False),
    ]
    assert package_graph()["worker"].keys() >= {"engine", "runtime", "protocol"}
    loaded = dict(loaded_at_import(PACKAGES["kvtransfer"] / "zmq_backend.py"))
    assert "torch" in loaded  # the host backend copies tensors: found through its imports
    assert "pdserve.kvtransfer" in loaded  # its package's __init__ runs first
    assert module_file("pdserve.protocol.messages") == PACKAGES["protocol"] / "messages.py"
    assert module_file("pdserve.envs") == ROOT / "pdserve" / "envs.py"
    gateway = PACKAGES["gateway"]
    assert {"tools", "tenancy"} <= {p.name for p in gateway_subpackages()}
    assert gateway / "tenancy" / "core.py" in sources("gateway")  # sub-packages are walked
    assert module_name(gateway / "tenancy" / "core.py") == "pdserve.gateway.tenancy.core"
    assert module_file("pdserve.gateway.tenancy") == gateway / "tenancy" / "__init__.py"
    assert all(module_file(f"pdserve.gateway.{name}") for name in GATEWAY_APP)
    assert "pdserve.gateway.app" in dict(loaded_at_import(gateway / "main.py"))


# ---- composition, not mixins (kvtransfer) --------------------------------------------------
CONTRACT_BASES = {"KVEndpoint", "KVSender", "KVReceiver", "ABC", "Protocol", "Generic"}
PLAIN_BASES = {"Enum", "RuntimeError", "ValueError", "Exception"}  # enums and errors


def _base_names(node: ast.ClassDef) -> set[str]:
    names = set()
    for base in node.bases:
        target = base.value if isinstance(base, ast.Subscript) else base  # Generic[T]
        names.add(target.attr if isinstance(target, ast.Attribute) else ast.unparse(target))
    return names


def test_kvtransfer_backends_hold_their_parts_rather_than_inherit_them() -> None:
    """A backend *has* a transfer table and a thread; inheritance is for the contract alone."""
    offenders = [
        f"{path.name}:{node.name}({', '.join(sorted(bases))})"
        for path in sorted(PACKAGES["kvtransfer"].glob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ClassDef)
        and (bases := _base_names(node)) - CONTRACT_BASES - PLAIN_BASES
    ]
    assert offenders == []


def test_the_gateway_groups_its_concerns_into_sub_packages() -> None:
    top = [p for p in PACKAGES["gateway"].iterdir() if p.name != "__pycache__"]
    assert len(top) <= 30, sorted(p.name for p in top)
    assert (PACKAGES["gateway"] / "tenancy" / "__init__.py").is_file()
