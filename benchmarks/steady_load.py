"""Steady load: do turns keep up with webhooks arriving at a constant rate?

Run from the repository root, with the project's virtualenv active:

    python benchmarks/steady_load.py [--rates 200,400,800] [--seconds 10]

For each rate it starts, like end_to_end.py (whose fake Bot API, gateway start-up and load
connection it uses), a fake Telegram Bot API and the real ``gateway serve`` on a fresh SQLite file
with the pacing limits off, then posts Telegram text updates at that constant rate for ``--seconds``
from 32 keep-alive connections over 200 chats, each post at its scheduled time. It reports how long
after the last post the last reply reached the fake platform: a few milliseconds means the turns
kept up; seconds mean a backlog built up meanwhile. The gateway holds new turns back only in a
flood (see the inbox worker's flood rule in README.md); a steady load under its capacity must not
be one. It prints a markdown table; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

import end_to_end as e2e
from webhooks import log

LANES = 32
CHATS = 200


async def post_at_rate(url: str, rate: float, seconds: float) -> float:
    """Post rate x seconds updates on schedule; the time.monotonic() of the last 200."""
    connections = [e2e.Connection(url) for _ in range(LANES)]
    headers = {"X-Telegram-Bot-Api-Secret-Token": e2e.SECRET, "Content-Type": "application/json"}
    total = int(rate * seconds)
    start = time.monotonic()

    async def lane(number: int) -> None:
        for i in range(number, total, LANES):
            delay = start + i / rate - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)  # pacing the load, not synchronizing
            body = e2e.update_body(1_000_000 + i, 5000 + i % CHATS, i + 1, f"Where is order {i}?")
            status, _ = await connections[number].post("/webhooks/telegram", body, headers)
            if status != 200:
                raise SystemExit(f"webhook answered {status}")

    try:
        await asyncio.gather(*(lane(number) for number in range(LANES)))
    finally:
        await asyncio.gather(*(connection.close() for connection in connections))
    return time.monotonic()


def measure(rate: float, seconds: float) -> float:
    """Milliseconds from the last post to the last reply at the fake platform."""
    with tempfile.TemporaryDirectory(prefix="chatflow-gateway-steady-") as tmp:
        work = Path(tmp)
        (work / "fake").mkdir()
        (work / "gateway").mkdir()
        fake = e2e.start_fake_platform(work / "fake")
        try:
            gateway = e2e.start_gateway(work / "gateway", fake.url)
            try:
                last_post = asyncio.run(post_at_rate(gateway.url, rate, seconds))
                summary = e2e.wait_for_replies(fake.url, gateway, int(rate * seconds), timeout=300)
            finally:
                gateway.stop()
        finally:
            fake.stop()
    return (float(summary["last_at"]) - last_post) * 1000


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", default="200,400,800", help="messages per second, comma-separated")
    parser.add_argument("--seconds", type=float, default=10, help="seconds of load per rate (default 10)")
    args = parser.parse_args()
    rows = []
    for rate in (float(part) for part in args.rates.split(",")):
        log(f"{rate:,.0f} messages/s for {args.seconds:g} s ...")
        lag = measure(rate, args.seconds)
        log(f"  last reply {lag:,.0f} ms after the last post")
        rows.append(f"| {rate:,.0f} | {int(rate * args.seconds):,} | {lag:,.0f} ms |")
    print("| Steady rate (messages/s) | Messages | Last reply after the last post |")
    print("| ---: | ---: | ---: |")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
