"""The training corpus: the Python standard library's own `.py` files, split into
train / held-out by a stable hash of each file's path relative to the stdlib root."""

import hashlib
import sysconfig
from pathlib import Path

# encodings/ is mostly generated codec tables, pydoc_data one huge string: neither teaches code
SKIP_DIRS = frozenset({"site-packages", "test", "tests", "idlelib", "encodings", "pydoc_data"})
MAX_FILE_BYTES = 200_000  # skips huge generated files (pydoc_data/topics.py, ...)
HELD_OUT_PERCENT = 2


def stdlib_root() -> Path:
    """The directory of the running interpreter's standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def is_held_out(rel_path: str) -> bool:
    """True for the ~2% of files kept out of training; stable across machines and runs."""
    digest = hashlib.sha256(rel_path.encode("utf-8")).digest()
    return int.from_bytes(digest[:4], "big") % 100 < HELD_OUT_PERCENT


def source_files(root: Path | None = None) -> list[tuple[str, str]]:
    """(relative path, text) of every usable stdlib `.py` file, sorted by path."""
    root = root or stdlib_root()
    files = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if SKIP_DIRS.intersection(rel.parts[:-1]) or path.stat().st_size > MAX_FILE_BYTES:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        files.append((rel.as_posix(), text))
    return files


def split(files: list[tuple[str, str]]) -> tuple[list[str], list[str]]:
    """Texts of the training files and of the held-out files."""
    train = [text for rel, text in files if not is_held_out(rel)]
    held_out = [text for rel, text in files if is_held_out(rel)]
    return train, held_out
