"""Every platform the registry lists, and the test-only echo platform, through the same contract.

Signature accepted / rejected, the handshake (or 405 without one), parsing of its fixtures
(tests/payloads/<name>/), sending with retry classification against a fake API on loopback, and the
round trip of a simulated webhook through a running gateway and through `gateway simulate`. Echo is
registered by handing `ALL_PLATFORMS` to create_app / OutboxDelivery / main: no file under gateway/
names it, which is the point.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import insert, select

from gateway.app import create_app
from gateway.bootstrap import build_pacing
from gateway.cli import main
from gateway.domain.inbound import InboundMessage, MembershipChange, StatusUpdate
from gateway.domain.outbound import OutboundKind, OutboundMessage, ReplyTarget
from gateway.platforms.base import DeliveryError
from gateway.platforms.registry import PLATFORMS, by_name
from gateway.platforms.spec import PlatformSpec, is_secret
from gateway.settings import Settings
from gateway.store import inbox, migrations
from gateway.store.database import Database
from gateway.store.engine import create_engine
from gateway.store.tables import InboxRow, OutboxRow
from gateway.worker.outbound import OutboxDelivery
from tests.fakes import FakePlatform
from tests.helpers import free_port, serve_in_thread, wait_until
from tests.platform_kits import ALL_PLATFORMS, KITS, SECRET, Outcome

PAYLOADS = Path(__file__).resolve().parents[1] / "payloads"
SPECS = [pytest.param(spec, id=spec.name) for spec in ALL_PLATFORMS]
FIXTURES = [
    pytest.param(spec, path, id=f"{spec.name}/{path.stem}")
    for spec in ALL_PLATFORMS
    for path in sorted((PAYLOADS / spec.name).glob("*.json"))
]
ORDER_QUESTION = "Where is my order 1001?"  # the demo agent looks it up: its answer names TRK-55821


async def _query(url: str, query: Any) -> list[Any]:
    engine = create_engine(url)
    try:
        async with engine.connect() as conn:
            return list(await conn.execute(query))
    finally:
        await engine.dispose()


def query(url: str, statement: Any) -> list[Any]:
    return asyncio.run(_query(url, statement))


def stored_keys(url: str, *keys: str) -> set[str]:
    return {key for (key,) in query(url, select(InboxRow.dedup_key).where(InboxRow.dedup_key.in_(keys)))}


def migrate(url: str) -> None:
    async def run() -> None:
        engine = create_engine(url)
        try:
            await migrations.upgrade(engine)
        finally:
            await engine.dispose()

    asyncio.run(run())


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """One gateway serving every platform, each enabled by its kit; its base URL and database URL."""
    url = f"sqlite+aiosqlite:///{tmp_path_factory.mktemp('contract') / 'gateway.db'}"
    migrate(url)
    groups = {name: kit.webhook_settings() for name, kit in KITS.items()}
    settings = Settings(database_url=url, local_key_file="").with_groups(groups)
    with serve_in_thread(create_app(settings, platforms=ALL_PLATFORMS)) as base:
        yield base, url


# --- the spec itself ------------------------------------------------------------------------------------


def test_every_platform_has_a_kit_and_fixtures() -> None:
    assert set(by_name(ALL_PLATFORMS)) == set(KITS)  # names valid and unique; each has its kit
    assert {spec.name for spec in PLATFORMS} < set(KITS)
    for spec in ALL_PLATFORMS:
        assert sorted((PAYLOADS / spec.name).glob("*.json")), f"no fixtures in tests/payloads/{spec.name}"


@pytest.mark.parametrize("spec", SPECS)
async def test_the_spec_is_consistent(spec: PlatformSpec[Any]) -> None:
    model = spec.settings
    assert model.model_config.get("env_prefix") == f"GATEWAY_{spec.name.upper()}_"
    for field in (spec.secret_setting, spec.sending_setting):
        assert is_secret(model.model_fields[field].annotation), f"{field} is not a secret"
    # Its flat TOML keys cannot be mistaken for a global setting's.
    assert not {f"{spec.name}_{field}" for field in model.model_fields} & set(Settings.model_fields)
    assert spec.enabling_variable == f"GATEWAY_{spec.name.upper()}_{spec.secret_setting.upper()}"
    defaults = model()
    assert spec.webhook_secret(defaults) is None  # disabled until its secret is set
    assert not spec.sends_for_real(defaults)
    async with httpx.AsyncClient() as http:
        assert spec.sender(defaults, http) is None  # dry-run without its token
    assert issubclass(spec.target_type, ReplyTarget)
    assert spec.target_type.platform == spec.name
    limits = spec.pacing(defaults)(KITS[spec.name].target)
    assert limits
    assert all(key.startswith(f"{spec.name}:") and gap >= 0 for key, gap in limits)


# --- inbound: signatures, fixtures, handshakes --------------------------------------------------------


@pytest.mark.parametrize(("spec", "path"), FIXTURES)
def test_fixtures_parse_into_the_platforms_own_messages(spec: PlatformSpec[Any], path: Path) -> None:
    kit = KITS[spec.name]
    body = path.read_bytes().strip()
    adapter = spec.adapter(kit.webhook_settings(), SECRET)
    assert adapter.verify(kit.sign(body), body)
    assert not adapter.verify({}, body)
    assert not spec.adapter(kit.webhook_settings(), "another-secret").verify(kit.sign(body), body)
    # What passes `verify` passes the headers-only check made before the body is read; no headers never do.
    assert adapter.verify_headers(kit.sign(body))
    assert not adapter.verify_headers({})
    parsed = adapter.parse(json.loads(body))
    items: tuple[InboundMessage | StatusUpdate | MembershipChange, ...] = (
        *parsed.messages,
        *parsed.statuses,
        *parsed.memberships,
    )
    keys = [item.dedup_key for item in items]
    assert all(keys)
    assert len(set(keys)) == len(keys)
    assert {item.platform for item in items} <= {spec.name}
    for message in parsed.messages:
        assert message.session_id.startswith(f"{spec.name}:")
        # As the inbox row keeps it and the worker's claim reads it back.
        stored = InboundMessage.from_dict(json.loads(json.dumps(message.to_dict())))
        assert stored == message
        target = spec.reply_target(stored)
        assert isinstance(target, spec.target_type)
        assert (target.chat_id, target.reply_to) == (message.chat_id, message.message_id)
        assert spec.target_type.from_json(json.loads(json.dumps(target.to_json()))) == target


@pytest.mark.parametrize("spec", SPECS)
def test_some_fixture_is_a_message_and_a_running_gateway_acknowledges_them_all(
    served: tuple[str, str], spec: PlatformSpec[Any]
) -> None:
    base, _ = served
    kit = KITS[spec.name]
    adapter = spec.adapter(kit.webhook_settings(), SECRET)
    messages = 0
    for path in sorted((PAYLOADS / spec.name).glob("*.json")):
        body = path.read_bytes().strip()
        parsed = adapter.parse(json.loads(body))
        messages += len(parsed.messages)
        headers = {"content-type": "application/json", **kit.sign(body)}
        response = httpx.post(f"{base}/webhooks/{spec.name}", content=body, headers=headers)
        assert response.status_code == 200, (path.name, response.text)
        assert response.json()["status"] == ("ignored" if parsed.empty else "accepted"), path.name
    assert messages > 0


@pytest.mark.parametrize("spec", SPECS)
def test_a_signed_webhook_is_stored_once_and_a_forged_one_not_at_all(
    served: tuple[str, str], spec: PlatformSpec[Any]
) -> None:
    base, url = served
    group = KITS[spec.name].webhook_settings()
    route = f"{base}/webhooks/{spec.name}"
    webhook = spec.simulate("hello", spec.simulate_user, SECRET, group)
    forged = spec.simulate("hello", spec.simulate_user, "not-the-secret", group)
    unsigned = httpx.post(route, content=webhook.body, headers={"content-type": "application/json"})
    wrong = httpx.post(route, content=forged.body, headers=forged.headers)
    assert (unsigned.status_code, wrong.status_code) == (401, 401)
    assert unsigned.json()["error"] == wrong.json()["error"] == "unauthorized"
    assert stored_keys(url, webhook.dedup_key, forged.dedup_key) == set()

    first = httpx.post(route, content=webhook.body, headers=webhook.headers)
    again = httpx.post(route, content=webhook.body, headers=webhook.headers)
    assert first.json() == {"status": "accepted", "new": 1, "duplicates": 0}
    assert again.json() == {"status": "accepted", "new": 0, "duplicates": 1}
    ((platform, session_id),) = query(
        url, select(InboxRow.platform, InboxRow.session_id).where(InboxRow.dedup_key == webhook.dedup_key)
    )
    assert platform == spec.name
    assert session_id.startswith(f"{spec.name}:")


@pytest.mark.parametrize("spec", SPECS)
def test_the_handshake_is_the_specs_or_405(served: tuple[str, str], spec: PlatformSpec[Any]) -> None:
    base, url = served
    kit = KITS[spec.name]
    route = f"{base}/webhooks/{spec.name}"
    if spec.handshake is None or spec.handshake.method != "GET":
        refused = httpx.get(route)
        assert refused.status_code == 405
        assert refused.headers["allow"] == "POST"
    assert bool(kit.handshakes) == (spec.handshake is not None)  # a handshake has cases to try it
    rows = len(query(url, select(InboxRow.id)))
    for case in kit.handshakes:
        assert spec.handshake is not None
        assert case.method == spec.handshake.method
        if case.method == "GET":
            response = httpx.get(route, params=dict(case.query or {}))
        else:
            body = json.dumps(case.payload).encode()
            headers = {"content-type": "application/json", **(kit.sign(body) if case.signed else {})}
            response = httpx.post(route, params=dict(case.query or {}), content=body, headers=headers)
        assert response.status_code == case.status, (case, response.text)
        if case.body is not None:
            assert response.text == case.body
            assert response.headers["content-type"].startswith("text/plain")
    assert len(query(url, select(InboxRow.id))) == rows  # a handshake stores nothing


def test_a_disabled_platform_names_the_setting_that_enables_it(sqlite_url: str) -> None:
    migrate(sqlite_url)
    settings = Settings(database_url=sqlite_url, local_key_file="")
    with serve_in_thread(create_app(settings, platforms=ALL_PLATFORMS)) as base:
        for spec in ALL_PLATFORMS:
            response = httpx.post(f"{base}/webhooks/{spec.name}", content=b"{}")
            assert response.status_code == 404
            assert response.json()["error"] == "platform_disabled"
            assert spec.enabling_variable in response.json()["detail"]
            if spec.handshake is not None and spec.handshake.method == "GET":
                assert httpx.get(f"{base}/webhooks/{spec.name}").status_code == 404
    with serve_in_thread(create_app(settings)) as base:  # the registry alone: echo is unknown there
        unknown = httpx.post(f"{base}/webhooks/echo", content=b"{}")
    assert (unknown.status_code, unknown.json()["error"]) == (404, "not_found")


# --- outbound: sending and retry classification ------------------------------------------------------


def text_message(spec: PlatformSpec[Any], text: str = "hello") -> OutboundMessage:
    return OutboundMessage(spec.name, f"{spec.name}:1", OutboundKind.TEXT, KITS[spec.name].target, text)


@pytest.mark.parametrize("spec", SPECS)
async def test_sends_are_classified_for_retry(spec: PlatformSpec[Any]) -> None:
    kit = KITS[spec.name]
    fake = FakePlatform(kit.answers["ok"])
    with serve_in_thread(fake.app) as api:
        async with httpx.AsyncClient() as http:
            settings = kit.sending_settings(api)
            assert spec.sends_for_real(settings)
            sender = spec.sender(settings, http)
            assert sender is not None
            assert await sender.send(text_message(spec, "hello there"))  # the platform's message id
            (request,) = fake.requests
            assert "hello there" in json.dumps(request.json)
            permanent = {}
            for outcome in ("throttled", "unavailable", "refused"):
                fake.answers.append(kit.answers[outcome])
                with pytest.raises(DeliveryError) as raised:
                    await sender.send(text_message(spec))
                permanent[outcome] = raised.value.permanent
            assert permanent == {"throttled": False, "unavailable": False, "refused": True}
            fake.answers.append(kit.answers["unavailable"])
            await sender.indicate_typing(kit.target)  # best effort: never raises
    async with httpx.AsyncClient() as http:
        unreachable = spec.sender(kit.sending_settings(f"http://127.0.0.1:{free_port()}"), http)
        assert unreachable is not None
        with pytest.raises(DeliveryError) as raised:
            await unreachable.send(text_message(spec))
        assert not raised.value.permanent  # nobody listening: worth another try
        await unreachable.indicate_typing(kit.target)


@pytest.mark.parametrize("spec", SPECS)
async def test_delivery_reads_the_rows_target_with_the_spec_and_records_the_answer(
    spec: PlatformSpec[Any], sqlite_url: str
) -> None:
    kit = KITS[spec.name]
    fake = FakePlatform(kit.answers["ok"])
    engine = Database.open(sqlite_url)
    try:
        await migrations.upgrade(engine)
        with serve_in_thread(fake.app) as api:
            async with httpx.AsyncClient() as http:
                settings = Settings(database_url=sqlite_url).with_groups(
                    {spec.name: kit.sending_settings(api)}
                )
                sender = spec.sender(settings.group(spec.name, spec.settings), http)
                assert sender is not None
                delivery = OutboxDelivery(
                    engine,
                    {spec.name: sender},
                    pacing=build_pacing(settings, ALL_PLATFORMS),
                    platforms=ALL_PLATFORMS,
                )
                outcomes = []
                scripted: tuple[Outcome, ...] = ("ok", "throttled", "refused")
                for n, outcome in enumerate(scripted):
                    fake.answers.append(kit.answers[outcome])
                    # One conversation (and chat) each: a row waiting for its retry holds back only its own.
                    target = replace(kit.target, chat_id=f"{kit.target.chat_id}{n}")
                    await _add_outbox(engine, spec, f"{spec.name}:{n}", target)
                    assert await delivery.run_until_idle() == 1
                    outcomes.append(await _last_outbox(engine))
    finally:
        await engine.aclose()
    sent, throttled, refused = outcomes
    assert sent[0] == "sent"
    assert sent[1]  # the platform's message id
    assert throttled[0] == "pending"  # retried later
    assert refused[0] == "failed"
    assert len(fake.requests) == 3


async def _add_outbox(
    engine: Database, spec: PlatformSpec[Any], session_id: str, target: ReplyTarget
) -> None:
    now = datetime.now(UTC)
    async with engine.begin() as conn:
        await conn.execute(
            insert(OutboxRow).values(
                platform=spec.name,
                session_id=session_id,
                kind="text",
                text="hi",
                target_json=target.to_json(),
                status="pending",
                attempts=0,
                next_attempt_at=now,
                created_at=now,
                updated_at=now,
            )
        )


async def _last_outbox(engine: Database) -> tuple[str, str | None, str | None]:
    async with engine.connect() as conn:
        row = (
            await conn.execute(
                select(OutboxRow.status, OutboxRow.platform_message_id, OutboxRow.error_code)
                .order_by(OutboxRow.id.desc())
                .limit(1)
            )
        ).one()
    return row[0], row[1], row[2]


# --- the round trip of a simulated webhook -----------------------------------------------------------


@pytest.mark.parametrize("spec", SPECS)
def test_a_simulated_webhook_gets_its_turn_and_a_reply(
    served: tuple[str, str], spec: PlatformSpec[Any]
) -> None:
    base, url = served
    webhook = spec.simulate(ORDER_QUESTION, spec.simulate_user, SECRET, KITS[spec.name].webhook_settings())
    response = httpx.post(f"{base}/webhooks/{spec.name}", content=webhook.body, headers=webhook.headers)
    assert response.json() == {"status": "accepted", "new": 1, "duplicates": 0}

    async def done() -> inbox.Outcome | None:
        engine = Database.open(url)
        try:
            found = await inbox.outcome(engine, webhook.dedup_key)
        finally:
            await engine.aclose()
        return found if found is not None and found.status == "done" else None

    found = wait_until(lambda: asyncio.run(done()), f"the turn of the simulated {spec.name} message")
    assert "TRK-55821" in " ".join(found.replies)
    ((inbox_id, session_id),) = query(
        url, select(InboxRow.id, InboxRow.session_id).where(InboxRow.dedup_key == webhook.dedup_key)
    )

    def delivered() -> list[Any]:
        statement = select(OutboxRow.platform, OutboxRow.status, OutboxRow.target_json).where(
            OutboxRow.inbox_id == inbox_id
        )
        replies = query(url, statement)
        return replies if replies and all(status != "pending" for _, status, _ in replies) else []

    for platform, status, target in wait_until(delivered, "the reply's delivery"):
        assert (platform, status) == (spec.name, "dry_run")  # the kit gives no sending token
        decoded = spec.target_type.from_json(target)
        assert decoded.chat_id
        assert session_id.endswith(decoded.chat_id)


@pytest.mark.parametrize("spec", SPECS)
def test_gateway_simulate_takes_its_platforms_from_the_list_it_is_given(
    spec: PlatformSpec[Any],
    sqlite_url: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`gateway simulate <name>` in the local mode (no secret: the gateway writes the key, the CLI signs with
    it), for a platform the CLI only knows from the list handed to `main`."""
    migrate(sqlite_url)
    with serve_in_thread(create_app(Settings(database_url=sqlite_url), platforms=ALL_PLATFORMS)) as base:
        assert httpx.get(f"{base}/healthz").status_code == 200  # start-up over: the local key is written
        monkeypatch.setenv("GATEWAY_DATABASE_URL", sqlite_url)
        argv = ["simulate", spec.name, ORDER_QUESTION, "--url", base, "--timeout", "60"]
        code = main(argv, platforms=ALL_PLATFORMS)
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "TRK-55821" in out
