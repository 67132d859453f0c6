"""`/console`: the operator console. One HTML page, its script and its stylesheet, served as files from
this package (no front-end build step); the page reads and changes everything through the admin API.

The page itself holds no data and needs no token, but it is served only when the admin API is on
(`GATEWAY_ADMIN_TOKEN`), and answers the API's 404 otherwise. Session titles and messages come from
chat users, so the script puts them on the page as text only, and the Content-Security-Policy allows
scripts from these files alone.
"""

from __future__ import annotations

from functools import cache
from importlib.resources import files

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from gateway.web.admin import Admin
from gateway.web.errors import error_response, request_id_of

PAGE = "index.html"
ASSETS = {
    "console.js": "text/javascript; charset=utf-8",
    "console.css": "text/css; charset=utf-8",
}
CONTENT_SECURITY_POLICY = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
    "object-src 'none'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
)
SECURITY_HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
}


@cache
def _read(name: str) -> bytes:
    return files(__name__).joinpath(name).read_bytes()


def _disabled(request: Request) -> Response | None:
    """The admin API's own 404 when it is off (the console is off with it); None when it is on."""
    admin: Admin = request.state.admin
    return None if admin.enabled else admin.refuse(request)


async def page(request: Request) -> Response:
    """The console's HTML page (GET /console)."""
    if (refused := _disabled(request)) is not None:
        return refused
    headers = {**SECURITY_HEADERS, "Cache-Control": "no-store"}
    return Response(_read(PAGE), media_type="text/html; charset=utf-8", headers=headers)


async def asset(request: Request) -> Response:
    """Its script and stylesheet (GET /console/static/{name}); nothing else in the package is served."""
    if (refused := _disabled(request)) is not None:
        return refused
    name = request.path_params["name"]
    media_type = ASSETS.get(name)
    if media_type is None:
        return error_response(404, "not_found", request_id_of(request), detail=f"no console file {name!r}")
    headers = {**SECURITY_HEADERS, "Cache-Control": "no-cache"}
    return Response(_read(name), media_type=media_type, headers=headers)


def routes() -> list[Route]:
    """The console's routes, for the app's route list."""
    return [
        Route("/console", page, methods=["GET"]),
        Route("/console/static/{name}", asset, methods=["GET"]),
    ]
