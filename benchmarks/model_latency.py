"""Turns at LLM latency: the real `gateway serve` against a fake OpenAI-compatible server that answers slowly.

Run from the repository root, with the project's virtualenv active (or call its python directly):

    python benchmarks/model_latency.py

It starts, on free loopback ports, the fake Telegram Bot API of benchmarks/end_to_end.py, a fake
OpenAI-compatible server (``fake_model`` below: a Starlette app under uvicorn in its own process that
answers ``POST /v1/chat/completions`` after a fixed latency, optionally refuses calls beyond a
requests-per-minute budget with 429 and ``Retry-After``, or answers 503 for a while: an outage), and,
per scenario, the real ``gateway serve`` in a fresh temporary directory (SQLite file), with
``GATEWAY_MODEL=openai:fake-model`` pointing at the fake server and the agent of
benchmarks/model_agent.py (no tools: one model call per turn). Every setting not named below is the
default, GATEWAY_MAX_TURNS_IN_FLIGHT included.

Each scenario posts ``--messages`` Telegram updates ("Where is order <n>?") from as many chats, one
each, as fast as the webhook takes them (64 keep-alive lanes, see end_to_end.py), and waits for every
reply at the fake Bot API; the fake model's reply names the order, so each reply is matched to its
message. Scenarios:

- ``scripted``: the baseline of the same run: the default scripted demo agent, no model traffic.
- ``1s`` and ``5s``: the fake model answers every call after 1 s (5 s).
- ``1s-in-process``: the bound of the 1 s goal, not a goal of its own: the agent's model answers after
  1 s inside the gateway's process (``in_process_agent`` of benchmarks/model_agent.py), so its calls
  cost nothing; what stays is the acks, the turns' starts and commits and the replies' delivery.
- ``rpm``: 1 s latency, the fake model allows ``--rpm`` requests per minute (a token bucket holding one
  second's worth, as providers meter), 429 with ``Retry-After: 1`` beyond; the gateway is told the same
  budget (GATEWAY_OPENAI_RPM).

Figures: turns/s = messages / (last reply - first post); ideal = messages / (ack time + latency),
where ack time is first post -> last 200; the model's most calls in flight at once (counted by the
fake server) and the seconds from its first call to its last (how long the turns took to start);
429s; the ack time against the ``scripted`` baseline's; and the gateway's CPU per turn (its process's
user + system time from the first post to the last reply, per message) beside the same of the fake
servers and the load generator together (they share the machine's cores with it). A scenario passes when every
message got exactly one reply and, after SIGTERM, every inbox row is done and every outbox row sent. Goals:
>= 0.8 of ideal at 1 s and at 5 s; under an RPM budget, 429s <= 1 % of calls and every turn finished.
The table goes to stdout and benchmarks/model_latency_results.md.
Options: ``--messages`` (2,000), ``--scenarios`` (all), ``--rpm`` (3,000), ``--outage`` (120 s), ``--output``.
The exit status is 1 when a scenario fails its checks or its goal (``1s-in-process`` has no goal).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import end_to_end as e2e  # the fake Bot API, the load lanes, the checks
import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from webhooks import Server, clean_env, code_version, free_port, log, start_process

HERE = Path(__file__).resolve().parent
DEFAULT_OUTPUT = HERE / "model_latency_results.md"
COMMAND = "python benchmarks/model_latency.py"
API_KEY = "sk-bench-0123456789"
GOAL_RATIO = 0.8
GOAL_429_SHARE = 0.01
HOLDING_AFTER_S = 30
LANES = 64
CHAT_BASE = 710_000_000
ORDER = re.compile(r"order (\d+)")


# --- the fake model (runs in its own process, under uvicorn) ---------------------------------------
class FakeModel:
    """Answers after `latency` seconds; meters requests with a token bucket when `rpm` is set; answers
    503 until `outage_until` (monotonic). Counts calls, refusals and the most in flight at once."""

    def __init__(self) -> None:
        self.latency = 1.0
        self.rpm = 0
        self.outage_until = 0.0
        self.in_flight = 0
        self.reset()

    def reset(self) -> None:
        # Calls in flight stay counted: the outage scenario configures the fake while a wave waits on it.
        self.calls = self.refused_429 = self.refused_503 = 0
        self.max_in_flight = self.in_flight
        self.first_call = self.last_call = 0.0  # monotonic: over how long the calls arrived
        self._tokens = 0.0
        self._refilled = time.monotonic()

    def admit(self) -> bool:
        if not self.rpm:
            return True
        now = time.monotonic()
        per_second = self.rpm / 60
        self._tokens = min(per_second, self._tokens + (now - self._refilled) * per_second)
        self._refilled = now
        if self._tokens >= 1:
            self._tokens -= 1
            return True
        return False

    def stats(self) -> dict[str, Any]:
        return {
            "calls": self.calls,
            "refused_429": self.refused_429,
            "refused_503": self.refused_503,
            "max_in_flight": self.max_in_flight,
            "calls_arrived_over_s": round(self.last_call - self.first_call, 2),
        }


def fake_model() -> Starlette:
    """The uvicorn factory of the fake model (``uvicorn model_latency:fake_model --factory``)."""
    state = FakeModel()

    async def completions(request: Request) -> JSONResponse:
        body = json.loads(await request.body())
        state.calls += 1
        state.last_call = time.monotonic()
        state.first_call = state.first_call or state.last_call
        if time.monotonic() < state.outage_until:
            state.refused_503 += 1
            return JSONResponse({"error": {"message": "overloaded"}}, 503)
        if not state.admit():
            state.refused_429 += 1
            return JSONResponse({"error": {"message": "rate limit"}}, 429, headers={"Retry-After": "1"})
        state.in_flight += 1
        state.max_in_flight = max(state.max_in_flight, state.in_flight)
        try:
            await asyncio.sleep(state.latency)
        finally:
            state.in_flight -= 1
        asked = next((m["content"] for m in reversed(body["messages"]) if m["role"] == "user"), "")
        found = ORDER.search(asked)
        text = f"Your order {found.group(1)} is on its way." if found else "Which order?"
        return JSONResponse(
            {
                "id": f"chatcmpl-{state.calls}",
                "object": "chat.completion",
                "model": body.get("model"),
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text}}],
                "usage": {"prompt_tokens": 30, "completion_tokens": 10, "total_tokens": 40},
            }
        )

    async def configure(request: Request) -> JSONResponse:
        settings = await request.json()
        state.latency = float(settings.get("latency", state.latency))
        state.rpm = int(settings.get("rpm", state.rpm))
        if "outage" in settings:
            state.outage_until = time.monotonic() + float(settings["outage"])
        state.reset()
        return JSONResponse({"ok": True})

    async def stats(request: Request) -> JSONResponse:
        return JSONResponse(state.stats())

    return Starlette(
        routes=[
            Route("/v1/chat/completions", completions, methods=["POST"]),
            Route("/_bench/configure", configure, methods=["POST"]),
            Route("/_bench/stats", stats),
        ]
    )


def start_fake(workdir: Path, name: str, factory: str) -> Server:
    port = free_port()
    argv = e2e.fake_server_argv(factory, port, "--backlog", "4096")
    url = f"http://127.0.0.1:{port}"
    server = start_process(name, argv, workdir, clean_env(), url)
    probe = "/_bench/stats" if factory.startswith("model_latency") else "/_bench/replies"
    e2e.wait_ready(server, url + probe)
    return server


def start_gateway(workdir: Path, telegram: str, scenario: Scenario, model: str) -> Server:
    """end_to_end.py's gateway (pacing off), with the scenario's agent: the demo agent, the fake
    server's, or the in-process model's."""
    env: dict[str, str] = {}
    path = os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))
    if scenario.in_process:
        env = {
            "GATEWAY_AGENT": "model_agent:in_process_agent",
            "BENCH_MODEL_LATENCY": str(scenario.latency),
            "PYTHONPATH": path,
        }
    elif scenario.latency is not None:
        env = {
            "GATEWAY_MODEL": "openai:fake-model",
            "GATEWAY_OPENAI_BASE_URL": f"{model}/v1",
            "GATEWAY_OPENAI_API_KEY": API_KEY,
            "GATEWAY_AGENT": "model_agent:agent",
            "PYTHONPATH": path,
        }
    return e2e.start_gateway(workdir, telegram, extra=env | dict(scenario.settings))


# --- one scenario ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Scenario:
    name: str
    latency: float | None  # None: the scripted demo agent, no model traffic
    rpm: int = 0
    outage: float = 0.0  # seconds of 503s, from when every chat's first message was acknowledged
    settings: tuple[tuple[str, str], ...] = ()
    in_process: bool = False  # the model answers inside the gateway (the bound), not the fake server


@dataclass(frozen=True)
class Outcome:
    scenario: Scenario
    messages: int
    ack_elapsed: float
    elapsed: float
    replies: int
    missing: int
    duplicates: int
    out_of_order: int
    holding: int  # holding replies sent
    too_many_holding: int  # chats that got more than one
    inbox: dict[str, int]
    outbox: dict[str, int]
    exit_code: int
    model: dict[str, Any]
    gateway_cpu: float | None  # CPU seconds of gateway serve from its first post to its last reply
    harness_cpu: float | None  # the same of the fake servers and the load generator together

    @property
    def turns_per_second(self) -> float:
        return self.messages / self.elapsed

    @property
    def ideal(self) -> float:
        return self.messages / (self.ack_elapsed + (self.scenario.latency or 0.0))

    @property
    def ratio(self) -> float:
        return self.turns_per_second / self.ideal

    @property
    def share_429(self) -> float:
        calls = self.model.get("calls", 0)
        return self.model.get("refused_429", 0) / calls if calls else 0.0

    @property
    def passed(self) -> bool:
        return (
            self.replies == self.messages
            and self.missing == self.duplicates == self.out_of_order == self.too_many_holding == 0
            and self.exit_code == 0
            and self.inbox == {"done": self.messages}
            and self.outbox == {"sent": self.messages + self.holding}
        )


async def post_wave(gateway_url: str, first: int, count: int, chats: int, id_base: int) -> None:
    """Messages first .. first+count-1; message i goes to chat i % chats and asks for order ORDER_BASE + i."""
    headers = {"Content-Type": "application/json", "X-Telegram-Bot-Api-Secret-Token": e2e.SECRET}
    indexes = iter(range(first, first + count))

    async def lane() -> None:
        connection = e2e.Connection(gateway_url)
        try:
            for i in indexes:
                chat = CHAT_BASE + i % chats
                body = e2e.update_body(
                    id_base + i, chat, i // chats + 1, f"Where is order {e2e.ORDER_BASE + i}?"
                )
                status, _ = await connection.post(e2e.WEBHOOK_PATH, body, headers)
                if status != 200:
                    raise SystemExit(f"update {id_base + i} got {status}")
        finally:
            await connection.close()

    await asyncio.gather(*(lane() for _ in range(LANES)))


def wait_for_answers(telegram: str, gateway: Server, count: int, timeout: float) -> dict[str, Any]:
    """Poll the fake Bot API until `count` replies naming an order arrived (holding replies name none)."""
    deadline = time.monotonic() + timeout
    with httpx.Client(base_url=telegram, timeout=30) as client:
        while True:
            summary: dict[str, Any] = client.get("/_bench/wait", params={"count": 10**9, "timeout": 1}).json()
            if summary["total"] - summary["unmatched"] >= count:
                return summary
            if gateway.process.poll() is not None:
                raise SystemExit(f"gateway serve died:\n{gateway.log_tail()}")
            if time.monotonic() > deadline:
                raise SystemExit(
                    f"only {summary['total']} replies after {timeout:.0f} s:\n{gateway.log_tail()}"
                )


def run_scenario(
    args: argparse.Namespace, scenario: Scenario, fakes: tuple[Server, Server], number: int
) -> Outcome:
    telegram, model = (fake.url for fake in fakes)
    waves = 2 if scenario.outage else 1
    chats = args.messages // waves
    id_base = (number + 1) * 100_000_000
    with tempfile.TemporaryDirectory(prefix="chatflow-gateway-model-") as tmp, httpx.Client() as client:
        workdir = Path(tmp)
        client.post(f"{telegram}/_bench/reset")
        calls_fake = scenario.latency is not None and not scenario.in_process
        if calls_fake:
            client.post(
                f"{model}/_bench/configure", json={"latency": scenario.latency, "rpm": scenario.rpm}
            ).raise_for_status()
        gateway = start_gateway(workdir, telegram, scenario, model)
        try:
            cpu_before = e2e.cpu_seconds(gateway.process.pid)
            harness_before = harness_cpu(fakes)
            started = time.monotonic()
            asyncio.run(post_wave(gateway.url, 0, chats, chats, id_base))
            if scenario.outage:  # every chat's first message is in its turn: the provider goes down
                client.post(f"{model}/_bench/configure", json={"outage": scenario.outage}).raise_for_status()
                asyncio.run(post_wave(gateway.url, chats, chats, chats, id_base))
            acked = time.monotonic()
            summary = wait_for_answers(
                telegram, gateway, chats * waves, scenario.outage + max(300.0, args.messages / 5)
            )
            cpu_after = e2e.cpu_seconds(gateway.process.pid)
            harness_after = harness_cpu(fakes)
        finally:
            exit_code = gateway.stop()
        final = client.get(f"{telegram}/_bench/replies").json()
        stats = client.get(f"{model}/_bench/stats").json() if calls_fake else {}
        database = workdir / "data" / "gateway.db"
        inbox, outbox = (
            e2e.table_counts(database, "chatflow_inbox"),
            e2e.table_counts(database, "chatflow_outbox"),
        )
    missing = duplicates = out_of_order = holding = too_many_holding = 0
    for chat in range(chats):
        got = final["per_chat"].get(str(CHAT_BASE + chat), [])
        answers = [order for order in got if order != -1]  # -1: a reply naming no order (holding)
        expected = [e2e.ORDER_BASE + chat + wave * chats for wave in range(waves)]
        missing += len(set(expected) - set(answers))
        duplicates += len(answers) - len(set(answers))
        out_of_order += answers != expected and sorted(set(answers)) == expected
        holding += len(got) - len(answers)
        too_many_holding += len(got) - len(answers) > 1
    return Outcome(
        scenario=scenario,
        messages=chats * waves,
        ack_elapsed=acked - started,
        elapsed=summary["last_at"] - started,
        replies=final["total"] - holding,
        missing=missing,
        duplicates=duplicates,
        out_of_order=out_of_order,
        holding=holding,
        too_many_holding=too_many_holding,
        inbox=inbox,
        outbox=outbox,
        exit_code=exit_code,
        model=stats,
        gateway_cpu=spent(cpu_before, cpu_after),
        harness_cpu=spent(harness_before, harness_after),
    )


def spent(before: float | None, after: float | None) -> float | None:
    return None if before is None or after is None else after - before


def harness_cpu(fakes: tuple[Server, Server]) -> float | None:
    """CPU seconds so far of the fake servers and of this process (the load generator, the checks)."""
    used = [e2e.cpu_seconds(fake.process.pid) for fake in fakes]
    if None in used:
        return None
    return sum(u for u in used if u is not None) + time.process_time()


def scenarios(args: argparse.Namespace) -> dict[str, Scenario]:
    return {
        "scripted": Scenario("scripted (no model traffic)", None),
        "1s": Scenario("1 s model", 1.0),
        "1s-in-process": Scenario("1 s model in the gateway's process (the bound)", 1.0, in_process=True),
        "5s": Scenario("5 s model", 5.0),
        "rpm": Scenario(
            f"1 s model, {args.rpm:,} RPM",
            1.0,
            rpm=args.rpm,
            settings=(("GATEWAY_OPENAI_RPM", str(args.rpm)),),
        ),
        "outage": Scenario(
            f"1 s model, {args.outage:.0f} s outage",
            1.0,
            outage=args.outage,
            settings=(("GATEWAY_HOLDING_REPLY_AFTER_S", str(HOLDING_AFTER_S)),),
        ),
    }


# --- the report ------------------------------------------------------------------------------------
def table(outcomes: list[Outcome]) -> str:
    base = next((o for o in outcomes if o.scenario.latency is None), None)
    lines = [
        "| Scenario | turns/s | vs scripted turns/s | ideal | ratio to ideal | goal "
        "| max model calls in flight | 429s | 503s | holding replies | ack time (vs scripted) "
        "| gateway CPU per turn | fakes' and load's CPU per turn | checks |",
        "| --- | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for o in outcomes:
        goal, ok = goal_of(o)
        acks = f" ({o.ack_elapsed / base.ack_elapsed:.2f}x)" if base is not None else ""
        versus = f"{o.turns_per_second / base.turns_per_second:.2f}" if base is not None else "n/a"
        calls = o.model.get("calls", 0)
        model = o.scenario.latency is not None
        cpu = "n/a" if o.gateway_cpu is None else f"{o.gateway_cpu / o.messages * 1000:.2f} ms"
        harness = "n/a" if o.harness_cpu is None else f"{o.harness_cpu / o.messages * 1000:.2f} ms"
        lines.append(
            f"| {o.scenario.name} | {o.turns_per_second:,.0f} | {versus} "
            f"| {f'{o.ideal:,.0f}' if model else '-'} | {f'{o.ratio:.2f}' if model else '-'} | {goal} "
            f"| {o.model.get('max_in_flight', '-')} | {o.model.get('refused_429', 0)} of {calls:,} "
            f"| {o.model.get('refused_503', 0)} | {o.holding} | {o.ack_elapsed:.2f} s{acks} | {cpu} "
            f"| {harness} | {'PASS' if o.passed and ok else 'FAIL'} |"
        )
    return "\n".join(lines)


def goal_of(outcome: Outcome) -> tuple[str, bool]:
    if outcome.scenario.latency is None:
        return "baseline", True
    if outcome.scenario.in_process:
        return "none (what a free model call gives)", True
    if outcome.scenario.outage:
        return "0 dead, all answered in order, <= 1 holding reply a chat", True  # the checks say
    if outcome.scenario.rpm:
        return f"429s <= {GOAL_429_SHARE:.0%} of calls", outcome.share_429 <= GOAL_429_SHARE
    return f">= {GOAL_RATIO} of ideal", outcome.ratio >= GOAL_RATIO


def report(outcomes: list[Outcome], args: argparse.Namespace, seconds: float) -> str:
    when = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    detail = "\n".join(
        f"- {o.scenario.name}: inbox {o.inbox}, outbox {o.outbox}, exit {o.exit_code}, replies "
        f"{o.replies:,}, missing {o.missing}, duplicates {o.duplicates}, model {o.model}"
        for o in outcomes
    )
    return f"""# Turns at model latency

