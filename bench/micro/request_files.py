"""How many product source files one request crosses, from the HTTP handler to the last token.

Starts ``pdserve serve`` (1 prefill + 1 decode, disaggregated, zmq transfer) on a random
``tiny`` model with every role process under coverage (subprocess measurement through
``COVERAGE_PROCESS_START`` and a ``sitecustomize`` on ``PYTHONPATH``), twice per repeat:

    A (idle):    start, /health ok, 7 s of heartbeats, snapshot, stop
    B (request): start, /health ok, 5 s of heartbeats, one streaming /v1/chat/completions
                 (max_tokens 8, ignore_eos) read to [DONE], 2 s, snapshot, stop

"snapshot": every role process saves its coverage on SIGUSR2 (the sitecustomize installs the
handler) and the files are copied aside, so shutting down is measured in neither run. A file is
on the request path when B executed statements in it that A did not (or B ran it and A never
did). A is the union of the A repeats; the B extras are intersected over the B repeats,
so heartbeat timing does not add files. Product files are the ``.py`` files under the repo's
package folders (engine, protocol, runtime, worker, prefill, decode, kvtransfer, coordinator,
gateway, models, launch, pdserve: whichever exist, plus any other ``package-dir`` folder in
pyproject.toml except bench), found by path, so the old layout (folders mapped by setuptools
``package-dir``) and the new one both work. A second, role-aware count compares each role's
own lines (a file one role ran at start-up and another only for the request counts there).

    .venv/bin/python bench/micro/request_files.py                     # this checkout
    python bench/micro/request_files.py --repo /path/to/checkout --out result.json

The repo's own venv (``REPO/.venv``) runs the server; it needs ``coverage`` installed.
Every process the script starts is stopped (SIGTERM, then SIGKILL) whatever happens.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any  # the result is JSON, read by key

if TYPE_CHECKING:  # coverage is imported where it is used: only this script needs it
    from coverage.python import PythonParser

PACKAGE_DIRS = (
    "engine",
    "protocol",
    "runtime",
    "worker",
    "prefill",
    "decode",
    "kvtransfer",
    "coordinator",
    "gateway",
    "models",
    "launch",
    "pdserve",
)
NOT_PRODUCT = {"bench", "tests"}
ROLES = ("serve", "coordinator", "gateway", "prefill", "decode")
MODEL_NAME = "request-files"

SITECUSTOMIZE = """\
# request_files.py: start coverage in every Python process of the run, note its command line,
# and save its coverage on SIGUSR2 (the script's snapshot, taken before anything stops)
import os

try:
    import coverage

    coverage.process_startup()
    _cov = getattr(coverage.process_startup, "coverage", None)
    _pids = os.environ.get("REQUEST_FILES_PIDS")
    if _cov is not None and _pids:
        import signal

        def _snapshot(_signum, _frame):
            _cov.save()
            with open(os.path.join(_pids, f"{os.getpid()}.saved"), "w") as f:
                f.write(_cov.get_data().data_filename())

        signal.signal(signal.SIGUSR2, _snapshot)
        with open("/proc/self/cmdline", "rb") as _f:
            _argv = [a.decode(errors="replace") for a in _f.read().split(b"\\0") if a]
        with open(os.path.join(_pids, str(os.getpid())), "w") as _f:
            _f.write("\\n".join(_argv))
except Exception:
    pass
