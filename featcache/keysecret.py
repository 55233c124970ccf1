"""Where a cache's key secret lives, and the ``KeyHasher`` every entry point keys with.

A server's keys must resist crafted collisions, and clients must not be able to predict them. So a
cache keys with keyed BLAKE3 under a random 32-byte secret (``KeyHasher("blake3", secret)``), and
every process that shares the cache's entries must key with the same secret: a secret is found,
in this order, and created where none exists yet:

1. ``key_secret_file``: a file the operator names (hex text, e.g. ``openssl rand -hex 32``);
   created (mode 0600) when it does not exist;
2. the remote tier (``remote_url``): ``<remote_prefix>:key-secret`` on the shared server, set
   once with ``SET NX`` so that every replica of a fleet reads the same one; the store's file
   below is then brought in line with it;
3. the disk tier: ``<disk_path>/key-secret`` (hex text, mode 0600), created at first open;
4. none of those: a random secret for this cache alone (its keys live as long as it does).

``key_algorithm="xxh3_128"`` (unkeyed, fast, not collision-resistant) is the explicit opt-in for
a single trusted tenant; ``"blake2b"`` keys with the same secret as ``"blake3"``.

Invariants: a secret is never logged, shown in ``repr``, stats or errors; a secret file is
created atomically (written to a temporary file, then linked into place), so concurrent first
opens agree on one secret; a file that is a link, not a regular file, or not 16 to 64 bytes of hex
is refused (``ValueError``) rather than replaced; where the secret cannot be read or written (an
unreachable remote server, a read-only directory), the cache still works with a secret of its
own, and says once what that costs (its keys match no other process's).
"""

from __future__ import annotations

import binascii
import logging
import os
import stat
import tempfile
from typing import TYPE_CHECKING, Any

from .keys import KeyHasher
from .store.files import SECRET_FILE  # in a store's directory (the store's files have one home)

if TYPE_CHECKING:
    from .config import CacheConfig

log = logging.getLogger("featcache")

SECRET_BYTES = 32
REMOTE_SUFFIX = "key-secret"  # <remote_prefix>:key-secret on the remote server
_MAX_FILE_BYTES = 256  # a secret file is a line of hex: anything longer is not one


def hasher_for(config: CacheConfig) -> KeyHasher:
    """The ``KeyHasher`` of a cache with these settings (see the module docstring)."""
    algorithm = config.key_algorithm
    if algorithm == "xxh3_128":
        return KeyHasher("xxh3_128")
    secret: bytes | None = None
    if config.key_secret_file is not None:
        secret = read_or_create(config.key_secret_file)  # the operator's file: errors are theirs
    if secret is None and config.remote_url is not None:
        secret = _remote_secret(config)
    if secret is None and config.disk_path is not None:
        secret = _store_secret(config.disk_path)
    if secret is None:
        secret = os.urandom(SECRET_BYTES)
    return KeyHasher(algorithm, secret)


def read_or_create(path: str) -> bytes:
    """The secret in file ``path``, created (random, mode 0600, atomically) when there is none.
    Raises ``ValueError`` for a file that is not a secret, ``OSError`` where it cannot be read or
    created."""
    secret = read_secret(path)
    if secret is not None:
        return secret
    return _create(path, os.urandom(SECRET_BYTES))


