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
import errno
import os
import sys
import tempfile
from pathlib import Path
from typing import Iterator


_MAX_LINKS = 40  # the kernel's limit (ELOOP)


def _descriptor_of(path: str) -> int | None:
    """The open descriptor an absolute, normalised path names (/dev/stdout, /dev/fd/N,
    /proc/self/fd/N, /proc/<this pid>/fd/N), else None."""
    named = {"/dev/stdin": 0, "/dev/stdout": 1, "/dev/stderr": 2}
    if path in named:
        return named[path]
    for prefix in ("/dev/fd/", "/proc/self/fd/", "/proc/thread-self/fd/", f"/proc/{os.getpid()}/fd/"):
        rest = path[len(prefix):]
        if path.startswith(prefix) and rest.isdigit() and len(rest) <= 9:
            return int(rest)
    return None


def _resolve(target: Path | str) -> tuple[Path, int | None]:
    """Follows ``target``'s symbolic links one at a time (relative links against their folder),
    stopping at a path that names an open descriptor: (final path, descriptor or None).
    Raises OSError(ELOOP) for a cycle (more than 40 links)."""
    p = os.path.normpath(os.path.abspath(target))
    for _ in range(_MAX_LINKS + 1):
        fd = _descriptor_of(p)
        if fd is not None:
            return Path(p), fd
        if not os.path.islink(p):
            return Path(p), None
        p = os.path.normpath(os.path.join(os.path.dirname(p), os.readlink(p)))
    raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), str(target))


@contextlib.contextmanager
def replacing(target: Path | str) -> Iterator[Path]:
    """Yields a fresh temporary path next to ``target`` (same suffix, so tools that infer the
    format from it, such as matplotlib's savefig, still do); when the block ends without an
    exception, the file written there is synced and renamed over ``target``; otherwise it is
    removed and ``target`` is untouched.

    As the C++ writer: a symbolic link is followed link by link (the file it names is replaced or
    created, the link stays; a cycle raises OSError ELOOP); a path naming an open descriptor
    (/dev/stdout, /dev/fd/N, /proc/self/fd/N) is written through that descriptor, at its offset;
    an existing target that is not a regular file (a device such as /dev/null, a FIFO) is written
    in place; a replaced file keeps its permission bits; the temporary name is shortened for
    names near the 255-byte limit."""
    path, fd = _resolve(target)
    if fd is not None:  # write through the descriptor: a temporary file, then copied to it
        sys.stdout.flush()
        sys.stderr.flush()
        fd_tmp, name = tempfile.mkstemp(suffix=path.suffix)
        os.close(fd_tmp)
        tmp = Path(name)
        try:
            yield tmp
            with open(tmp, "rb") as src:
                data = src.read()
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        finally:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
        return
    if path.exists() and not path.is_file():
        yield path  # a device or FIFO: written in place (there is nothing to keep whole)
        return
    prefix = f".{path.name}.tmp-"
    room = 255 - len(path.suffix) - 8  # mkstemp adds 8 random characters
    if len(prefix.encode()) > room:
        prefix = prefix.encode()[:room].decode(errors="ignore")
    fd_tmp, name = tempfile.mkstemp(prefix=prefix, suffix=path.suffix, dir=path.parent)
    os.close(fd_tmp)
    tmp = Path(name)
    try:
        yield tmp
        with open(tmp, "rb") as f:  # the writer closed it; sync what it wrote
            os.fsync(f.fileno())
        # mkstemp makes 0600: keep the replaced file's permissions, else give those open() would
        os.chmod(tmp, (path.stat().st_mode & 0o7777) if path.is_file() else (0o666 & ~_umask()))
        os.replace(tmp, path)
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
