"""Building the engine's C kernels at run time (engine/attention/cpu_decode.c,
engine/quant/cpu_qlinear.c) and loading them with ctypes.

A kernel is built with the system C compiler into ``$PDSERVE_HOME/kernels/<name>-<sha>.so``,
the sha over the source, the flags, the compiler and this CPU (``-march=native``); written
under a temporary name and renamed, so processes starting together each build or find a whole
file. Each kernel's module loads the library with ctypes and, when there is no compiler,
the build fails or the cache directory cannot be written, logs why once and runs through torch.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

from pdserve.envs import pdserve_home

FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=gnu11")
COMPILERS = ("cc", "gcc")


def find_compiler() -> str | None:
    return next(filter(None, map(shutil.which, COMPILERS)), None)


def open_library(
    source: Path,
    compiler: str | None,
    cache_dir: Path,
    log: logging.Logger,
    what: str,
    flags: tuple[str, ...] = FLAGS,
) -> ctypes.CDLL | None:
    """``source`` built (or found cached) and loaded; None, said on ``log``, when there is no
    compiler or the build or load fails, so that ``what`` runs through torch instead."""
    if compiler is None:
        log.info("no C compiler (%s): %s through torch", "/".join(COMPILERS), what)
        return None
    try:
        return ctypes.CDLL(str(build(source, compiler, cache_dir, flags)))
    except (OSError, subprocess.SubprocessError) as exc:
        log.info("%s kernel unavailable, through torch instead: %s", what, exc)
        return None


def build(
    source: Path, compiler: str, cache_dir: Path | None = None, flags: tuple[str, ...] = FLAGS
) -> Path:
    """The shared library of ``source``, compiled unless a matching one is cached."""
    cache_dir = cache_dir or pdserve_home() / "kernels"
    key = hashlib.sha256(source.read_bytes())
    for part in (*flags, compiler, _compiler_version(compiler), _cpu_id()):
        key.update(part.encode() + b"\0")
    target = cache_dir / f"{source.stem}-{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{source.stem}-", suffix=".so", dir=cache_dir)
    os.close(fd)
    try:
        cmd = [compiler, *flags, "-o", tmp, str(source)]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise OSError(f"{' '.join(cmd)} failed: {done.stderr.strip()[-2000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _compiler_version(compiler: str) -> str:
    done = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30)
    return done.stdout.split("\n", 1)[0]


def _cpu_id() -> str:
    """What ``-march=native`` depends on: the CPU's model and feature flags."""
    try:
        info = Path("/proc/cpuinfo").read_text().split("\n\n", 1)[0]
    except OSError:
        return platform.machine() + platform.processor()
    keep = ("model name", "flags", "cpu family", "model\t")
    return "\n".join(line for line in info.splitlines() if line.startswith(keep))
