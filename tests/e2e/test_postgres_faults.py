"""The database faults of the reliability issue, on a real `gateway serve` and a private PostgreSQL
server that the test freezes (SIGSTOP on every server process), stops (fast shutdown) and crashes
(SIGKILL on every server process), then brings back.

Until these tests the three faults were exercised only by `benchmarks/faults.py`, which reports
figures and asserts nothing. Each test here posts a steady load of "Where is order <n>?" messages
(tests/faultkit.py: a conversation's messages in order, each after the previous 200, some delivered
twice, refused ones posted again as a platform does), inflicts the fault once a few messages are
answered, and holds it for 8 s (a freeze for 10 s). Meanwhile:

- every webhook gets an answer (200 or 503) within GATEWAY_DATABASE_TIMEOUT_SECONDS plus a margin,
  refusals with Retry-After, and /readyz says 503 in bounded time: nothing hangs on the database
  (finding 5: frozen, 20 of 20 webhooks were still unanswered after 30 s);
- while frozen, a burst of webhooks larger than GATEWAY_MAX_QUEUED_WEBHOOKS is refused at once
  beyond that bound ("too many"): requests do not pile up in memory.

After the fault, every message whose webhook got a 200 has exactly one committed turn and exactly one
reply at the fake Bot API, a conversation's replies in the order of its messages, every inbox row
`done` and every outbox row `sent`, /readyz is 200 again, and every message posted before the fault's
end is answered within RECOVERED_WITHIN of it (before the short leases: 52 s after a crash). A reply
the platform took while the database was away is recorded when it returns (delivery retries
recording an outcome for up to a lease, longer than these faults), so no reply is sent twice.
"""

from __future__ import annotations

import asyncio
import os
import pwd
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from tests import faultkit as fk

# Marked as the other PostgreSQL e2e tests, though the server is a private one (started here, not
# named by GATEWAY_TEST_POSTGRES_URL): what they do is freeze, stop and kill it.
pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.postgres]

DATABASE_TIMEOUT = 2.0  # GATEWAY_DATABASE_TIMEOUT_SECONDS of the gateway under test
MAX_QUEUED = 8  # GATEWAY_MAX_QUEUED_WEBHOOKS
READY_TIMEOUT = 2.0  # /readyz's own bound (gateway/web/health.py)
# /readyz on a frozen server answers at its timeout (its probe's cancelled query used to hold the answer
# as long again: ~4 s); a second more is the loaded machine's.
READY_ANSWERED_WITHIN = READY_TIMEOUT + 1.0
MARGIN = 3.0  # for a loaded 2-core machine: an answer later than its bound plus this is a hang
OUTAGE = 8.0  # seconds a stop or a crash lasts
FREEZE = 10.0  # seconds a freeze lasts: longer than every bound on an answer, so a hang shows
CONVERSATIONS = 6
PER_CONVERSATION = 14  # under max_turns (40): every user message stays in its session, to be counted
INTERVAL = 0.5  # seconds between a conversation's messages, on average
FAULT_AFTER_ACKS = CONVERSATIONS * 2  # the fault starts once this many messages are acknowledged
BURST = 30  # webhooks posted at once while the database is frozen (more than MAX_QUEUED)
PROBES = 4  # webhooks posted at once while it is stopped or crashed
DRAIN = 60.0  # after the load, for every reply
READY_AGAIN = 30.0  # after the fault, for /readyz to be 200
# After the fault, for the reply to every message first posted before its end: a row whose lease its
# worker lost with the database waits out that lease (GATEWAY_LEASE_SECONDS, 30 s) at most.
RECOVERED_WITHIN = 45.0
CHAT_BASE = 700_000_000
ORDER_BASE = 3_000_000


def _no_server_reason() -> str | None:
    if fk.postgres_bin() is None:
        return "no PostgreSQL binaries under /usr/lib/postgresql/*/bin to run a private server with"
    if os.geteuid() == 0:
        try:
            pwd.getpwnam("postgres")
        except KeyError:
            return "running as root and no `postgres` OS user to run the private server as"
    return None


