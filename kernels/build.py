"""Build C sources shipped with Tison into a shared library on first use: compiled with the
system C compiler into a cache folder, keyed by a hash of the sources and flags, so an edit
rebuilds and concurrent builders never see a partial file."""

import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

log = logging.getLogger(__name__)


def build_library(
    name: str, sources: list[Path], flags: list[str], headers: list[Path] = ()
) -> Path:
    """Path of the built library; raises OSError or SubprocessError when it cannot be built."""
    digest = hashlib.sha256(" ".join(flags).encode())  # a tier's flags, never -march=native:
    digest.update(platform.machine().encode())  # one build is right for every CPU of its tier
    for path in [*headers, *sources]:
        digest.update(path.read_bytes())
    target = _cache_dir() / f"{name}_{digest.hexdigest()[:16]}.so"
    if not target.exists():
        start = time.perf_counter()
        _compile(target, sources, flags)
        took = time.perf_counter() - start  # read by tison up's start-up accounting
        log.info("built %s in %.2f s (cached in %s)", name, took, target.parent)
    return target


def _cache_dir() -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tison"
    try:
        base.mkdir(parents=True, exist_ok=True)
        return base
    except OSError:
        return Path(tempfile.gettempdir())


def compiler() -> str | None:
    """The system C compiler's path (cc, else gcc), or None."""
    return shutil.which("cc") or shutil.which("gcc")


def _compile(target: Path, sources: list[Path], flags: list[str]) -> None:
    compiler_path = compiler()
    if compiler_path is None:
        raise OSError("no C compiler (cc or gcc) on PATH")
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run(
            [compiler_path, *flags, "-o", tmp, *map(str, sources)],
            check=True,
            capture_output=True,
            timeout=180,
        )
        os.replace(tmp, target)  # atomic: a concurrent builder sees all or nothing
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