"""


def product_dirs(repo: Path) -> list[str]:
    names = set(PACKAGE_DIRS)
    pyproject = repo / "pyproject.toml"
    if pyproject.is_file():  # the old layout's package-dir folders, whatever they are called
        for m in re.finditer(r'^"pdserve\.[\w.]+"\s*=\s*"([\w/]+)"', pyproject.read_text(), re.M):
            names.add(m.group(1).split("/")[0])
    return sorted(n for n in names - NOT_PRODUCT if (repo / n).is_dir())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
            status: int = r.status  # urlopen's response is untyped
            return status == 200
    except OSError:
        return False


def stream_one(host: str, port: int) -> int:
    """One streaming chat completion read to [DONE]; returns the content chunks seen."""
    body = json.dumps(
        {
            "model": MODEL_NAME,
            "messages": [{"role": "user", "content": "Tell me about the sea."}],
            "max_tokens": 8,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
    )
    conn = http.client.HTTPConnection(host, port, timeout=300)
    try:
        conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"request failed: {resp.status} {resp.read()[:500]!r}")
        chunks = 0
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                return chunks
            event = json.loads(data)
            for choice in event.get("choices", []):
                if (choice.get("delta") or {}).get("content"):
                    chunks += 1
        raise RuntimeError("the stream ended without [DONE]")
    finally:
        conn.close()


class Run:
    """One ``pdserve serve`` under coverage; its coverage files land in ``self.cov_dir``."""

    def __init__(self, repo: Path, python: Path, work: Path, name: str, model: Path) -> None:
        self.repo, self.python, self.name, self.model = repo, python, name, model
        self.dir = work / name
        self.cov_dir = self.dir / "cov"
        self.pids_dir = self.dir / "pids"
        self.snap_dir = self.dir / "snapshot"
        site = self.dir / "site"
        for d in (self.cov_dir, self.pids_dir, self.snap_dir, site):
            d.mkdir(parents=True)
        (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
        self.rc = self.dir / "coveragerc"
        include = ",\n    ".join(f"{repo / d}/*" for d in product_dirs(repo))
        self.rc.write_text(
            "[run]\n"
            "parallel = True\n"
            "concurrency = thread\n"
            "sigterm = True\n"
            f"data_file = {self.cov_dir / '.coverage'}\n"
            f"include =\n    {include}\n"
            "disable_warnings = no-data-collected, module-not-measured, module-not-imported\n"
        )
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = self.dir / "serve.log"

    def start(self, ready_timeout: float) -> None:
        env = dict(os.environ)
        env["COVERAGE_PROCESS_START"] = str(self.rc)
        env["REQUEST_FILES_PIDS"] = str(self.pids_dir)
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(self.dir / "site"), env.get("PYTHONPATH", "")) if p
        )
        env.pop("COVERAGE_PROCESS_CONFIG", None)
        cmd = [
            str(self.python),
            "-m",
            "pdserve.launch.cli",
            "serve",
            f"--model={self.model}",
            "--mode=disagg",
            "--prefill=1",
            "--decode=1",
            "--transfer-backend=zmq",
            "--host=127.0.0.1",
            f"--port={self.port}",
            f"--served-model-name={MODEL_NAME}",
            f"--ready-timeout={ready_timeout:.0f}",
        ]
        self.proc = subprocess.Popen(
            cmd,
            cwd=self.dir,
            env=env,
            stdout=self.log.open("wb"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = time.monotonic() + ready_timeout
        url = f"http://127.0.0.1:{self.port}"
        while not healthy(url):
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self.name}: serve exited ({self.proc.returncode}); "
                    f"see {self.log}:\n{self.log.read_text()[-3000:]}"
                )
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name}: not healthy in {ready_timeout:.0f}s")
            time.sleep(0.5)

    def request(self) -> int:
        return stream_one("127.0.0.1", self.port)

    def snapshot(self, timeout_s: float = 120.0) -> None:
        """Every process of the run saves its coverage now (SIGUSR2); the files are copied
        aside, so what runs while stopping is not measured."""
        pids = self._own_alive()
        for pid in pids:
            os.kill(pid, signal.SIGUSR2)
        deadline = time.monotonic() + timeout_s
        waiting = list(pids)
        while waiting and time.monotonic() < deadline:
            time.sleep(0.2)
            waiting = [p for p in waiting if not (self.pids_dir / f"{p}.saved").is_file()]
        if waiting:
            raise RuntimeError(f"{self.name}: pids {waiting} did not save coverage")
        for pid in pids:
            saved = Path((self.pids_dir / f"{pid}.saved").read_text())
            shutil.copy(saved, self.snap_dir / saved.name)

    def stop(self) -> None:
        """SIGTERM serve (it stops its roles in order, which then save coverage), then SIGKILL
        whatever this run started that is still alive."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                print(f"{self.name}: serve did not stop in 120 s; killing it", file=sys.stderr)
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        left = self._own_alive()
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 20
        while left and time.monotonic() < deadline:
            time.sleep(0.2)
            left = self._own_alive()
        for pid in left:
            print(f"{self.name}: pid {pid} outlived SIGTERM; killing it", file=sys.stderr)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def _own_alive(self) -> list[int]:
        """Processes this run started (their sitecustomize noted them) that still run."""
        alive = []
        for f in self.pids_dir.iterdir():
            if not f.name.isdigit():
                continue
            pid = int(f.name)
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            argv = [a.decode(errors="replace") for a in cmdline if a]
            if argv == f.read_text().split("\n"):  # not a recycled pid
                alive.append(pid)
        return alive

    def roles(self) -> dict[int, str]:
        out = {}
        for f in self.pids_dir.iterdir():
            if not f.name.isdigit():
                continue
            argv = f.read_text().split("\n")
            out[int(f.name)] = next((a for a in argv[1:] if a in ROLES), "other")
        return out

    def lines(self) -> dict[str, dict[str, set[int]]]:
        """role -> repo-relative file -> executed statements at the snapshot (a role's restarts
        merged)."""
        from coverage import CoverageData

        roles = self.roles()
        out: dict[str, dict[str, set[int]]] = {}
        for path in sorted(self.snap_dir.glob(".coverage.*")):
            m = re.search(r"\.pid(\d+)\.", path.name)
            role = roles.get(int(m.group(1)), "other") if m else "other"
            data = CoverageData(basename=str(path))
            data.read()
            per_file = out.setdefault(role, {})
            for f in data.measured_files():
                rel = relative(self.repo, f)
                if rel is not None:
                    lines = statements(f, data.lines(f) or ())
                    if lines:
                        per_file.setdefault(rel, set()).update(lines)
        return out