def read_secret(path: str) -> bytes | None:
    """The secret in file ``path``, or None when there is no such file."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError:
        if os.path.islink(path):
            raise ValueError(f"the key secret file {path!r} is a symbolic link: name the file "
                             "itself") from None
        raise
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ValueError(f"the key secret file {path!r} is not a regular file")
        if info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            log.warning("featcache: the key secret file %s can be read by other users; "
                        "chmod 600 it", path)
        text = os.read(fd, _MAX_FILE_BYTES + 1)
    finally:
        os.close(fd)
    return _parse(text, path)


def _parse(text: bytes, path: str) -> bytes:
    try:
        secret = binascii.unhexlify(text.strip())
    except (binascii.Error, ValueError):
        secret = b""
    if len(text) > _MAX_FILE_BYTES or not 16 <= len(secret) <= 64:
        raise ValueError(f"the key secret file {path!r} does not hold a secret: it must be one "
                         "line of 32 to 128 hex digits (e.g. `openssl rand -hex 32 > FILE`)")
    return secret


def _create(path: str, secret: bytes) -> bytes:
    """Write ``secret`` to ``path`` unless a file is there already (then that one's secret)."""
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".key-secret.", dir=directory)  # mode 0600
    try:
        os.write(fd, secret.hex().encode() + b"\n")
        os.fsync(fd)
        os.close(fd)
        fd = -1
        try:
            os.link(tmp, path)  # atomic, and fails where a file exists: the first creator wins
        except FileExistsError:
            existing = read_secret(path)
            if existing is None:  # removed in between: try once more
                os.link(tmp, path)
                return secret
            return existing
        return secret
    finally:
        if fd >= 0:
            os.close(fd)
        os.unlink(tmp)


def _replace(path: str, secret: bytes) -> None:
    """Put ``secret`` in ``path`` in place of what is there (atomic rename)."""
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".key-secret.", dir=directory)
    try:
        os.write(fd, secret.hex().encode() + b"\n")
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.replace(tmp, path)
    except OSError:
        os.unlink(tmp)
        raise


def _store_secret(disk_path: str) -> bytes | None:
    """The secret kept in a store's directory (created at first open), or None where it cannot be
    read or made (said once: this cache's keys then match no other process's)."""
    path = os.path.join(disk_path, SECRET_FILE)
    try:
        os.makedirs(disk_path, mode=0o700, exist_ok=True)
        return read_or_create(path)
    except (OSError, ValueError) as e:
        log.warning("featcache: cannot keep the key secret in the store %s (%s); this cache keys "
                    "with a secret of its own: its entries will not be found by other processes "
                    "or after a restart", disk_path, e)
        return None


def remote_secret_name(config: CacheConfig) -> str:
    """Where the fleet's secret lives on the remote server."""
    return f"{config.remote_prefix}:{REMOTE_SUFFIX}"


def _remote_secret(config: CacheConfig) -> bytes | None:
    """The fleet's secret on the remote server (set there once, from the store's when it has one),
    written into the store so that a later start without the server keys alike; None where the
    server cannot be reached (then the store's secret serves, said once)."""
    from .tiers.remote_calls import connect

    name = remote_secret_name(config)
    local = None
    if config.disk_path is not None:
        try:
            local = read_secret(os.path.join(config.disk_path, SECRET_FILE))
        except (OSError, ValueError):
            local = None
    proposal = local or os.urandom(SECRET_BYTES)
    try:
        if config.remote_url is not None and config.remote_url.startswith("mooncake://"):
            from .tiers.mooncake_client import read_or_set_secret

            value = read_or_set_secret(config, name, proposal.hex().encode())
        else:
            client: Any = connect(config)
            try:
                client.set(name, proposal.hex(), nx=True)
                value = client.get(name)
            finally:
                client.close()
        secret = _parse(value if isinstance(value, bytes) else str(value).encode(), name)
    except Exception as e:  # unreachable, refused, or not a secret: keys stay local
        log.warning("featcache: cannot read the key secret from the remote tier (%s); keying "
                    "with the store's: this process's keys may not match the fleet's until it "
                    "restarts with the server reachable", type(e).__name__)
        return None
    if config.disk_path is not None and secret != local:
        try:
            os.makedirs(config.disk_path, mode=0o700, exist_ok=True)
            _replace(os.path.join(config.disk_path, SECRET_FILE), secret)
        except OSError as e:
            log.warning("featcache: cannot write the fleet's key secret into the store %s (%s)",
                        config.disk_path, e)
    return secret
