"""Real payloads with one part replaced by arbitrary JSON, posted signed to a running gateway: every one
is a valid JSON object, so every one gets 200 (accepted or ignored), never a 4xx the platform would
retry, nor a 5xx. This covers what the adapters' own property tests cannot: storing what they parsed."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.app import create_app
from gateway.settings import Settings
from tests.helpers import replace_one_part, serve_in_thread
from tests.platform_kits import ALL_PLATFORMS, KITS

PAYLOADS = Path(__file__).resolve().parents[1] / "payloads"
FIXTURES = sorted((p.parent.name, p) for p in PAYLOADS.glob("*/*.json"))

scalars = (
    st.none()
    | st.booleans()
    | st.integers()  # beyond 64 bits too
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8)
    | st.text(st.characters(categories=["Cs"]), min_size=1, max_size=2)  # lone surrogates
)
json_values = st.recursive(
    scalars,
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=6), children, max_size=3)
    ),
    max_leaves=8,
)


def headers(platform: str, body: bytes) -> dict[str, str]:
    return KITS[platform].sign(body)


def test_mutated_real_payloads_are_always_acknowledged(migrated_url: str) -> None:
    """Every platform's fixtures (the test-only echo platform's too), each platform enabled by its kit."""
    groups = {name: kit.webhook_settings() for name, kit in KITS.items()}
    config = Settings(database_url=migrated_url).with_groups(groups)
    app = create_app(config, platforms=ALL_PLATFORMS)
    with serve_in_thread(app) as base, httpx.Client(base_url=base, timeout=30) as client:

        @settings(max_examples=150, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        @given(data=st.data())
        def post_a_mutated_payload(data: st.DataObject) -> None:
            platform, path = data.draw(st.sampled_from(FIXTURES))
            payload = json.loads(path.read_bytes())
            where = replace_one_part(data, payload, json_values)
            body = json.dumps(payload).encode()  # escapes non-ASCII, lone surrogates included
            response = client.post(f"/webhooks/{platform}", content=body, headers=headers(platform, body))
            assert response.status_code == 200, (path.name, where, response.text)
            assert response.json()["status"] in {"accepted", "ignored"}

        post_a_mutated_payload()
