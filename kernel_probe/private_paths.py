"""Files only this user can read: directories 0700, files 0600, whatever the umask.

A rank's dump holds its tracebacks, its environment's table and its stacks; the runtime
directory holds the connection files (each with a job's signing key). Both are made here,
so whichever of them is made first (a dump written before any job wrote a connection
file, or the other way round) the directories are private.

``mkdir``'s and ``open``'s modes are filtered by the umask, which can only take bits away:
the modes asked here are at most 0700 / 0600, and a ``chmod`` afterwards gives the owner
back what an unusual umask (0o277) took.
"""

from __future__ import annotations

import os
from pathlib import Path

DIR_MODE = 0o700
FILE_MODE = 0o600


def private_dir(path: str | os.PathLike, *, tighten: bool = False) -> Path:
    """``path`` as a directory, every component it lacks made 0700. ``tighten``: an existing
    ``path`` this user owns is made 0700 too (the runtime directory, whoever made it); an
    existing directory is otherwise left as it is (a shared ``PROBING_DUMP_DIR``)."""
    path = Path(path)
    missing: list[Path] = []
    p = path
    while not os.path.lexists(p) and p.parent != p:
        missing.append(p)
        p = p.parent
    for d in reversed(missing):
        try:
            os.mkdir(d, DIR_MODE)
        except FileExistsError:  # another rank made it meanwhile (with the same mode)
            continue
        os.chmod(d, DIR_MODE)
    if not path.is_dir():
        raise NotADirectoryError(f"{path} is not a directory")
    if tighten and not missing:
        st = path.stat()
        if st.st_uid == os.getuid() and st.st_mode & 0o777 != DIR_MODE:
            os.chmod(path, DIR_MODE)
    return path


def open_private(path: str | os.PathLike, *, exclusive: bool = True) -> int:
    """A new file at ``path``, 0600, for writing; never through a symlink. A file descriptor."""
    flags = os.O_WRONLY | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    flags |= os.O_EXCL if exclusive else os.O_TRUNC
    fd = os.open(path, flags, FILE_MODE)
    try:
        os.fchmod(fd, FILE_MODE)
    except BaseException:
        os.close(fd)
        raise
    return fd


def write_private(path: str | os.PathLike, data: bytes | str) -> None:
    """Write ``data`` to a new 0600 file at ``path`` (which must not exist)."""
    if isinstance(data, str):
        data = data.encode()
    with os.fdopen(open_private(path), "wb") as fh:
        fh.write(data)
