"""Writing files all or nothing, for rpe's Python tools (the counterpart of
include/rpe/io/atomic_file.hpp).

A file is written under a temporary name in the target's folder and renamed over the target
(``os.replace``, atomic within one file system) only once it is complete, flushed and synced; on
any failure (full disk, file-size limit, an exception while writing) the temporary file is
removed and an existing target keeps its old content. Nothing else is needed: ``import
atomic_write`` works from every script in tools/ (their folder is on ``sys.path``).
"""
from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import Iterator


@contextlib.contextmanager
def replacing(target: Path | str) -> Iterator[Path]:
    """Yields a fresh temporary path next to ``target`` (same suffix, so tools that infer the
    format from it, such as matplotlib's savefig, still do); when the block ends without an
    exception, the file written there is synced and renamed over ``target``; otherwise it is
    removed and ``target`` is untouched.

    As the C++ writer: a symbolic link is followed (the file it names is replaced or created, the
    link stays), and an existing target that is not a regular file (a device such as /dev/null,
    a FIFO) is written in place, never replaced by a regular file; a replaced file keeps its
    permission bits."""
    target = Path(os.path.realpath(target))
    if target.exists() and not target.is_file():
        yield target  # a device or FIFO: written in place (there is nothing to keep whole)
        return
    fd, name = tempfile.mkstemp(prefix=f".{target.name}.tmp-", suffix=target.suffix, dir=target.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        with open(tmp, "rb") as f:  # the writer closed it; sync what it wrote
            os.fsync(f.fileno())
        # mkstemp makes 0600: keep the replaced file's permissions, else give those open() would
        os.chmod(tmp, (target.stat().st_mode & 0o7777) if target.is_file() else (0o666 & ~_umask()))
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise


def write_text(target: Path | str, text: str) -> None:
    """Writes ``text`` (UTF-8) to ``target`` all or nothing (see replacing)."""
    with replacing(target) as tmp:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
