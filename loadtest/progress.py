"""A one-line progress bar on stderr: done/total, errors, request and token rates, elapsed."""

import sys
import time
from typing import TextIO

from loadtest.metrics import RequestResult

WIDTH = 30  # characters of the bar
REFRESH_S = 0.1  # redraw at most this often


class Progress:
    """Counts finished requests of one run and redraws a bar; silent when `out` is None."""

    def __init__(self, total: int, label: str, out: TextIO | None = sys.stderr):
        self.total, self.label, self.out = total, label, out
        self.num_done = self.num_failed = self.num_tokens = 0
        self._start = time.perf_counter()
        self._drawn_at = 0.0

    def update(self, result: RequestResult) -> None:
        self.num_done += 1
        self.num_failed += not result.ok
        self.num_tokens += result.output_len
        now = time.perf_counter()
        if now - self._drawn_at >= REFRESH_S or self.num_done == self.total:
            self._drawn_at = now
            self._draw(now - self._start)

    def line(self, elapsed_s: float) -> str:
        filled = WIDTH * self.num_done // max(self.total, 1)
        rate = 1 / elapsed_s if elapsed_s > 0 else 0.0
        return (
            f"{self.label} [{'#' * filled}{'.' * (WIDTH - filled)}] "
            f"{self.num_done}/{self.total} err {self.num_failed} "
            f"{self.num_done * rate:.1f} req/s {self.num_tokens * rate:.0f} tok/s "
            f"{elapsed_s:.1f}s"
        )

    def _draw(self, elapsed_s: float) -> None:
        if self.out is not None:
            self.out.write("\r" + self.line(elapsed_s))
            self.out.flush()

    def close(self) -> None:
        if self.out is not None:
            self._draw(time.perf_counter() - self._start)
            self.out.write("\n")
            self.out.flush()
