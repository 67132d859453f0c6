"""The operator console at /console, in a real browser (Debian's chromium driven by Playwright) against
the real `gateway serve`, with conversations made by `gateway simulate` (the demo desk's tools and
handoffs) and by the admin API.

Screenshots go to pytest's temporary directory (the paths are printed; `pytest -s` shows them). With
UPDATE_SCREENSHOTS=1 the desktop one is also written to docs/console.png, the README's picture (not a
GATEWAY_ variable: those are settings, and the suite clears them).
"""

from __future__ import annotations

import os
import re
import signal
import sqlite3
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from playwright.sync_api import Browser, Page, expect, sync_playwright

from tests.e2e.test_serve import wait_ready
from tests.helpers import GATEWAY, REPO_ROOT, free_port, gateway_env, wait_until

CHROMIUM = Path("/usr/bin/chromium")
pytestmark = [
    pytest.mark.e2e,
    pytest.mark.slow,
    pytest.mark.skipif(
        not CHROMIUM.exists(),
        reason="Debian's chromium is not installed (/usr/bin/chromium); `apt-get install chromium` "
        "(.ci/run does it under CI)",
    ),
]

TOKEN = "console-test-token"
XSS = '<img src=x onerror="window.__xss=1"><b>bold</b>'
CHROMIUM_ARGS = [
    # This machine has no network but loopback: keep Chromium from trying to reach Google.
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-quic",
    "--disable-gpu",
    "--no-first-run",
]
# Read at import: the suite clears the environment of each test.
UPDATE_SCREENSHOTS = os.environ.get("UPDATE_SCREENSHOTS") == "1"


