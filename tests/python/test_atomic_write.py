#!/usr/bin/python3
"""tools/atomic_write.py: a failed write leaves no partial file and an old target unchanged
(CTest python.atomic_write, label unit). Exit status 0 when every check passes."""
import errno
import os
import resource
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import atomic_write  # noqa: E402

failures = []


def check(cond: bool, what: str) -> None:
    if not cond:
        failures.append(what)
        print("FAIL:", what)


with tempfile.TemporaryDirectory() as d:
    folder = Path(d)
    target = folder / "out.json"

    # success: written whole, with the permissions open() would give
    atomic_write.write_text(target, "first")
    check(target.read_text() == "first", "write_text writes the text")
    check(sorted(p.name for p in folder.iterdir()) == ["out.json"], "no temporary file after success")

    # an exception inside the block: the old file stays, the temporary file goes
    try:
        with atomic_write.replacing(target) as tmp:
            tmp.write_text("half")
            raise RuntimeError("stop")
    except RuntimeError as e:
        check(str(e) == "stop", "the exception passes through")
    check(target.read_text() == "first", "an exception leaves the old file")
    check(sorted(p.name for p in folder.iterdir()) == ["out.json"], "an exception leaves no temporary file")

    # a file-size limit (SIGXFSZ ignored, so write fails with EFBIG), in a child process
    def limit() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))

    code = ("import sys; sys.path.insert(0, sys.argv[1]); import atomic_write\n"
            "try:\n    atomic_write.write_text(sys.argv[2], 'x' * 100000)\n"
            "except OSError as e:\n    print(e.errno); sys.exit(3)\n")
    proc = subprocess.run([sys.executable, "-c", code, str(Path(atomic_write.__file__).parent), str(target)],
                          preexec_fn=limit, capture_output=True, text=True)
    check(proc.returncode == 3 and proc.stdout.strip() == str(__import__("errno").EFBIG),
          f"the write fails with EFBIG under the limit (status {proc.returncode}, {proc.stdout!r} {proc.stderr[-300:]!r})")
    check(target.read_text() == "first", "a file-size limit leaves the old file")
    check(sorted(p.name for p in folder.iterdir()) == ["out.json"], "a file-size limit leaves no temporary file")

    # a missing folder: an error, and nothing created
    try:
        atomic_write.write_text(folder / "missing" / "x.json", "x")
        check(False, "a missing folder raises")
    except FileNotFoundError:
        pass
    check(sorted(p.name for p in folder.iterdir()) == ["out.json"], "a missing folder creates nothing")

    # the suffix is kept for tools that infer the format (savefig)
    with atomic_write.replacing(folder / "plot.png") as tmp:
        check(tmp.suffix == ".png" and tmp.parent == folder, "the temporary file is next to the target, same suffix")
        tmp.write_bytes(b"png")
    check((folder / "plot.png").read_bytes() == b"png", "replacing renames the temporary file over the target")
    mask = os.umask(0)
    os.umask(mask)
    check(oct((folder / "plot.png").stat().st_mode & 0o777) == oct(0o666 & ~mask),
          "the file gets the permissions open() would give")

    # a replaced file keeps its permission bits
    (folder / "plot.png").chmod(0o640)
    atomic_write.write_text(folder / "plot.png", "again")
    check(oct((folder / "plot.png").stat().st_mode & 0o777) == oct(0o640), "a replaced file keeps its permissions")

    # a symbolic link: the file it names is replaced, the link stays; a dangling link's file is created
    real = folder / "real.txt"
    real.write_text("old")
    (folder / "link.txt").symlink_to("real.txt")
    atomic_write.write_text(folder / "link.txt", "new")
    check((folder / "link.txt").is_symlink() and real.read_text() == "new", "a symlink is followed, the link stays")
    (folder / "dangling.txt").symlink_to("made.txt")
    atomic_write.write_text(folder / "dangling.txt", "made")
    check((folder / "dangling.txt").is_symlink() and (folder / "made.txt").read_text() == "made",
          "a dangling symlink's file is created, the link stays")
    # a cycle of links is refused (OSError ELOOP); the links stay links
    (folder / "a").symlink_to("b")
    (folder / "b").symlink_to("a")
    try:
        atomic_write.write_text(folder / "a", "x")
        check(False, "a cycle of links is refused")
    except OSError as e:
        check(e.errno == errno.ELOOP, f"a cycle of links raises ELOOP, not {e!r}")
    check((folder / "a").is_symlink() and (folder / "b").is_symlink(), "a cycle of links stays links")
    # a 250-byte name: the temporary name is shortened to fit
    long_name = folder / ("n" * 246 + ".txt")
    atomic_write.write_text(long_name, "long")
    check(long_name.read_text() == "long", "a 250-byte name is written")
    # /dev/stdout redirected to a file (appending): written through the descriptor, after what it holds
    out = folder / "redirected.txt"
    out.write_text("PRE\n")
    inode = out.stat().st_ino
    script = ("import sys; sys.path.insert(0, sys.argv[1]); import atomic_write; print('before', flush=True); "
              "atomic_write.write_text('/dev/stdout', 'NEW\\n'); print('after')")
    with open(out, "a") as f:
        subprocess.run([sys.executable, "-c", script, str(Path(atomic_write.__file__).parent)], stdout=f, check=True)
    check(out.read_text() == "PRE\nbefore\nNEW\nafter\n", f"/dev/stdout > file appends in order, got {out.read_text()!r}")
    check(out.stat().st_ino == inode, "/dev/stdout > file: the same file, not a replacement")
    # ... and through a pipe
    r = subprocess.run([sys.executable, "-c", script, str(Path(atomic_write.__file__).parent)], capture_output=True, text=True)
    check(r.returncode == 0 and r.stdout == "before\nNEW\nafter\n", f"/dev/stdout | pipe, got {r.stdout!r} {r.stderr!r}")
    # a device is written in place, never replaced by a regular file
    atomic_write.write_text("/dev/null", "discarded")
    check(Path("/dev/null").is_char_device(), "/dev/null stays a device")

print("atomic_write: all checks passed" if not failures else f"atomic_write: {len(failures)} check(s) failed")
sys.exit(1 if failures else 0)
