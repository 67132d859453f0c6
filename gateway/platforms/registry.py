"""The platforms the gateway knows: one spec each (see spec.py). Adding a platform is one line here.

Everything generic takes the list of specs as an argument defaulting to `PLATFORMS`, so a test (or a
deployment's own entry point) can run the gateway with another list without editing this file.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from gateway.platforms.spec import PlatformSettings, PlatformSpec
from gateway.platforms.telegram.spec import TELEGRAM
from gateway.platforms.whatsapp.spec import WHATSAPP

PLATFORMS: tuple[PlatformSpec[Any], ...] = (WHATSAPP, TELEGRAM)

# A route segment, a session id prefix, a settings prefix (GATEWAY_<NAME>_) and a 32-character column.
_NAME = re.compile(r"[a-z][a-z0-9]{0,31}")


def by_name(platforms: Iterable[PlatformSpec[Any]] = PLATFORMS) -> dict[str, PlatformSpec[Any]]:
    """The specs by name, in order; ValueError for a name used twice or one no route or setting can hold."""
    specs: dict[str, PlatformSpec[Any]] = {}
    for spec in platforms:
        if not _NAME.fullmatch(spec.name):
            raise ValueError(f"platform name {spec.name!r}: use 1-32 of a-z and 0-9, starting with a letter")
        if spec.name in specs:
            raise ValueError(f"two platforms are named {spec.name!r}")
        specs[spec.name] = spec
    return specs


def settings_groups(platforms: Iterable[PlatformSpec[Any]] = PLATFORMS) -> dict[str, type[PlatformSettings]]:
    """Each platform's settings group, by name: what `load_settings` reads besides the global settings."""
    return {name: spec.settings for name, spec in by_name(platforms).items()}