Generated by `{COMMAND}` on {when}: Python {platform.python_version()}, {platform.machine()} with \
{os.cpu_count()} CPUs, {seconds:.0f} s, code at {code_version()}. The load generator, the fake \
servers and the gateway share the machine. {args.messages:,} messages from {args.messages:,} chats \
per scenario; see the docstring of benchmarks/model_latency.py for the workload.

{table(outcomes)}

## Every scenario

{detail}
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--messages", type=int, default=2000, help="messages (and chats) per scenario")
    parser.add_argument("--rpm", type=int, default=3000, help="the RPM scenario's budget (default 3,000)")
    parser.add_argument("--outage", type=float, default=120.0, help="the outage scenario's seconds of 503s")
    parser.add_argument(
        "--scenarios",
        default="scripted,1s,1s-in-process,5s,rpm,outage",
        help="comma-separated, of: scripted, 1s, 1s-in-process, 5s, rpm, outage",
    )
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help="markdown report to write")
    args = parser.parse_args(argv)
    known = scenarios(args)
    chosen = [name.strip() for name in args.scenarios.split(",") if name.strip()]
    if unknown := [name for name in chosen if name not in known]:
        parser.error(f"unknown scenarios: {', '.join(unknown)}")
    started = time.perf_counter()
    outcomes: list[Outcome] = []
    with tempfile.TemporaryDirectory(prefix="chatflow-gateway-fakes-") as tmp:
        telegram = start_fake(Path(tmp), "fake-telegram", "end_to_end:fake_platform")
        model = start_fake(Path(tmp), "fake-model", "model_latency:fake_model")
        try:
            for number, name in enumerate(chosen):
                log(f"{name}: {args.messages:,} messages ...")
                outcome = run_scenario(args, known[name], (telegram, model), number)
                log(
                    f"  {outcome.turns_per_second:,.0f} turns/s, ratio {outcome.ratio:.2f}, "
                    f"model {outcome.model}"
                )
                outcomes.append(outcome)
        finally:
            telegram.stop()
            model.stop()
    text = report(outcomes, args, time.perf_counter() - started)
    args.output.write_text(text, encoding="utf-8")
    print(table(outcomes))
    return 0 if all(o.passed and goal_of(o)[1] for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
