"""A progress bar for the demo: one redrawn line on a terminal, plain periodic lines otherwise
(a log file or CI output should not fill with carriage returns)."""

from __future__ import annotations

import sys
import time
from typing import TextIO

__all__ = ["Progress"]


class Progress:
    """Progress(total).update(done, **fields) after each unit of work; .close() at the end.

    On a TTY the line is redrawn at most every `interval` seconds (and always for the last
    unit); otherwise a line is written about `lines` times over the run. quiet=True writes
    nothing.
    """

    def __init__(self, total: int, *, label: str = "", stream: TextIO | None = None,
                 quiet: bool = False, width: int = 30, interval: float = 0.1, lines: int = 10):
        self.total = max(int(total), 1)
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.quiet = quiet
        self.width = width
        self.interval = interval
        self.every = max(self.total // max(lines, 1), 1)
        isatty = getattr(self.stream, "isatty", None)
        self.tty = bool(isatty and isatty())
        self.start = time.perf_counter()
        self._last_draw = -float("inf")
        self._drawn = False

    def line(self, done: int, fields: dict[str, object]) -> str:
        frac = min(max(done / self.total, 0.0), 1.0)
        filled = int(round(frac * self.width))
        bar = "#" * filled + "-" * (self.width - filled)
        elapsed = time.perf_counter() - self.start
        eta = elapsed / done * (self.total - done) if done else 0.0
        extra = "  ".join(f"{k} {_fmt(v)}" for k, v in fields.items())
        head = f"{self.label} " if self.label else ""
        return (f"{head}[{bar}] {done}/{self.total}  {elapsed:5.1f}s elapsed, "
                f"{eta:5.1f}s left  {extra}").rstrip()

    def update(self, done: int, **fields: object) -> None:
        if self.quiet:
            return
        last = done >= self.total
        if self.tty:
            now = time.perf_counter()
            if not last and now - self._last_draw < self.interval:
                return
            self._last_draw = now
            self.stream.write("\r\x1b[K" + self.line(done, fields))
            self._drawn = True
        elif last or done % self.every == 0:
            self.stream.write(self.line(done, fields) + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.tty and self._drawn and not self.quiet:
            self.stream.write("\n")
            self.stream.flush()
        self._drawn = False


def _fmt(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.4f}"
    return str(value)
