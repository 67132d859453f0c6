"""`/readyz` of the real `gateway serve` when its SQLite file cannot be written: a full filesystem (a
small tmpfs, where this machine lets a test mount one) and files that may not grow (RLIMIT_FSIZE,
which works anywhere). Webhooks fail then, and readiness must say so; both come back with the room."""

from __future__ import annotations

import errno
import json
import os
import resource
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest

from tests.helpers import wait_until
from tests.serve_process import ServeProcess, serve_process

pytestmark = pytest.mark.e2e

TG_SECRET = "tg-secret-readiness"


def webhook(served: ServeProcess, update_id: int) -> int:
    person = {"id": update_id, "is_bot": False, "first_name": "T"}
    message = {"message_id": update_id, "date": 1767225600, "chat": {**person, "type": "private"}}
    update = {"update_id": update_id, "message": {**message, "from": person, "text": "hi"}}
    headers = {"X-Telegram-Bot-Api-Secret-Token": TG_SECRET, "Content-Type": "application/json"}
    answer = httpx.post(
        f"{served.base}/webhooks/telegram", content=json.dumps(update), headers=headers, timeout=30
    )
    return answer.status_code


def readiness(served: ServeProcess) -> httpx.Response:
    return httpx.get(f"{served.base}/readyz", timeout=30)


def assert_unready_while_webhooks_fail(served: ServeProcess) -> None:
    assert webhook(served, 2) == 503  # the fault is real: the gateway cannot store a message
    answer = readiness(served)
    assert answer.status_code == 503, answer.text
    assert answer.json()["status"] == "unready"


def assert_ready_again(served: ServeProcess) -> None:
    wait_until(lambda: readiness(served).status_code == 200, "/readyz to say ready again", timeout=30)
    assert webhook(served, 3) == 200


def test_readyz_is_503_while_the_database_files_may_not_grow(tmp_path: Path) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path / 'data' / 'gateway.db'}"
    with serve_process(tmp_path, GATEWAY_DATABASE_URL=url, GATEWAY_TELEGRAM_SECRET_TOKEN=TG_SECRET) as served:
        assert webhook(served, 1) == 200
        _, hard = resource.prlimit(served.pid, resource.RLIMIT_FSIZE)
        # No file of the gateway may grow by a byte (Python ignores SIGXFSZ: writes fail with EFBIG).
        resource.prlimit(served.pid, resource.RLIMIT_FSIZE, (0, hard))
        try:
            assert_unready_while_webhooks_fail(served)
        finally:
            resource.prlimit(served.pid, resource.RLIMIT_FSIZE, (hard, hard))
        assert_ready_again(served)


def fill(path: Path) -> int:
    """Write zeros to `path` until the filesystem refuses; the error number it refused with."""
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        while True:
            os.write(descriptor, b"\0" * 65536)
    except OSError as exc:
        return exc.errno or 0
    finally:
        os.close(descriptor)


def _can_mount_tmpfs() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(
        ["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /mnt"],
        capture_output=True,
        timeout=30,
    )
    return probe.returncode == 0


@pytest.mark.skipif(
    not _can_mount_tmpfs(),
    reason="no unprivileged user and mount namespaces here (unshare -rm), so no tmpfs to fill;"
    " the RLIMIT_FSIZE test covers the same fault",
)
def test_readyz_is_503_on_a_full_filesystem(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    url = f"sqlite+aiosqlite:///{data / 'gateway.db'}"
    # The gateway runs in a mount namespace of its own, with a 4 MiB tmpfs on `data`.
    mount = ["unshare", "-rm", "sh", "-c", 'mount -t tmpfs -o size=4m tmpfs "$0" && exec "$@"', str(data)]
    with serve_process(
        tmp_path, command=mount, GATEWAY_DATABASE_URL=url, GATEWAY_TELEGRAM_SECRET_TOKEN=TG_SECRET
    ) as served:
        assert webhook(served, 1) == 200
        filler = Path(f"/proc/{served.pid}/root") / str(data).lstrip("/") / "filler"
        assert fill(filler) == errno.ENOSPC  # `data` as the gateway sees it, through its root
        try:
            assert_unready_while_webhooks_fail(served)
        finally:
            os.unlink(filler)
        assert_ready_again(served)
