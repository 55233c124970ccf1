"""The files of a store directory: the checks made before LMDB opens them, and who has them open.

A store is a directory holding LMDB's ``data.mdb`` (the pages) and ``lock.mdb`` (the reader
table and the writer mutex). LMDB opens both following symbolic links and writes its lock header
at once, so they are checked first (``check_store_files``): this process must never write where a
link planted by another user points.

Invariant: nothing here opens a file of the store. Closing any descriptor of a file drops every
POSIX lock the process holds on it, LMDB's reader lock on ``lock.mdb`` included, and a writer
would then take this process's readers for dead and reuse the pages they are reading (issue 11).
So "in use" is read from ``/proc/locks`` (``store_in_use``), and the checks use ``stat``/``access``.
"""

from __future__ import annotations

import errno
import os
import stat
import sys

import lmdb

from ..errors import StoreFormatError, StoreOpenError

DATA_FILE = "data.mdb"
LOCK_FILE = "lock.mdb"
SECRET_FILE = "key-secret"  # the keys' secret, kept with the store (``featcache.keysecret``)


class StorePermissionError(StoreOpenError):
    """This user may not read the store (or write its lock file, which a safe reader needs)."""


def check_path_encoding(path: str) -> None:
    """Refuse a path LMDB cannot open: py-lmdb encodes paths as UTF-8, and a name that is not
    (``os.fsdecode`` keeps its bytes as surrogates) raises ``UnicodeEncodeError`` in it, after
    whatever else was made in the directory. Raises ``StoreOpenError`` naming the bytes."""
    try:
        path.encode("utf-8")
    except UnicodeEncodeError:
        raise StoreOpenError(
            f"the path {os.fsencode(path)!r} is not UTF-8, and LMDB opens UTF-8 paths only: "
            "use a directory whose path is UTF-8"
        ) from None


def prepare_store_dir(path: str, *, readonly: bool) -> None:
    """Make sure ``path`` can hold the disk tier's store: its path must be UTF-8
    (``check_path_encoding``); it must exist when ``readonly``, else it is created (0700) and
    must be writable. Then ``check_store_files``. Raises ``StoreOpenError``."""
    check_path_encoding(path)
    if readonly:
        if not os.path.isdir(path):
            raise StoreOpenError(f"no featcache store at {path!r}")
    else:
        try:
            os.makedirs(path, mode=0o700, exist_ok=True)
        except OSError as e:
            raise StoreOpenError(f"cannot create the store directory {path!r}: {e}") from e
        if not os.access(path, os.W_OK | os.X_OK):
            raise StoreOpenError(
                f"the store directory {path!r} is not writable by this user; "
                "fix its permissions or open it read-only"
            )
    check_store_files(path)


def check_store_files(path: str) -> None:
    """Refuse a store whose files another user could redirect: LMDB opens ``lock.mdb`` and
    ``data.mdb`` following symbolic links (and writes its lock header at once), so a link
    planted there would make this process overwrite the link's target with its privileges.

    - ``data.mdb`` and ``lock.mdb``, where present, must be regular files, not links;
    - the directory must not be writable by every user (someone could plant a link between this
      check and LMDB's open), and, for root, must be root's and not group-writable (root
      follows links into any file). Directories above the store are the administrator's.
    Raises ``StoreOpenError`` saying what to change.
    """
    try:
        info = os.stat(path)
    except OSError:
        return  # no directory: the open says why
    mode = info.st_mode
    if mode & stat.S_IWOTH:
        raise StoreOpenError(
            f"the store directory {path!r} is writable by every user (mode {stat.S_IMODE(mode):o}):"
            " anyone could plant links there that LMDB would follow; chmod o-w it (the cache "
            "creates its directory 0700)"
        )
    if os.geteuid() == 0 and (info.st_uid != 0 or mode & stat.S_IWGRP):
        raise StoreOpenError(
            f"the store directory {path!r} is owned by uid {info.st_uid}"
            f"{' and group-writable' if mode & stat.S_IWGRP else ''}: root does not open a store "
            "another user can write (LMDB follows links there); run as its owner, or chown it "
            "to root and chmod g-w"
        )
    for name in (DATA_FILE, LOCK_FILE):
        file = os.path.join(path, name)
        try:
            kind = os.lstat(file).st_mode
        except FileNotFoundError:
            continue
        except OSError as e:
            raise StoreOpenError(f"cannot inspect {file!r}: {e}") from e
        if stat.S_ISLNK(kind) or not stat.S_ISREG(kind):
            what = "a symbolic link" if stat.S_ISLNK(kind) else "not a regular file"
            raise StoreOpenError(
                f"{file!r} is {what}: LMDB would follow it and write there; a store's files "
                "must be regular files (move the store away and let the cache create a new one)"
            )


# The advice of a permission error to the commands that read without the lock (the command line
# drops it for those that do not take --no-lock).
NO_LOCK_HINT = ", or add --no-lock if no process has the store open"


