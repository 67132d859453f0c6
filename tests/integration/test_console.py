"""/console over real HTTP, without a browser: when it is served, with which headers, and what the page
may load. The browser test (tests/e2e/test_console.py) shows it working."""

from __future__ import annotations

import re
from collections.abc import Iterator
from html.parser import HTMLParser
from importlib.resources import files

import httpx
import pytest

from gateway.app import create_app
from gateway.settings import Settings
from tests.helpers import serve_in_thread

TOKEN = "console-token-0123456789"
CONSOLE = files("gateway.web.console")


@pytest.fixture(scope="module")
def base() -> Iterator[str]:
    settings = Settings(database_url="sqlite+aiosqlite:///:memory:", admin_token=TOKEN)
    with serve_in_thread(create_app(settings)) as url:
        yield url


def test_the_console_is_off_without_an_admin_token() -> None:
    with serve_in_thread(create_app(Settings(database_url="sqlite+aiosqlite:///:memory:"))) as url:
        for path in ("/console", "/console/static/console.js", "/console/static/console.css"):
            response = httpx.get(f"{url}{path}")
            assert response.status_code == 404, path
            assert response.headers["content-type"] == "application/json"
            assert "GATEWAY_ADMIN_TOKEN" in response.json()["detail"]


def test_the_page_is_served_with_a_strict_content_security_policy(base: str) -> None:
    response = httpx.get(f"{base}/console")  # the page itself holds no data: no token needed
    assert response.status_code == 200
    assert response.headers["content-type"] == "text/html; charset=utf-8"
    policy = response.headers["content-security-policy"]
    assert "default-src 'self'" in policy
    assert "script-src 'self'" in policy
    assert "unsafe-inline" not in policy
    assert "unsafe-eval" not in policy
    assert "frame-ancestors 'none'" in policy
    assert response.headers["x-content-type-options"] == "nosniff"
    assert response.headers["cache-control"] == "no-store"


class _Resources(HTMLParser):
    """What a page loads, and any inline script, style or event handler it has."""

    def __init__(self) -> None:
        super().__init__()
        self.loaded: list[str] = []
        self.inline: list[str] = []
        self._in_script = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        values = dict(attrs)
        self.inline += [f"{tag} {name}" for name, _ in attrs if name.startswith("on") or name == "style"]
        if tag == "script":
            self._in_script = True
            if values.get("src"):
                self.loaded.append(values["src"] or "")
        elif tag == "style":
            self.inline.append("style element")
        elif tag == "link" and values.get("rel") == "stylesheet":
            self.loaded.append(values.get("href") or "")

    def handle_endtag(self, tag: str) -> None:
        if tag == "script":
            self._in_script = False

    def handle_data(self, data: str) -> None:
        if self._in_script and data.strip():
            self.inline.append("inline script")


def test_the_page_loads_only_its_own_files_and_has_nothing_inline(base: str) -> None:
    parser = _Resources()
    parser.feed(httpx.get(f"{base}/console").text)
    assert parser.inline == []
    assert sorted(parser.loaded) == ["/console/static/console.css", "/console/static/console.js"]
    for path, media_type in [
        ("/console/static/console.js", "text/javascript; charset=utf-8"),
        ("/console/static/console.css", "text/css; charset=utf-8"),
    ]:
        response = httpx.get(f"{base}{path}")
        assert response.status_code == 200
        assert response.headers["content-type"] == media_type
        assert response.content == CONSOLE.joinpath(path.rsplit("/", 1)[1]).read_bytes()


@pytest.mark.parametrize(
    "path",
    [
        "/console/static/index.html",
        "/console/static/__init__.py",
        "/console/static/..%2F__init__.py",
        "/console/x",
    ],
)
def test_nothing_else_of_the_package_is_served(base: str, path: str) -> None:
    response = httpx.get(f"{base}{path}")
    assert response.status_code == 404
    assert response.headers["content-type"] == "application/json"


def test_the_script_never_puts_data_on_the_page_as_html() -> None:
    """Titles and messages come from chat users; the script uses textContent, never an HTML sink."""
    script = CONSOLE.joinpath("console.js").read_text()
    sinks = re.findall(
        r"innerHTML|outerHTML|insertAdjacentHTML|document\.write|\beval\(|new Function", script
    )
    assert sinks == []