def statements(path: str, lines: Iterable[int]) -> set[int]:
    """The executed lines as statements (a multi-line statement by its first line): the tracer
    also reports lines that are no statement (Python 3.11 gives some past a file's end)."""
    try:
        from coverage.python import PythonParser

        parser = _PARSERS.get(path)
        if parser is None:
            parser = _PARSERS[path] = PythonParser(filename=path)
            parser.parse_source()
        found: set[int] = parser.first_lines(lines) & parser.statements
        return found
    except Exception:  # coverage's parser is not public API: keep the raw lines then
        return set(lines)


_PARSERS: dict[str, PythonParser] = {}


def relative(repo: Path, path: str) -> str | None:
    try:
        rel = Path(path).resolve().relative_to(repo)
    except ValueError:
        return None
    if rel.suffix != ".py" or rel.parts[0] in NOT_PRODUCT or len(rel.parts) < 2:
        return None
    return rel.as_posix()


def merged(by_role: dict[str, dict[str, set[int]]]) -> dict[str, set[int]]:
    out: dict[str, set[int]] = {}
    for files in by_role.values():
        for f, lines in files.items():
            out.setdefault(f, set()).update(lines)
    return out


def extras(base: dict[str, set[int]], run: dict[str, set[int]]) -> dict[str, set[int]]:
    """Files with lines ``run`` executed that ``base`` did not, and those lines."""
    out = {}
    for f, lines in run.items():
        new = lines - base.get(f, set())
        if new:
            out[f] = new
    return out


def intersect(runs: list[dict[str, set[int]]]) -> dict[str, set[int]]:
    files = set.intersection(*(set(r) for r in runs)) if runs else set()
    return {f: set.intersection(*(r[f] for r in runs)) for f in sorted(files)}


