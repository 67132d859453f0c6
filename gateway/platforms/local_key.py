"""The local mode's key: lets a fresh install try the whole path without any platform secret.

A platform whose secret is not configured still accepts webhooks that come from a loopback client
AND are signed with this key, which `gateway serve` writes (mode 0600) beside its data at start-up
and `gateway simulate` reads. Loopback alone is not enough: a reverse proxy on the same host makes
every public request look local, and nobody outside the machine can read the file.
"""

from __future__ import annotations

import ipaddress
import os
import secrets
import tempfile
from pathlib import Path


def load_or_create(path: Path) -> str:
    """The key in `path`, written first when missing.

    Written to a temporary file and hard-linked into place, so processes starting together
    (`gateway serve --workers N`) all read the one complete key.
    """
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        descriptor, name = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)  # mode 0600
        temporary = Path(name)
        with os.fdopen(descriptor, "w") as file:
            # URL-safe characters are valid in both a Telegram secret token and an HMAC key.
            file.write(secrets.token_urlsafe(32))
        try:
            os.link(temporary, path)
        except FileExistsError:
            pass  # another process won; use its key
        finally:
            temporary.unlink()
    return read(path)


def read(path: Path) -> str:
    """The key in `path`; OSError when there is none, ValueError when the file is empty or other users
    may read it (anyone who can read the key can post webhooks in its name)."""
    mode = path.stat().st_mode & 0o777
    if mode & 0o077:
        raise ValueError(f"{path} is readable by other users (mode {mode:o}); run: chmod 600 {path}")
    key = path.read_text().strip()
    if not key:
        raise ValueError(f"{path} is empty")
    return key


def is_loopback(host: str | None) -> bool:
    """True for 127.0.0.0/8 and ::1; False for anything else, names and garbage included."""
    if not host:
        return False
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
