"""The device check's results: a check's status from its records, the JSON report, the table.

Pure (no torch): tests/test_device_check.py drives it directly.

A record is a dict a check yields. `ok` (bool) marks a pass/fail record; a record without it
is a measurement (informative). `summary` (str) is shown in the table. A check's status:
  passed  - it ran and no record has ok=False
  failed  - a record has ok=False, or it raised / timed out (`error` says how)
  skipped - it could not run here (`reason` says why: no GPU, a piece not there yet, ...)
"""

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

PASSED, FAILED, SKIPPED = "passed", "failed", "skipped"
SCHEMA = 1  # the JSON report's version


@dataclass
class CheckResult:
    name: str  # the check's name (--only takes these)
    status: str  # passed | failed | skipped
    wall_s: float = 0.0  # seconds it ran (its process's start and imports included)
    budget_s: float = 0.0  # seconds it was given
    gpu_only: bool = False  # skipped by --dry-run
    reason: str = ""  # skipped: why
    error: str = ""  # failed by raising or running out of time: the error's last lines
    records: list[dict] = field(default_factory=list)

    @property
    def summary(self) -> str:
        """One line for the table."""
        if self.status == SKIPPED:
            return self.reason
        parts = []
        graded = [r for r in self.records if "ok" in r]
        if graded:
            parts.append(f"{sum(bool(r['ok']) for r in graded)}/{len(graded)} ok")
        parts += [r["summary"] for r in self.records if r.get("summary")]
        if self.error:
            parts.append(self.error.strip().splitlines()[-1])
        return "; ".join(parts)


def status_of(records: list[dict], error: str = "") -> str:
    """passed, unless the check raised (error) or a record says ok=False."""
    if error or any(r.get("ok") is False for r in records):
        return FAILED
    return PASSED


def report(results: list[CheckResult], mode: str, device: str, wall_s: float, **extra) -> dict:
    """The JSON document --out receives."""
    return {
        "schema": SCHEMA,
        "mode": mode,  # gpu | dry-run
        "device": device,  # torch's name of the GPU, or "cpu"
        "finished": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "wall_s": round(wall_s, 1),
        "ok": not any(r.status == FAILED for r in results),
        **extra,
        "checks": [{**asdict(r), "summary": r.summary} for r in results],
    }


def write_report(doc: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1, default=str) + "\n")


def table(results: list[CheckResult], width: int = 100) -> str:
    """check | status | wall s | budget s | summary, one row a check, and a total line."""
    head = f"{'check':<10} {'status':<8} {'wall s':>7} {'budget':>7}  summary"
    lines = [head, "-" * min(width, max(len(head), 60))]
    for r in results:
        row = f"{r.name:<10} {r.status:<8} {r.wall_s:>7.1f} {r.budget_s:>7.0f}  "
        room = max(20, width - len(row))
        summary = r.summary if len(r.summary) <= room else r.summary[: room - 3] + "..."
        lines.append(row + summary)
    counts = {s: sum(r.status == s for r in results) for s in (PASSED, FAILED, SKIPPED)}
    total = sum(r.wall_s for r in results)
    lines.append(lines[1])
    lines.append(
        f"{'total':<10} {'':<8} {total:>7.1f} {'':>7}  "
        + ", ".join(f"{n} {s}" for s, n in counts.items())
    )
    return "\n".join(lines)