def measure(
    repo: Path, python: Path, repeats: int, idle_s: float, ready_timeout: float, keep: bool
) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="request-files-"))
    runs: list[Run] = []
    stopping: list[int] = []

    def on_signal(signum: int, _frame: object) -> None:
        stopping.append(signum)
        raise KeyboardInterrupt

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        model = work / "model"
        subprocess.run(
            [
                str(python),
                "-m",
                "pdserve.launch.cli",
                "make-model",
                "--preset=tiny",
                f"--out={model}",
            ],
            check=True,
            stdout=subprocess.DEVNULL,
            cwd=work,
        )
        a_runs: list[dict[str, dict[str, set[int]]]] = []
        b_runs: list[dict[str, dict[str, set[int]]]] = []
        tokens = []
        for i in range(repeats):
            for kind in ("A", "B"):
                run = Run(repo, python, work, f"{kind}{i + 1}", model)
                runs.append(run)
                t0 = time.monotonic()
                try:
                    run.start(ready_timeout)
                    if kind == "A":
                        time.sleep(idle_s + 2)
                    else:
                        time.sleep(idle_s)
                        tokens.append(run.request())
                        time.sleep(2)
                    run.snapshot()
                finally:
                    run.stop()
                by_role = run.lines()
                missing = [r for r in ROLES if r not in by_role]
                if missing:
                    raise RuntimeError(f"{run.name}: no coverage from {missing}; see {run.log}")
                (a_runs if kind == "A" else b_runs).append(by_role)
                print(
                    f"  run {run.name}: {time.monotonic() - t0:.0f} s, roles "
                    f"{sorted(by_role)}" + (f", {tokens[-1]} chunks" if kind == "B" else ""),
                    file=sys.stderr,
                    flush=True,
                )

        # the brief's count: every role's lines merged per run
        base: dict[str, set[int]] = {}
        for r in a_runs:
            for f, lines in merged(r).items():
                base.setdefault(f, set()).update(lines)
        request = intersect([extras(base, merged(r)) for r in b_runs])

        # role-aware: a role's own lines in B against the same role's in A
        per_role: dict[str, dict[str, set[int]]] = {}
        for role in ROLES:
            role_base: dict[str, set[int]] = {}
            for r in a_runs:
                for f, lines in r.get(role, {}).items():
                    role_base.setdefault(f, set()).update(lines)
            found = intersect([extras(role_base, r.get(role, {})) for r in b_runs])
            if found:
                per_role[role] = found
        role_aware = sorted({f for files in per_role.values() for f in files})
        ran_b = set.intersection(*(set(merged(r)) for r in b_runs))
        return {
            "repo": str(repo),
            "commit": git_head(repo),
            "package_dirs": product_dirs(repo),
            "repeats": repeats,
            "idle_s": idle_s,
            "content_chunks": tokens,
            "count": len(request),
            "files": {f: len(lines) for f, lines in request.items()},
            "new_files": sorted(f for f in request if f not in base),
            "per_role": {
                role: {f: len(lines) for f, lines in files.items()}
                for role, files in per_role.items()
            },
            "role_aware_count": len(role_aware),
            "role_aware_only": sorted(set(role_aware) - set(request)),
            "product_files_run_in_B": len(ran_b),
            "product_files_in_repo": sum(
                1 for d in product_dirs(repo) for _ in (repo / d).rglob("*.py")
            ),
        }
    finally:
        for run in runs:
            with contextlib.suppress(Exception):
                run.stop()
        for s, h in old.items():
            signal.signal(s, h)
        if keep:
            print(f"kept {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)
        if stopping:
            sys.exit(128 + stopping[0])


def git_head(repo: Path) -> str | None:
    try:
        out = subprocess.run(
            ["git", "-C", str(repo), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        )
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--repo",
        type=Path,
        default=Path(__file__).resolve().parents[2],
        help="the checkout to measure (default: the one holding this script)",
    )
    p.add_argument(
        "--python", type=Path, default=None, help="its Python (default: REPO/.venv/bin/python)"
    )
    p.add_argument("--out", type=Path, default=None, help="write the result here as JSON")
    p.add_argument("--repeats", type=int, default=2, help="A and B runs each (default 2)")
    p.add_argument(
        "--idle",
        type=float,
        default=5.0,
        help="seconds of heartbeats after /health before the request (default 5)",
    )
    p.add_argument("--ready-timeout", type=float, default=300.0)
    p.add_argument("--keep", action="store_true", help="keep the work directory (logs, data)")
    args = p.parse_args()
    repo = args.repo.resolve()
    python = args.python or repo / ".venv" / "bin" / "python"
    check = subprocess.run(
        [str(python), "-c", "import coverage, pdserve.launch.cli as c; print(c.__file__)"],
        capture_output=True,
        text=True,
    )
    if check.returncode != 0:
        print(f"{python} cannot import coverage and pdserve:\n{check.stderr}", file=sys.stderr)
        return 2
    cli = Path(check.stdout.strip()).resolve()
    if repo not in cli.parents:
        print(f"{python} imports pdserve from {cli}, not from {repo}", file=sys.stderr)
        return 2
    result = measure(repo, python, args.repeats, args.idle, args.ready_timeout, args.keep)
    print(
        f"{result['count']} product files on the request path "
        f"({result['repo']} @ {result['commit']}; B extras over A, intersected over "
        f"{result['repeats']} B runs; number = lines only the request ran)"
    )
    for f, n in result["files"].items():
        roles = [r for r, files in result["per_role"].items() if f in files]
        new = "  (not run at all in A)" if f in result["new_files"] else ""
        print(f"  {f:48s} {n:4d}  {','.join(roles)}{new}")
    print(
        f"role-aware count: {result['role_aware_count']} (adds "
        f"{', '.join(result['role_aware_only']) or 'nothing'})"
    )
    for role, files in result["per_role"].items():
        print(f"  {role}: {len(files)} files")
    print(
        f"product files run at all in B: {result['product_files_run_in_B']} of "
        f"{result['product_files_in_repo']} in the repo"
    )
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
