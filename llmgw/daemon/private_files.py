"""Files only the daemon's own user may read: the router's store (with its WAL and shared-memory
files and its lock), the agent's engine records (they hold each engine's `env`, secrets included)
and the engines' logs (prompts and tokens can show up in them).

Directories are 0700 and files 0600, *created* so — never created open and tightened afterwards,
which would leave a window — and existing ones found looser (from an older llmgw, a restored
backup, a hand-made directory) are tightened with a warning naming them. The one exception is a
directory llmgw cannot call its own: see `private_dir(dedicated=False)`."""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

__all__ = ["PRIVATE_DIR", "PRIVATE_FILE", "open_private", "private_dir", "tighten_file", "write_private"]

PRIVATE_DIR = 0o700
PRIVATE_FILE = 0o600
_OPEN_TO_OTHERS = 0o077  # any group or other permission bit

_log = logging.getLogger("llmgw.files")


def private_dir(path: str | os.PathLike[str], what: str, *, dedicated: bool = True,
                log: logging.Logger = _log) -> None:
    """Make sure `path` exists as a directory closed to group and others.

    A missing one is created 0700 (parents llmgw creates on the way get the default mode: they
    are shared places such as ~/.local/state). An existing one that is open to others is
    tightened to 0700 with a warning when it is `dedicated` (llmgw's own: the agent's state_dir,
    its engines/ and logs/); a directory that may be shared with other programs (the parent of
    a configured store path, e.g. /var/lib) is never chmod-ed: it gets a warning instead, since
    the files llmgw keeps there are 0600 anyway."""
    p = Path(path)
    try:
        p.mkdir(mode=PRIVATE_DIR)
        return  # created by us: 0700 (the umask can only take bits away)
    except FileExistsError:
        pass
    except FileNotFoundError:
        p.parent.mkdir(parents=True, exist_ok=True)
        try:
            p.mkdir(mode=PRIVATE_DIR)
            return
        except FileExistsError:
            pass
    st = p.stat()
    if not stat.S_ISDIR(st.st_mode):
        raise NotADirectoryError(f"{what}: {p} is not a directory")
    mode = stat.S_IMODE(st.st_mode)
    if not mode & _OPEN_TO_OTHERS:
        return
    if not dedicated:
        log.warning("%s: directory %s is mode %04o (other users can list it); llmgw's files in it are "
                    "0600, but give llmgw a directory of its own (chmod 700) to keep even their names private",
                    what, p, mode)
        return
    try:
        os.chmod(p, mode & ~_OPEN_TO_OTHERS)
    except OSError as e:
        log.warning("%s: directory %s is mode %04o and cannot be tightened (%s): chmod 700 %s",
                    what, p, mode, e.strerror or e, p)
        return
    log.warning("%s: directory %s was mode %04o: tightened to %04o", what, p, mode, mode & ~_OPEN_TO_OTHERS)


def tighten_file(path: str | os.PathLike[str], what: str, *, log: logging.Logger = _log) -> None:
    """An existing file open to group or others becomes 0600, with a warning; a missing one is fine."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return
    mode = stat.S_IMODE(st.st_mode)
    if not mode & _OPEN_TO_OTHERS:
        return
    try:
        os.chmod(path, PRIVATE_FILE)
    except OSError as e:
        log.warning("%s: %s is mode %04o and cannot be tightened (%s): chmod 600 %s", what, path, mode,
                    e.strerror or e, path)
        return
    log.warning("%s: %s was mode %04o: tightened to 0600", what, path, mode)


def open_private(path: str | os.PathLike[str], flags: int, what: str, *, log: logging.Logger = _log) -> int:
    """os.open with O_CREAT and mode 0600; a file that existed open to others is tightened (and
    warned about). Returns the descriptor."""
    fd = os.open(path, flags | os.O_CREAT | os.O_CLOEXEC, PRIVATE_FILE)
    try:
        mode = stat.S_IMODE(os.fstat(fd).st_mode)
        if mode & _OPEN_TO_OTHERS:
            os.fchmod(fd, PRIVATE_FILE)
            log.warning("%s: %s was mode %04o: tightened to 0600", what, path, mode)
    except BaseException:
        os.close(fd)
        raise
    return fd


def write_private(path: str | os.PathLike[str], data: bytes, what: str, *, log: logging.Logger = _log) -> None:
    """Replace `path` atomically with `data`, 0600 from its first byte (a temporary file beside it,
    then rename: a crash mid-write leaves the old file or the new one, never half of one)."""
    p = Path(path)
    tmp = p.with_name(p.name + ".tmp")
    fd = open_private(tmp, os.O_WRONLY | os.O_TRUNC, what, log=log)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, p)