@pytest.fixture(scope="module")
def server() -> Iterator[fk.PrivatePostgres]:
    """One private server for the module (initdb once); each test has a database of its own."""
    reason = _no_server_reason()
    if reason:
        pytest.skip(reason=reason)
    server = fk.PrivatePostgres()
    try:
        server.start()
        yield server
    finally:
        server.close()


@dataclass
class Probe:
    """A webhook or /readyz request made during the fault: its status, time to answer, headers, body."""

    status: int
    seconds: float
    retry_after: str | None = None
    detail: str = ""


@dataclass
class Run:
    driver: fk.Driver
    platform: fk.FakeBotAPI
    chats: list[list[fk.Message]]
    counts: fk.DatabaseCounts | None = None
    fault_start: float = 0.0
    fault_end: float = 0.0
    ready_during: Probe | None = None
    probes: list[Probe] = field(default_factory=list)
    ready_again_after: float | None = None
    exit_code: int | None = None


async def post_at_once(url: str, messages: list[fk.Message]) -> list[Probe]:
    """Post each message once, all at the same moment, and time each answer."""
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=httpx.Limits(max_connections=None)) as http:

        async def one(message: fk.Message) -> Probe:
            started = time.monotonic()
            try:
                answer = await http.post(fk.WEBHOOK_PATH, content=message.body(), headers=fk.WEBHOOK_HEADERS)
            except httpx.HTTPError:
                return Probe(0, time.monotonic() - started)
            detail = answer.json().get("detail", "") if answer.status_code != 200 else ""
            seconds = time.monotonic() - started
            return Probe(answer.status_code, seconds, answer.headers.get("retry-after"), detail)

        return list(await asyncio.gather(*(one(message) for message in messages)))


async def readyz(url: str) -> Probe:
    def get() -> int:
        try:
            with urllib.request.urlopen(f"{url}/readyz", timeout=60) as answer:
                return int(answer.status)
        except urllib.error.HTTPError as error:
            return error.code
        except (urllib.error.URLError, OSError):
            return 0

    started = time.monotonic()
    status = await asyncio.to_thread(get)
    return Probe(status, time.monotonic() - started)


def run_with_fault(
    tmp_path: Path,
    server: fk.PrivatePostgres,
    *,
    inflict: Callable[[], None],
    end: Callable[[], None],
    probes: int,
    seed: int,
    outage: float = OUTAGE,
) -> Run:
    """The load on one `gateway serve`, the fault held for `outage` seconds during it, then the drain."""
    url = server.create_database(f"pgfaults_{uuid.uuid4().hex[:8]}")
    fk.migrate(url, tmp_path)
    platform = fk.FakeBotAPI()
    settings = fk.gateway_settings(
        url,
        platform.api_base,
        GATEWAY_DATABASE_TIMEOUT_SECONDS=str(DATABASE_TIMEOUT),
        GATEWAY_MAX_QUEUED_WEBHOOKS=str(MAX_QUEUED),
    )
    gateway = fk.GatewayProcess("gateway", tmp_path / "gateway", fk.clean_env(**settings))
    chat_base, order_base = CHAT_BASE + seed * 10_000, ORDER_BASE + seed * 100_000
    chats = fk.conversations(CONVERSATIONS, PER_CONVERSATION, chat_base=chat_base, order_base=order_base)
    # The probes: one message each in chats of their own, posted during the fault, then again after it.
    extra = [
        fk.Message(order_base + 50_000 + i, chat_base + 5_000 + i, order_base + 50_000 + i, 1)
        for i in range(probes)
    ]
    driver = fk.Driver([gateway.url], duplicate_rate=0.1, seed=seed, request_timeout=60)
    run = Run(driver, platform, [*chats, *([m] for m in extra)])

    def restore() -> None:  # whatever happened, the next test finds the server up
        server.thaw()
        if not server.accepting():
            server.start()

    async def fault() -> None:
        async with asyncio.timeout(60):  # a gateway that acknowledges nothing fails here, not hangs
            await driver.until_acked(FAULT_AFTER_ACKS)
        run.fault_start = time.monotonic()
        await asyncio.to_thread(inflict)  # a stop or kill waits for the server's processes to end
        run.ready_during, run.probes = await asyncio.gather(
            readyz(gateway.url), post_at_once(gateway.url, extra)
        )
        await asyncio.sleep(max(0.0, run.fault_start + outage - time.monotonic()))  # the fault's length
        await asyncio.to_thread(end)  # a start waits until the server accepts connections
        run.fault_end = time.monotonic()
        # The platform posts the probes again until each is acknowledged.
        await asyncio.gather(*(driver.deliver(message) for message in extra))
        run.ready_again_after = await asyncio.to_thread(ready_again, gateway, run.fault_end)

    async def load() -> None:
        driver.give_up_at = time.monotonic() + 120
        try:
            await asyncio.gather(driver.run(chats, interval=INTERVAL), fault())
        finally:
            await driver.aclose()

    with fk.stopping(platform.close, gateway.kill, restore):
        gateway.start()
        asyncio.run(load())
        fk.wait_answered(platform, driver.acked_at, DRAIN)
        run.exit_code = gateway.stop()
    run.counts = fk.run_sync(fk.database_counts(url, [chat[0].chat_id for chat in run.chats]))
    return run


