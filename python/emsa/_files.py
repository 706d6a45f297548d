"""Reading and writing emsa's files: bounded reads, atomic writes.

Every file emsa writes (probe records, plans, reports and their plots, run directories) goes
through write_text() or replacing(): the bytes land in a temporary file in the same folder, are
flushed and fsynced, and the temporary is renamed over the target, so a reader (or a kill in
the middle) sees the old file or the new one, never a torn one. read_text() refuses a file
larger than the C++ reader's limit before holding more of it, so /dev/zero or a huge file is a
clear error rather than a MemoryError.
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from pathlib import Path
from typing import Iterator

__all__ = ["MAX_FILE_BYTES", "read_text", "write_text", "replacing"]

MAX_FILE_BYTES = 128 << 20  # as json::kMaxFileBytes in src/common/json.h


def read_text(path: str | os.PathLike, limit: int = MAX_FILE_BYTES) -> str:
    """The file's UTF-8 text; ValueError when it is longer than `limit` bytes, holds a NUL byte
    or is not UTF-8."""
    with open(path, "rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise ValueError(f"{os.fspath(path)} is larger than {limit >> 20} MiB, the most emsa "
                         "reads of a JSON file")
    if b"\0" in data:  # never in JSON text, and the C ABI would read only up to it
        raise ValueError(f"{os.fspath(path)} holds NUL bytes: it is not JSON text")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{os.fspath(path)} is not UTF-8 text (byte {e.start})") from None


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def replacing(path: str | os.PathLike) -> Iterator[Path]:
    """Yields a temporary path beside `path` to write; on success it is fsynced and renamed over
    `path`, on an exception removed. A target that exists and is not a regular file (a
    terminal, /dev/null, a pipe) is yielded itself: renaming over it would replace the device."""
    target = Path(path)
    try:
        if not stat.S_ISREG(os.stat(target).st_mode):
            yield target
            return
    except FileNotFoundError:
        pass
    fd, tmp_name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        os.chmod(tmp, 0o666 & ~_umask())  # as open() would have made it, not mkstemp's 0600
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def write_text(path: str | os.PathLike, text: str) -> None:
    """Writes `text` as UTF-8 to `path` atomically (see the module's docstring)."""
    with replacing(path) as tmp:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
