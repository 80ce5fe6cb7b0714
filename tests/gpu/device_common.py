"""What the device check's checks share: their context, how one says "skipped", the paths,
and pytest run as a subprocess with its counts read from a JUnit file."""

import importlib.util
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
TESTS = REPO_ROOT / "tests"
GPU_TESTS = TESTS / "gpu"
for _path in (REPO_ROOT, TESTS, GPU_TESTS):  # tiny_models, engine_helpers, check_codec_gpu
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))


class Skip(Exception):
    """Raised by a check that cannot run here: it is recorded `skipped: <message>`."""


@dataclass
class Context:
    mode: str  # gpu | dry-run
    device: str  # cuda | cpu: where the engine runs
    deadline: float  # time.monotonic() by which the check must have ended
    workdir: Path  # a temporary folder of the check's own
    options: dict = field(default_factory=dict)  # device_check.py's tuning flags

    @property
    def gpu(self) -> bool:
        return self.mode == "gpu"

    def left(self) -> float:
        """Seconds left of the check's budget."""
        return self.deadline - time.monotonic()


def need_modules(*names: str) -> None:
    """Skip unless every module is importable (a package the device machine lacks is carried
    as a wheel in .whl/, which device_check.sh installs)."""
    missing = [n for n in names if importlib.util.find_spec(n) is None]
    if missing:
        raise Skip(f"module(s) {', '.join(missing)} not installed (carry their wheels in .whl/)")


def child_env(**extra: str) -> dict:
    """The environment of a process a check starts: the repo (and tests/) importable first."""
    paths = [str(REPO_ROOT), str(TESTS), os.environ.get("PYTHONPATH", "")]
    return dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in paths if p), **extra)


def run_pytest(args: list[str], ctx: Context, name: str, margin_s: float = 10.0) -> dict:
    """`python -m pytest -q *args` in the repo root, stopped `margin_s` before the check's
    deadline; one record of its counts (from a JUnit file) and its failing tests' names."""
    junit = ctx.workdir / f"{name}.xml"
    cmd = [sys.executable, "-m", "pytest", "-q", f"--junitxml={junit}"]
    if importlib.util.find_spec("openai") is None:  # tests/conftest.py imports it
        cmd.append("--noconftest")
    started = time.monotonic()
    try:
        proc = subprocess.run(
            [*cmd, *args],
            cwd=REPO_ROOT,
            env=child_env(),
            capture_output=True,
            text=True,
            timeout=max(1.0, ctx.left() - margin_s),
        )
        rc, tail = proc.returncode, (proc.stdout + proc.stderr)[-1500:]
    except subprocess.TimeoutExpired as e:
        rc, tail = -1, f"timed out after {e.timeout:.0f} s"
    counts = junit_counts(junit) if junit.exists() else {}
    record = {
        "pytest": " ".join(args),
        "rc": rc,
        "wall_s": round(time.monotonic() - started, 1),
        **counts,
    }
    if rc not in (0, 5) or counts.get("failed", 0) or counts.get("errors", 0):
        record["output_tail"] = tail
    return record


def junit_counts(path: Path) -> dict:
    """passed/failed/errors/skipped counts and the names of failing tests of a JUnit file."""
    root = ET.parse(path).getroot()
    cases = root.iter("testcase")
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    failing = []
    for case in cases:
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed", "error": "errors"}.get(child.tag, child.tag)
        counts[outcome] += 1
        if outcome in ("failed", "errors"):
            failing.append(f"{case.get('classname', '')}::{case.get('name', '')}")
    return {**counts, "failing": failing[:10]}