def check_store_dir(path: str, *, lock: bool) -> None:
    """Raise the error a user can act on if ``path`` cannot hold a store a tool can read
    (``lock``: with LMDB's reader registration, which needs write access to ``lock.mdb``)."""
    check_path_encoding(path)
    if not os.path.exists(path):
        raise StoreOpenError(f"no such directory: {path!r}")
    if not os.path.isdir(path):
        raise StoreOpenError(f"{path!r} is not a directory (a store is a directory)")
    data = os.path.join(path, DATA_FILE)
    if not os.access(path, os.R_OK | os.X_OK):
        raise StorePermissionError(f"permission denied: cannot read the directory {path!r}")
    if not os.path.exists(data):
        raise StoreFormatError(f"{path!r} is not a featcache store (no {DATA_FILE} in it)")
    check_store_files(path)
    if os.path.isfile(data) and os.path.getsize(data) == 0:  # (LMDB says "Bad file descriptor")
        raise StoreFormatError(f"{path!r} is not a featcache store: its {DATA_FILE} is empty (0 bytes)")
    if not os.access(data, os.R_OK):
        raise StorePermissionError(f"permission denied: cannot read {data!r}; run as its owner")
    lock_file = os.path.join(path, LOCK_FILE)
    lock_ok = os.access(lock_file, os.R_OK | os.W_OK) if os.path.exists(lock_file) else os.access(
        path, os.W_OK)
    if lock and not lock_ok and not _read_only_fs(path):
        raise StorePermissionError(
            f"permission denied: {lock_file!r} is not writable by this user, and a safe reader "
            f"of a live store registers there; run as the store's owner{NO_LOCK_HINT}"
        )


def store_in_use(path: str) -> int | None:
    """The pid of another process that has the store open (it holds LMDB's shared ``fcntl`` lock
    on ``lock.mdb``), 0 if none, None if that cannot be told (not Linux, no lock file).

    Read from ``/proc/locks``, never by opening ``lock.mdb``: closing any descriptor of a file
    drops every POSIX lock this process holds on it, LMDB's reader lock included, and a writer
    would then take this process's readers for dead and reuse the pages they are reading
    (corrupt copies, verify reporting good entries as bad; issue 11).
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        inode = os.stat(os.path.join(path, LOCK_FILE)).st_ino
        with open("/proc/locks", encoding="ascii", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    me = os.getpid()
    for line in lines:
        # "1: POSIX  ADVISORY  READ 1234 fd:01:5678 0 0" ("->" marks a waiter: not a holder)
        fields = line.split()
        if len(fields) < 8 or fields[1] == "->" or fields[1] != "POSIX":
            continue
        try:
            pid = int(fields[4])
            ino = int(fields[5].rsplit(":", 1)[1])
        except (ValueError, IndexError):
            continue
        # The inode alone: a lock on an overlay file system shows the device of the layer below.
        if ino == inode and pid != me and pid > 0:
            return pid
    return 0


def data_file_bytes(path: str) -> int:
    """The size of the store's ``data.mdb``, 0 if there is none (or it cannot be read)."""
    try:
        return os.path.getsize(os.path.join(path, DATA_FILE))
    except OSError:
        return 0


def open_error(path: str, error: lmdb.Error) -> StoreOpenError:
    """The error a user can act on for LMDB's failure to open the store at ``path``."""
    text = str(error)
    if "Permission denied" in text or "EACCES" in text:
        return StorePermissionError(f"permission denied opening the store at {path!r}: {text}")
    return StoreOpenError(f"cannot open the LMDB store at {path!r}: {text}")


def os_error(path: str, error: OSError) -> StoreOpenError:
    """The error a user can act on for a failed file operation in or on ``path``."""
    if error.errno in (errno.EACCES, errno.EPERM):
        return StorePermissionError(f"permission denied: {error.filename or path!r}")
    return StoreOpenError(f"{path!r}: {error.strerror or error}")


def _read_only_fs(path: str) -> bool:
    """On a read-only file system LMDB reads without its lock file (no writer can exist)."""
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def _nearest_existing(path: str) -> str:
    """``path`` made absolute, or the nearest existing path above it (the root exists)."""
    nearest = os.path.abspath(path)
    while not os.path.exists(nearest):
        nearest = os.path.dirname(nearest)
    return nearest


def file_in_the_way(path: str) -> str | None:
    """The file (not a directory) at ``path`` or at the nearest existing path above it, where a
    store directory would be or be made; None if that nearest existing path is a directory."""
    nearest = _nearest_existing(path)
    return None if os.path.isdir(nearest) else (path if nearest == os.path.abspath(path) else nearest)


def cannot_create(path: str) -> str | None:
    """Why no store directory can be at ``path``, or None (it is one, or can be made): a file
    where it, or a directory above it, would be (``file_in_the_way``); or no directory can be made
    under its nearest existing parent (tried with a temporary directory, removed at once: a
    permission check alone passes root under /proc)."""
    import tempfile

    blocking = file_in_the_way(path)
    if blocking is not None:
        return ("is a file, not a directory (a store is a directory)" if blocking == path else
                f"cannot be created: {blocking} is a file, not a directory")
    nearest = _nearest_existing(path)
    if nearest == os.path.abspath(path):
        return None
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".featcache-probe-", dir=nearest))
    except OSError as e:
        return f"cannot be created ({nearest}: {e.strerror or e})"
    return None
