"""Files and directories elasticd creates, made safe for a daemon that runs as root on a shared
node: how every one is created, and how a file someone else may have written is read
(`read_regular`).

Every one is created fresh where it is new (O_EXCL: an existing entry, or a symlink someone planted,
is an error, never written through), is never opened through a symlink in its last component
(O_NOFOLLOW), and is never readable by other users: files 0640, directories 0750 (the umask can only
narrow that). Parent directories are safe because the run directory is created fresh under a checked
base (daemon/preflight.py's check_log_dir): nobody else can add or swap entries below it.

`read_regular` reads a regular file only (never through a symlink, never blocking on a FIFO or a
device) of at most a given size: ValueError past it, judged by its size first, and again by what
was read in case it grew.
"""

from __future__ import annotations

import errno
import os
import stat

FILE_MODE = 0o640
DIR_MODE = 0o750
_SAFE = os.O_NOFOLLOW | os.O_CLOEXEC


def create(path: str | os.PathLike, flags: int = os.O_WRONLY) -> int:
    """A new file's descriptor; FileExistsError if anything (a file, a symlink) is already there."""
    return os.open(path, flags | os.O_CREAT | os.O_EXCL | _SAFE, FILE_MODE)


def append(path: str | os.PathLike) -> int:
    """A descriptor appending to a file several writers open in turn (created if missing); a
    symlink in its place is an OSError (ELOOP)."""
    return os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | _SAFE, FILE_MODE)


def open_existing(path: str | os.PathLike, flags: int = os.O_RDONLY) -> int:
    """A descriptor of an existing file, never through a symlink."""
    return os.open(path, flags | _SAFE)


def mkdir(path: str | os.PathLike) -> None:
    """A new directory; FileExistsError if anything is already there (it is never reused)."""
    os.mkdir(path, DIR_MODE)


def read_regular(path: str | os.PathLike, limit: int) -> bytes:
    """The bytes of a regular file of at most `limit` bytes (a larger one: ValueError), never
    through a symlink in its last component and never blocking: a FIFO, a device or a socket in
    its place is an OSError (EINVAL), as a symlink is (ELOOP), so whoever can write the
    directory can neither hang the reader nor feed it /dev/zero."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | _SAFE)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EINVAL, "not a regular file", os.fspath(path))
        if st.st_size > limit:
            raise ValueError(f"larger than {limit} bytes")
        chunks, left = [], limit + 1
        while left > 0 and (chunk := os.read(fd, min(left, 1 << 20))):
            chunks.append(chunk)
            left -= len(chunk)
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if len(data) > limit:  # it grew since
        raise ValueError(f"larger than {limit} bytes")
    return data
