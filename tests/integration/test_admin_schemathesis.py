"""Schemathesis against the admin API over real loopback HTTP, from the API's own OpenAPI document.

Every operation gets generated requests, valid and invalid, bounded and derandomized so a run is
quick and repeatable; every answer must be a documented status with a body of the documented
schema and content type, and never a 5xx. On SQLite and on PostgreSQL, which refuses more (NUL
characters, over-long ids, integers out of range), so a check missing there would show as a 500.

The schema is loaded from `gateway.web.openapi.document()` when this module is imported (schemathesis's
fixture-based loader does not work with this pytest), and a test holds the served document to it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.specs.openapi.checks import positive_data_acceptance

from gateway.app import create_app
from gateway.web.openapi import document
from tests.helpers import serve_in_thread
from tests.integration.test_admin_api import AUTH, add_inbox_rows, converse
from tests.integration.test_admin_api import settings as gateway_settings
from tests.integration.test_admin_outbox import add_outbox_rows

pytestmark = pytest.mark.slow

CONFIG = {
    "generation": {
        "max-examples": 30,
        "deterministic": True,  # the same requests on every run
        "database": "none",  # and no examples replayed from earlier runs
    },
    "phases": {"stateful": {"enabled": False}},  # each exchange is checked on its own
}
schema = schemathesis.openapi.from_dict(document(), config=schemathesis.Config.from_dict(CONFIG))


@pytest.fixture
def base(migrated_url: str) -> Iterator[str]:
    """The app on a loopback port, with a conversation, inbox and outbox rows for the requests to find."""
    asyncio.run(converse(migrated_url, "telegram:42", "Where is order 1001?", "Thanks"))
    add_inbox_rows(migrated_url, ["dead", "done", "dead"])
    add_outbox_rows(migrated_url, ["dead", "sent", "failed", "dead"])
    with serve_in_thread(create_app(gateway_settings(migrated_url))) as served:
        yield served


def test_the_served_document_is_the_one_tested(base: str) -> None:
    served = httpx.get(f"{base}/api/openapi.json", headers=AUTH)
    assert served.status_code == 200
    assert served.json() == document()


@schema.parametrize()
@settings(suppress_health_check=[HealthCheck.function_scoped_fixture])  # one server serves every example
def test_the_admin_api_keeps_to_its_openapi_document(case: schemathesis.Case[Any], base: str) -> None:
    excluded: list[schemathesis.CheckFunction] = []
    if case.path == "/api/sessions" and case.method == "GET" and "cursor" in (case.query or {}):
        # A cursor is opaque: any string fits its schema, but only one this API made is accepted (422).
        excluded.append(positive_data_acceptance)
    case.call_and_validate(base_url=base, headers=AUTH, excluded_checks=excluded)