def ready_again(gateway: fk.GatewayProcess, since: float) -> float | None:
    """Seconds from `since` until /readyz is 200 (None: not within READY_AGAIN)."""

    def ready() -> bool:
        try:
            with urllib.request.urlopen(f"{gateway.url}/readyz", timeout=5) as answer:
                return bool(answer.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    try:
        fk.wait_for(ready, "/readyz to be 200 again", READY_AGAIN - (time.monotonic() - since), 0.2)
    except TimeoutError:
        return None
    return time.monotonic() - since


def check_no_hang(run: Run) -> None:
    """Every webhook answered 200 or 503 (with Retry-After) in bounded time; /readyz 503 during it."""
    bound = DATABASE_TIMEOUT + MARGIN
    slow = [d for d in run.driver.deliveries if d.status == 0 or d.seconds > bound]
    assert not slow, (
        f"{len(slow)} of {len(run.driver.deliveries)} webhooks unanswered or answered after more than "
        f"{bound:g}s, e.g. {max(slow, key=lambda d: d.seconds)}"
    )
    assert {d.status for d in run.driver.deliveries} <= {200, 503}
    during = [d for d in run.driver.deliveries if run.fault_start <= d.started < run.fault_end]
    assert any(d.status == 503 for d in during), "the load felt the fault: some webhooks were refused"
    assert [p.status for p in run.probes] == [503] * len(run.probes), "nothing commits during the fault"
    slowest = max(p.seconds for p in run.probes)
    assert slowest <= bound, f"a webhook posted during the fault answered after {slowest:.1f}s"
    assert all(p.retry_after for p in run.probes), "a 503 says when to retry"
    assert run.ready_during is not None
    assert run.ready_during.status == 503, "/readyz is not ready while the database is away"
    took = run.ready_during.seconds
    assert took <= READY_ANSWERED_WITHIN, f"/readyz took {took:.1f}s"


def check_exactly_once_in_order(run: Run) -> None:
    """Every acknowledged message: one turn, one reply, in its conversation's order; nothing left over."""
    counts = run.counts
    assert counts is not None
    posted = run.driver.posted()
    acked = set(run.driver.acked_at)
    assert acked == posted, f"{len(posted - acked)} messages were never acknowledged"
    counted: dict[int, int] = {}
    for reply in run.platform.replies:
        counted[reply.order] = counted.get(reply.order, 0) + 1
    lost = sorted(acked - set(counted))
    assert not lost, f"{len(lost)} acknowledged messages got no reply, e.g. {lost[:5]}"
    twice = sorted(order for order, n in counted.items() if n > 1)
    assert not twice, f"{len(twice)} messages answered more than once, e.g. {twice[:5]}"
    assert set(counted) == acked, "no reply to anything else"
    per_chat = run.platform.per_chat()
    expected = {chat[0].chat_id: [m.order for m in chat if m.order in acked] for chat in run.chats}
    wrong = [chat for chat, orders in expected.items() if per_chat.get(str(chat), []) != orders]
    assert not wrong, f"{len(wrong)} conversations answered out of order, e.g. {wrong[0]}"
    turns = {order: counts.turns.get(order, 0) for order in acked}
    assert set(turns.values()) == {1}, f"turns per message: {sorted(set(turns.values()))}"
    sessions = {chat: counts.session_orders.get(f"telegram:{chat}", []) for chat in expected}
    assert sessions == expected, "each session holds its messages once, in arrival order"
    assert counts.stored == acked
    assert counts.inbox == {"done": len(acked)}
    assert counts.outbox == {"sent": len(acked)}


def recovery_seconds(run: Run) -> float | None:
    """From the fault's end to the first reply of the last-answered message first posted before it."""
    first: dict[int, float] = {}
    for reply in run.platform.replies:
        first.setdefault(reply.order, reply.at)
    before = [o for o, t in run.driver.first_post.items() if t <= run.fault_end]
    if any(o not in first for o in before):
        return None
    return max((first[o] for o in before), default=run.fault_end) - run.fault_end


def check_recovered(run: Run) -> None:
    recovered = recovery_seconds(run)
    assert recovered is not None
    assert recovered <= RECOVERED_WITHIN, f"answered {recovered:.1f}s after the fault's end"
    assert run.ready_again_after is not None, f"/readyz not 200 within {READY_AGAIN:g}s of the fault's end"
    assert run.exit_code == 0, "the gateway drains and exits 0 on SIGTERM"


def summary(run: Run) -> str:
    statuses = run.driver.statuses()
    return (
        f"{len(run.driver.deliveries)} deliveries {statuses}, {len(run.driver.acked_at)} acked; slowest "
        f"answer {max(d.seconds for d in run.driver.deliveries):.2f}s; "
        f"probes {[(p.status, round(p.seconds, 2)) for p in run.probes]}; "
        f"/readyz during {run.ready_during}, 200 again {run.ready_again_after}s after; replies to "
        f"messages posted before the fault's end done {recovery_seconds(run)}s after it"
    )


def test_a_frozen_database_gets_bounded_503s_and_loses_nothing(
    tmp_path: Path, server: fk.PrivatePostgres
) -> None:
    run = run_with_fault(
        tmp_path, server, inflict=server.freeze, end=server.thaw, probes=BURST, seed=1, outage=FREEZE
    )
    print(summary(run))
    check_no_hang(run)
    # The burst: at most MAX_QUEUED waited for a commit (then "did not commit in time"); the rest were
    # refused at once ("too many") instead of queueing in memory.
    waited = [p for p in run.probes if "in time" in p.detail]
    refused = [p for p in run.probes if "too many" in p.detail]
    assert len(waited) + len(refused) == BURST, [p.detail for p in run.probes]
    assert len(waited) <= MAX_QUEUED
    assert len(refused) >= BURST - MAX_QUEUED
    assert max(p.seconds for p in refused) < DATABASE_TIMEOUT, "refused at once, not after the timeout"
    check_exactly_once_in_order(run)
    check_recovered(run)


def test_a_stopped_and_restarted_database_loses_nothing(tmp_path: Path, server: fk.PrivatePostgres) -> None:
    run = run_with_fault(tmp_path, server, inflict=server.stop, end=server.start, probes=PROBES, seed=2)
    print(summary(run))
    check_no_hang(run)
    check_exactly_once_in_order(run)
    check_recovered(run)


def test_a_crashed_and_restarted_database_loses_nothing(tmp_path: Path, server: fk.PrivatePostgres) -> None:
    run = run_with_fault(tmp_path, server, inflict=server.kill, end=server.start, probes=PROBES, seed=3)
    print(summary(run))
    check_no_hang(run)
    check_exactly_once_in_order(run)
    check_recovered(run)