@dataclass
class Console:
    base: str
    directory: Path
    port: int

    @property
    def url(self) -> str:
        return f"{self.base}/console"

    def api(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        headers = {"Authorization": f"Bearer {TOKEN}"}
        return httpx.request(method, f"{self.base}{path}", headers=headers, timeout=30, **kwargs)

    def simulate(self, platform: str, text: str, user: str) -> str:
        result = subprocess.run(
            [GATEWAY, "simulate", platform, text, "--user", user],
            cwd=self.directory,
            env=gateway_env(GATEWAY_PORT=str(self.port)),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert result.returncode == 0, result.stderr
        return result.stdout

    def sessions(self, **params: str) -> list[dict[str, Any]]:
        response = self.api("GET", "/api/sessions", params={"limit": "200", **params})
        assert response.status_code == 200, response.text
        sessions: list[dict[str, Any]] = response.json()["sessions"]
        return sessions

    def outbox(self, status: str | None = None) -> list[dict[str, Any]]:
        params = {"limit": "500", **({"status": status} if status else {})}
        response = self.api("GET", "/api/outbox", params=params)
        assert response.status_code == 200, response.text
        rows: list[dict[str, Any]] = response.json()["items"]
        return rows

    def dead_inbox(self) -> list[dict[str, Any]]:
        response = self.api("GET", "/api/inbox", params={"status": "dead"})
        assert response.status_code == 200, response.text
        rows: list[dict[str, Any]] = response.json()["items"]
        return rows


@pytest.fixture(scope="module")
def console(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Console]:
    """`gateway serve` with the admin API on, and conversations in its database."""
    directory = tmp_path_factory.mktemp("console")
    port = free_port()
    log = directory / "serve.log"  # a file, not a pipe: nobody reads the logs while the tests run
    with log.open("w") as log_file:
        process = subprocess.Popen(
            [GATEWAY, "serve"],
            cwd=directory,
            env=gateway_env(GATEWAY_PORT=str(port), GATEWAY_ADMIN_TOKEN=TOKEN),
            stdout=log_file,
            stderr=subprocess.STDOUT,
            text=True,
        )
    try:
        base = f"http://127.0.0.1:{port}"
        wait_ready(process, base)
        made = Console(base, directory, port)
        seed(made)
        yield made
    finally:
        process.send_signal(signal.SIGTERM)
        code = process.wait(timeout=60)
        assert code == 0, log.read_text()[-4000:]


def seed(console: Console) -> None:
    """Real transcripts through the whole message path, a few sessions made by the API, one dead message,
    and two replies that were not delivered."""
    assert "TRK-55821" in console.simulate("telegram", "Where is my order 1001?", "4242")
    console.simulate("telegram", "Thanks!", "4242")
    assert "RF-1002" in console.simulate("whatsapp", "I want a refund for order 1002", "15551234567")
    console.simulate("whatsapp", "And where is order 1003?", "15551234567")
    for session_id, title in [
        ("telegram:9004", "Parcel arrived damaged"),
        ("telegram:9001", "Invoice for March"),
        ("telegram:9002/thé", "Créneau de livraison"),
        ("whatsapp:123:49170000000", "Invoice address change"),
        ("telegram:9003", "Test conversation"),
    ]:
        created = console.api("POST", "/api/sessions", json={"session_id": session_id, "title": title})
        assert created.status_code == 201, created.text
    add_dead_message(console.directory / "data" / "gateway.db")
    add_undelivered_replies(console.directory / "data" / "gateway.db")


def add_dead_message(database: Path) -> None:
    """A message whose turn gave up: a copy of a real inbox row of telegram:4242, marked dead."""
    with sqlite3.connect(database, timeout=30) as conn:
        columns = [row[1] for row in conn.execute("PRAGMA table_info(chatflow_inbox)") if row[1] != "id"]
        changed = {
            "dedup_key": "'console-test:dead-1'",
            "message_id": "'dead-1'",
            "text": "'Has order 1003 arrived?'",
            "status": "'dead'",
            "attempts": "5",
            "last_error": "'TimeoutError: the model did not answer within 60 s'",
            "lease_owner": "NULL",
            "lease_until": "NULL",
            "finished_at": "NULL",
        }
        select = ", ".join(changed.get(column, column) for column in columns)
        inserted = conn.execute(
            f"INSERT INTO chatflow_inbox ({', '.join(columns)}) SELECT {select} FROM chatflow_inbox "
            "WHERE session_id = 'telegram:4242' ORDER BY id LIMIT 1"
        )
        assert inserted.rowcount == 1


OUTAGE = "ConnectError: [Errno 111] Connection refused"
BLOCKED = "Forbidden: bot was blocked by the user"


def add_undelivered_replies(database: Path) -> None:
    """Copies of a real reply to telegram:4242: one dead after an outage, one refused (failed)."""
    with sqlite3.connect(database, timeout=30) as conn:
        columns = [row[1] for row in conn.execute("PRAGMA table_info(chatflow_outbox)") if row[1] != "id"]
        for status, attempts, code, message, retry_until in [
            ("dead", 9, "network", OUTAGE, "created_at"),
            ("failed", 1, "403", BLOCKED, "NULL"),
        ]:
            changed = {
                "status": f"'{status}'",
                "attempts": str(attempts),
                "error_code": f"'{code}'",
                "error_message": f"'{message}'",
                "retry_until": retry_until,
                "platform_message_id": "NULL",
                "lease_owner": "NULL",
                "lease_until": "NULL",
            }
            select = ", ".join(changed.get(column, column) for column in columns)
            inserted = conn.execute(
                f"INSERT INTO chatflow_outbox ({', '.join(columns)}) SELECT {select} FROM chatflow_outbox "
                "WHERE session_id = 'telegram:4242' AND kind = 'text' ORDER BY id LIMIT 1"
            )
            assert inserted.rowcount == 1


def outbox_row(console: Console, outbox_id: int) -> tuple[str, int, str | None]:
    """The row's status, attempts and error code, from the database file itself."""
    with sqlite3.connect(console.directory / "data" / "gateway.db", timeout=30) as conn:
        row = conn.execute(
            "SELECT status, attempts, error_code FROM chatflow_outbox WHERE id = ?", (outbox_id,)
        ).fetchone()
    assert row is not None
    return row[0], row[1], row[2]


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            yield launched
        finally:
            launched.close()


@pytest.fixture
def page(browser: Browser) -> Iterator[Page]:
    context = browser.new_context(viewport={"width": 1280, "height": 800}, locale="en-GB")
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    page.on("console", lambda message: errors.append(message.text) if message.type == "error" else None)
    yield page
    context.close()
    # The only console errors allowed are the 401 answers a wrong token gets.
    assert [e for e in errors if "401" not in e] == [], errors


def sign_in(page: Page, console: Console, token: str = TOKEN) -> None:
    page.goto(console.url)
    expect(page.locator("#login")).to_be_visible()
    page.fill("#token", token)
    page.click("#login-form button[type=submit]")


def signed_in(page: Page, console: Console) -> Page:
    sign_in(page, console)
    expect(page.locator("#app")).to_be_visible()
    expect(page.locator(".session-item").first).to_be_visible()
    return page


def listed_titles(page: Page) -> list[str]:
    return page.locator(".session-item .title").all_inner_texts()


def open_session(page: Page, session_id: str) -> None:
    page.locator(f'.session-item[data-session-id="{session_id}"]').click()
    expect(page.locator("#session-id")).to_have_text(session_id)


def session_of(console: Console, user: str, platform: str = "telegram") -> str:
    ids: list[str] = [s["session_id"] for s in console.sessions() if s["session_id"].endswith(f":{user}")]
    assert len(ids) == 1, ids
    assert ids[0].startswith(f"{platform}:")
    return ids[0]


# ---------- signing in ----------


def test_the_console_asks_for_the_token_once(console: Console, page: Page) -> None:
    sign_in(page, console, token="not-the-token")
    expect(page.locator("#login-error")).to_contain_text("not accepted")
    expect(page.locator("#app")).to_be_hidden()
    assert page.evaluate("sessionStorage.length") == 0  # a refused token is not kept

    page.fill("#token", TOKEN)
    page.click("#login-form button[type=submit]")
    expect(page.locator("#app")).to_be_visible()
    assert page.evaluate("Object.values(sessionStorage)") == [TOKEN]
    assert page.evaluate("localStorage.length") == 0

    page.reload()  # the same tab keeps it: no second prompt
    expect(page.locator("#app")).to_be_visible()
    expect(page.locator("#login")).to_be_hidden()
    expect(page.locator(".session-item").first).to_be_visible()


def test_a_token_the_server_refuses_is_dropped_and_asked_again(console: Console, page: Page) -> None:
    page.goto(console.url)
    page.evaluate("k => sessionStorage.setItem(k, 'stale-token')", "chatflow.adminToken")
    page.reload()
    expect(page.locator("#login")).to_be_visible()
    expect(page.locator("#login-error")).to_contain_text("not accepted")
    assert page.evaluate("sessionStorage.length") == 0

    signed_in(page, console)
    page.click("#sign-out")
    expect(page.locator("#login")).to_be_visible()
    assert page.evaluate("sessionStorage.length") == 0


# ---------- the list and the search ----------


def test_the_sidebar_lists_sessions_newest_first_with_title_platform_and_time(
    console: Console, page: Page
) -> None:
    signed_in(page, console)
    sessions = console.sessions()
    expect(page.locator(".session-item")).to_have_count(len(sessions))
    assert listed_titles(page) == [s["title"] or "Untitled" for s in sessions]
    updated = [s["updated_at"] for s in sessions]
    assert updated == sorted(updated, reverse=True)
    assert listed_titles(page)[0] == "Test conversation"  # the last one made

    item = page.locator('.session-item[data-session-id="telegram:9002/thé"]')
    expect(item.locator(".title")).to_have_text("Créneau de livraison")
    expect(item.locator(".badge")).to_have_text("telegram")
    expect(item.locator("time")).to_have_text("just now")
    whatsapp = page.locator(
        f'.session-item[data-session-id="{session_of(console, "15551234567", "whatsapp")}"]'
    )
    expect(whatsapp.locator(".badge")).to_have_text("whatsapp")
    expect(whatsapp.locator(".title")).to_have_text("I want a refund for order 1002")


def test_the_search_box_filters_titles(console: Console, page: Page) -> None:
    signed_in(page, console)
    page.fill("#search", "invoice")
    expect(page.locator(".session-item")).to_have_count(2)
    assert sorted(listed_titles(page)) == ["Invoice address change", "Invoice for March"]

    page.fill("#search", "no title has this")
    expect(page.locator(".session-item")).to_have_count(0)
    expect(page.locator("#list-empty")).to_be_visible()

    page.fill("#search", "")
    expect(page.locator(".session-item")).to_have_count(len(console.sessions()))


def test_more_sessions_than_a_page_load_on_demand(console: Console, page: Page) -> None:
    made = [f"cli:page-{i:02}" for i in range(55)]
    for session_id in made:
        response = console.api("POST", "/api/sessions", json={"session_id": session_id, "title": session_id})
        assert response.status_code == 201, response.text
    try:
        signed_in(page, console)
        expect(page.locator(".session-item")).to_have_count(50)  # the console's page size
        expect(page.locator("#load-more")).to_be_visible()
        page.click("#load-more")
        everything = console.sessions()
        expect(page.locator(".session-item")).to_have_count(len(everything))
        assert listed_titles(page) == [s["title"] or "Untitled" for s in everything]
        expect(page.locator("#load-more")).to_be_hidden()
    finally:
        for session_id in made:
            assert console.api("DELETE", f"/api/sessions/{session_id}").status_code == 204


# ---------- the transcript ----------


def test_a_transcript_shows_user_agent_and_tool_messages_and_the_handoff(
    console: Console, page: Page
) -> None:
    signed_in(page, console)
    session_id = session_of(console, "15551234567", "whatsapp")
    open_session(page, session_id)
    expect(page.locator("#session-title")).to_have_text("I want a refund for order 1002")

    messages = page.locator("#messages > li")
    roles = messages.evaluate_all("nodes => nodes.map(n => n.dataset.role || n.className)")
    assert roles == [
        "user",
        "handoff",  # Support hands the refund to Billing
        "tool-call",
        "tool-result",
        "agent",
        "user",
        "handoff",  # Billing hands the order question back
        "tool-call",
        "tool-result",
        "agent",
    ]
    expect(messages.nth(0)).to_contain_text("I want a refund for order 1002")
    expect(messages.nth(0).locator(".who")).to_contain_text("User")
    expect(messages.nth(1)).to_have_text("→ handed off to Billing")
    expect(messages.nth(2).locator(".tool-name")).to_have_text("request_refund")
    expect(messages.nth(2).locator("pre")).to_contain_text('"order_id": "1002"')
    expect(messages.nth(3).locator(".tool-name")).to_have_text("request_refund")
    expect(messages.nth(3).locator("pre")).to_contain_text('"refund_id": "RF-1002"')
    expect(messages.nth(4).locator(".who")).to_contain_text("Billing")
    expect(messages.nth(4).locator(".bubble")).to_contain_text("Refund RF-1002 is open")
    expect(messages.nth(6)).to_have_text("→ handed off to Support")
    expect(messages.nth(9).locator(".who")).to_contain_text("Support")
    expect(messages.nth(9).locator(".bubble")).to_contain_text("Order 1003 is delivered")
    # What the user said, what an agent said and what tools did look different.
    background = "n => getComputedStyle(n).backgroundColor"
    user, agent = (messages.nth(i).locator(".bubble").evaluate(background) for i in (0, 4))
    assert user != agent
    for i in (2, 3):
        assert messages.nth(i).evaluate("n => getComputedStyle(n).borderTopStyle") == "dashed"
        assert (
            messages.nth(i)
            .locator("pre")
            .evaluate("n => getComputedStyle(n).fontFamily")
            .startswith("ui-monospace")
        )


def test_titles_and_messages_are_shown_as_text_never_as_html(console: Console, page: Page) -> None:
    """Titles and messages come from chat users: markup in them is shown, never run or rendered."""
    console.simulate("telegram", f"{XSS} is order 1004 cancelled?", "777")
    created = console.api("POST", "/api/sessions", json={"session_id": "telegram:778", "title": XSS})
    assert created.status_code == 201, created.text
    try:
        signed_in(page, console)
        item = page.locator('.session-item[data-session-id="telegram:778"]')
        expect(item.locator(".title")).to_have_text(XSS)
        open_session(page, "telegram:777")  # titled by its first message
        expect(page.locator("#session-title")).to_contain_text('<img src=x onerror="window.')
        expect(page.locator("#messages .msg.user .bubble")).to_have_text(f"{XSS} is order 1004 cancelled?")
        expect(page.locator("#messages .msg.agent .bubble")).to_contain_text("Order 1004 is cancelled")
        assert page.locator("img").count() == 0
        assert page.locator("#app b").count() == 0
        assert page.evaluate("window.__xss") is None
    finally:  # out of the other tests' way (and of the screenshot)
        for session_id in ("telegram:777", "telegram:778"):
            assert console.api("DELETE", f"/api/sessions/{session_id}").status_code == 204


def test_a_session_id_with_slash_and_unicode_opens(console: Console, page: Page) -> None:
    signed_in(page, console)
    open_session(page, "telegram:9002/thé")
    expect(page.locator("#session-title")).to_have_text("Créneau de livraison")
    expect(page.locator("#messages")).to_contain_text("No messages yet.")


# ---------- rename and delete ----------


def test_double_clicking_the_title_renames_the_session(console: Console, page: Page) -> None:
    signed_in(page, console)
    open_session(page, "telegram:9004")
    title = page.locator("#session-title")

    title.dblclick()  # Escape leaves it as it was
    page.fill("#title-input", "Not this")
    page.press("#title-input", "Escape")
    expect(title).to_have_text("Parcel arrived damaged")

    title.dblclick()  # an empty title is refused
    page.fill("#title-input", "   ")
    page.press("#title-input", "Enter")
    expect(page.locator("#title-error")).to_be_visible()
    expect(page.locator("#title-input")).to_be_visible()
    page.press("#title-input", "Escape")

    title.dblclick()
    expect(page.locator("#title-input")).to_be_focused()
    page.fill("#title-input", "Damaged parcel: replacement sent")
    page.press("#title-input", "Enter")
    expect(title).to_have_text("Damaged parcel: replacement sent")
    item = page.locator('.session-item[data-session-id="telegram:9004"] .title')
    expect(item).to_have_text("Damaged parcel: replacement sent")
    # A rename moves the session's updated_at forward: it goes to the top, as on the server.
    expect(page.locator(".session-item .title").first).to_have_text("Damaged parcel: replacement sent")
    assert (
        console.api("GET", "/api/sessions/telegram:9004").json()["title"]
        == "Damaged parcel: replacement sent"
    )

    page.reload()  # it is stored, not only shown
    expect(title).to_have_text("Damaged parcel: replacement sent")


def test_delete_asks_for_confirmation_first(console: Console, page: Page) -> None:
    signed_in(page, console)
    open_session(page, "telegram:9003")
    dialog = page.locator("#confirm-delete")

    page.click("#delete")
    expect(dialog).to_be_visible()
    expect(dialog).to_contain_text("Test conversation")
    page.click("#confirm-cancel")
    expect(dialog).to_be_hidden()
    assert console.api("GET", "/api/sessions/telegram:9003").status_code == 200
    expect(page.locator('.session-item[data-session-id="telegram:9003"]')).to_have_count(1)

    page.click("#delete")
    page.click("#confirm-ok")
    expect(page.locator('.session-item[data-session-id="telegram:9003"]')).to_have_count(0)
    expect(page.locator("#transcript-empty")).to_be_visible()
    assert console.api("GET", "/api/sessions/telegram:9003").status_code == 404


# ---------- stuck messages ----------


def test_a_dead_message_is_listed_and_retried(console: Console, page: Page) -> None:
    signed_in(page, console)
    expect(page.locator("#stuck-count")).to_have_text("1")
    page.click("#tab-stuck")
    row = page.locator(".inbox-item")
    expect(row).to_have_count(1)
    expect(row.locator(".text")).to_have_text("Has order 1003 arrived?")
    expect(row.locator(".last-error")).to_contain_text("TimeoutError")
    expect(row).to_contain_text("telegram:4242")
    expect(row).to_contain_text("5 attempts")

    row.locator("button.retry").click()
    expect(page.locator(".inbox-item")).to_have_count(0)
    expect(page.locator("#inbox-empty")).to_be_visible()
    expect(page.locator("#stuck-count")).to_be_hidden()
    assert console.dead_inbox() == []

    def answered() -> bool:
        messages = console.api("GET", "/api/sessions/telegram:4242").json()["messages"]
        return any("Order 1003 is delivered" in (m["content"] or "") for m in messages)

    wait_until(answered, "the retried message's turn")  # the worker took it again


# ---------- undelivered replies ----------


def test_an_undelivered_reply_is_listed_and_sent_again(
    console: Console, page: Page, screenshots: Path
) -> None:
    (dead,) = console.outbox("dead")
    (failed,) = console.outbox("failed")
    signed_in(page, console)
    expect(page.locator("#outbox-count")).to_have_text("1")  # dead ones only: failed ones are routine
    page.click("#tab-outbox")
    expect(page.locator("#outbox-view")).to_be_visible()
    expect(page.locator("#sessions-view")).to_be_hidden()
    row = page.locator(f'.outbox-item[data-outbox-id="{dead["id"]}"]')
    expect(page.locator(".outbox-item")).to_have_count(1)
    expect(row.locator(".badge.telegram")).to_have_text("telegram")
    expect(row.locator("a")).to_have_text("telegram:4242")
    expect(row.locator(".attempts")).to_have_text("9 attempts")
    expect(row.locator(".last-error")).to_have_text(f"network: {OUTAGE}")
    expect(row.locator("time")).to_have_attribute("datetime", dead["created_at"])
    shot(page, screenshots, "console-outbox.png")

    page.click("#outbox-view .seg[data-status=failed]")
    refused = page.locator(f'.outbox-item[data-outbox-id="{failed["id"]}"]')
    expect(page.locator(".outbox-item")).to_have_count(1)
    expect(refused.locator(".last-error")).to_have_text(f"403: {BLOCKED}")
    expect(refused.locator("button.retry")).to_be_visible()

    page.click("#outbox-view .seg[data-status=dead]")
    row.locator("button.retry").click()
    expect(page.locator("#toast")).to_have_text(f"Reply #{dead['id']} is queued again.")
    expect(row.locator(".status")).to_have_text("pending")  # the row updates in place
    expect(row.locator("button.retry")).to_have_count(0)
    expect(row.locator(".last-error")).to_have_count(0)
    expect(page.locator("#outbox-count")).to_be_hidden()
    assert console.outbox("dead") == []
    status, attempts, code = outbox_row(console, dead["id"])
    assert (status in {"pending", "dry_run"}, attempts, code) == (True, 0, None)
    # Delivery took it at once (dry-run here: no bot token), and the failed one stays failed.
    wait_until(lambda: outbox_row(console, dead["id"])[0] == "dry_run", "the retried reply's delivery")
    assert outbox_row(console, failed["id"]) == ("failed", 1, "403")

    row.locator("a").click()  # the session's transcript
    expect(page.locator("#sessions-view")).to_be_visible()
    expect(page.locator("#session-id")).to_have_text("telegram:4242")


# ---------- phone width, and the screenshots ----------


def test_at_phone_width_the_list_and_the_transcript_fit(
    console: Console, browser: Browser, screenshots: Path
) -> None:
    context = browser.new_context(viewport={"width": 390, "height": 844}, is_mobile=True, has_touch=True)
    page = context.new_page()
    try:
        signed_in(page, console)
        assert page.evaluate("document.documentElement.scrollWidth") <= 390
        sidebar = page.locator(".sidebar").bounding_box()
        assert sidebar is not None
        assert sidebar["width"] == 390
        expect(page.locator("#transcript")).to_be_hidden()

        open_session(page, session_of(console, "15551234567", "whatsapp"))
        expect(page.locator(".sidebar")).to_be_hidden()
        transcript = page.locator("#transcript").bounding_box()
        assert transcript is not None
        assert transcript["width"] == 390
        assert page.evaluate("document.documentElement.scrollWidth") <= 390
        shot(page, screenshots, "console-phone.png")

        page.click("#back")
        expect(page.locator(".sidebar")).to_be_visible()
        page.click("#tab-stuck")
        expect(page.locator("#stuck-view")).to_be_visible()
        assert page.evaluate("document.documentElement.scrollWidth") <= 390
        page.click("#tab-outbox")
        expect(page.locator("#outbox-view")).to_be_visible()
        page.click("#outbox-view .seg[data-status=failed]")  # never retried by the tests
        expect(page.locator(".outbox-item .last-error").first).to_be_visible()
        assert page.evaluate("document.documentElement.scrollWidth") <= 390
        shot(page, screenshots, "console-phone-outbox.png")
    finally:
        context.close()


@pytest.fixture(scope="module")
def screenshots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("screenshots")


def shot(page: Page, directory: Path, name: str) -> Path:
    path = directory / name
    page.screenshot(path=path)
    print(f"screenshot: {path}")
    return path


def test_screenshot(console: Console, page: Page, screenshots: Path) -> None:
    """A picture of the console for humans: the refund conversation with its handoffs."""
    page.set_viewport_size({"width": 1280, "height": 960})
    signed_in(page, console)
    open_session(page, session_of(console, "15551234567", "whatsapp"))
    expect(page.locator("#messages .handoff").first).to_be_visible()
    path = shot(page, screenshots, "console.png")
    assert path.stat().st_size > 10_000
    if UPDATE_SCREENSHOTS:
        (REPO_ROOT / "docs").mkdir(exist_ok=True)
        page.screenshot(path=REPO_ROOT / "docs" / "console.png")


def test_a_session_and_the_usage_view_show_model_usage(console: Console, page: Page) -> None:
    """The seeded turns ran on the scripted demo model: calls and time are counted, tokens are 0."""
    signed_in(page, console)
    open_session(page, session_of(console, "15551234567", "whatsapp"))
    expect(page.locator("#session-usage")).to_have_text(
        re.compile(r"^0 tokens in · 0 out · [1-9]\d* model calls$")
    )

    page.click("#tab-usage")
    rows = page.locator("#usage-rows > tr")
    expect(rows).to_have_count(1)  # today, the scripted model
    cells = rows.first.locator("td").all_text_contents()
    assert cells[1] == "scripted"
    assert int(cells[2]) >= 4  # the four simulated turns, and any a retry made
    assert cells[8] == "n/a"  # no price for it
