"""Progress on stderr: the demo's bar (one redrawn line on a terminal, plain periodic lines
otherwise: a log file or CI output should not fill with carriage returns), and the set-up's
timed phases with the line that shows them once a set-up lasts more than two seconds."""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import time
from typing import Iterator, TextIO

__all__ = ["Progress", "Setup", "Phase", "setup", "timed", "verbose", "SETUP_LINE_AFTER"]


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


# ---- set-up: timed phases and the line that shows them ----------------------------------------
# An optimizer's constructor and emsa.probe() time their phases into a dict (opt._setup_times,
# record.setup_times: seconds per phase, in the order first seen) through timed(). Once a
# set-up has lasted SETUP_LINE_AFTER seconds, one line on stderr, redrawn in place, says which
# phase runs, how far along it is (when the phase says) and what finished; a set-up shorter
# than that writes nothing. Not on a terminal the line is written only at verbose level (the
# "emsa" logger enabled for INFO), as plain lines at each phase change; at verbose level every
# set-up's breakdown is also logged when it ends.
SETUP_LINE_AFTER = 2.0  # seconds: shorter set-ups stay silent
_REDRAW = 0.25  # seconds between redraws of the line
_log = logging.getLogger("emsa")


def verbose() -> bool:
    """emsa's verbose level: the "emsa" logger enabled for INFO (logging.getLogger("emsa")
    .setLevel(logging.INFO) with a handler, or logging.basicConfig(level=logging.INFO))."""
    return _log.isEnabledFor(logging.INFO)


def _other_rank() -> bool:
    """True in a torch.distributed job's ranks other than 0."""
    dist = sys.modules.get("torch.distributed")
    try:
        return bool(dist and dist.is_available() and dist.is_initialized()
                    and dist.get_rank() != 0)
    except (RuntimeError, ValueError):
        return False


class Phase:
    """What timed() yields: .progress(done, total) puts "done/total" on the line."""

    def __init__(self, name: str):
        self.name = name
        self.start = time.perf_counter()
        self.done: float | None = None
        self.total: float | None = None

    def progress(self, done: float, total: float) -> None:
        self.done, self.total = done, total


class Setup:
    """One set-up's phases and its progress line (see above). setup() makes one; tests make
    their own with a stream, a threshold and tty= and call tick() instead of waiting."""

    def __init__(self, label: str, *, stream: TextIO | None = None,
                 threshold: float = SETUP_LINE_AFTER, tty: bool | None = None,
                 background: bool = True):
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.threshold = threshold
        isatty = getattr(self.stream, "isatty", None)
        self.tty = bool(isatty and isatty()) if tty is None else tty
        self.start = time.perf_counter()
        self.phases: list[Phase] = []  # the running ones, outermost first
        self.finished: dict[str, float] = {}  # seconds of each phase that ended
        self._lock = threading.Lock()
        self._drawn = False
        self._written = ""  # the phase last written as a plain line
        self._stop = threading.Event()
        self._thread = None
        if _other_rank():  # one line per job, not one per rank
            self.tty, self.threshold = False, float("inf")
        if background and (self.tty or verbose()):
            self._thread = threading.Thread(target=self._run, name="emsa-setup-progress",
                                            daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(_REDRAW):
            self.tick()

    def line(self) -> str:
        now = time.perf_counter()
        with self._lock:
            running = list(self.phases)
            finished = list(self.finished.items())
        text = f"emsa: {self.label} {now - self.start:.1f} s"
        if running:
            p = running[-1]
            far = ""
            if p.total:
                far = f" {100.0 * min(max(p.done or 0.0, 0.0) / p.total, 1.0):.0f}%"
            text += f", {p.name}{far} ({now - p.start:.1f} s)"
        if finished:
            text += "; done: " + ", ".join(f"{k} {v:.1f} s" for k, v in finished)
        return text

    def tick(self) -> None:
        """Draws the line when the set-up has lasted the threshold (called every _REDRAW s)."""
        if time.perf_counter() - self.start < self.threshold:
            return
        if self.tty:
            self.stream.write("\r\x1b[K" + self.line())
            self._drawn = True
        elif verbose():
            with self._lock:
                current = self.phases[-1].name if self.phases else ""
            if current == self._written:
                return
            self._written = current
            self.stream.write(self.line() + "\n")
        else:
            return
        self.stream.flush()

    def enter(self, name: str) -> Phase:
        phase = Phase(name)
        with self._lock:
            self.phases.append(phase)
        return phase

    def leave(self, phase: Phase, times: dict[str, float]) -> None:
        """Ends `phase`, adding its seconds to times[phase.name] and to the line's list."""
        seconds = time.perf_counter() - phase.start
        with self._lock:
            self.phases.remove(phase)
            times[phase.name] = times.get(phase.name, 0.0) + seconds
            self.finished[phase.name] = self.finished.get(phase.name, 0.0) + seconds

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        elapsed = time.perf_counter() - self.start
        summary = f"emsa: {self.label} took {elapsed:.2f} s" + "".join(
            f"{', ' if i else ': '}{k} {v:.2f} s"
            for i, (k, v) in enumerate(self.finished.items()))
        if self._drawn:
            self.stream.write("\r\x1b[K" + summary + "\n")
            self.stream.flush()
        elif self._written:
            self.stream.write(summary + "\n")
            self.stream.flush()
        _log.info("%s", summary)


_active: list[Setup] = []


@contextlib.contextmanager
def setup(label: str) -> Iterator[Setup]:
    """One set-up: its timed() phases go onto one progress line. Nested inside
    another set-up (a probe inside a constructor), the outer one's line shows its phases."""
    if _active:
        yield _active[-1]
        return
    scope = Setup(label)
    _active.append(scope)
    try:
        yield scope
    finally:
        _active.remove(scope)
        scope.close()


@contextlib.contextmanager
def timed(phase: str, times: dict[str, float]) -> Iterator[Phase]:
    """Adds the seconds the block takes to times[phase] (a phase seen first is appended, so the
    dict keeps the order phases began in) and names the phase on the progress line; yields a
    Phase whose .progress(done, total) says how far along it is. Outside any setup() it opens
    one of its own, labelled by the phase."""
    with contextlib.ExitStack() as stack:
        scope = _active[-1] if _active else stack.enter_context(setup(phase))
        current = scope.enter(phase)
        try:
            yield current
        finally:
            scope.leave(current, times)
