"""The built-in dashboard: one page and its assets, served by the API process (``docs/dashboard.md``).

The assets are plain files shipped in the package (``api/dashboard/``): no build step and no CDN, so the
page works on a fleet's closed network. The page reads the public API with the dashboard's token, as
any client would; nothing here reads the database. Only the files named in ``ASSETS`` are served, with a
strict Content-Security-Policy (no inline script or style, no other origin) and ``no-cache``, so an
upgraded server's page is never mixed with an old script.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, HTTPException
from fastapi.responses import FileResponse, RedirectResponse

router = APIRouter(include_in_schema=False)

ASSET_DIR = Path(__file__).with_name("dashboard")
ASSETS = {
    "dashboard.js": "text/javascript",
    "timeline.js": "text/javascript",
    "dashboard.css": "text/css",
    "favicon.svg": "image/svg+xml",
}
SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self';"
        " object-src 'none'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
    ),
    "Cache-Control": "no-cache",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}


def _file(name: str, media_type: str) -> FileResponse:
    return FileResponse(ASSET_DIR / name, media_type=media_type, headers=SECURITY_HEADERS)


@router.get("/")
async def root() -> RedirectResponse:
    return RedirectResponse("/ui", status_code=307)


@router.get("/ui")
@router.get("/ui/")  # the app redirects no trailing slash: both spellings are served
async def page() -> FileResponse:
    return _file("index.html", "text/html; charset=utf-8")


@router.get("/ui/assets/{name}")
async def asset(name: str) -> FileResponse:
    media_type = ASSETS.get(name)
    if media_type is None:
        raise HTTPException(404, f"no dashboard asset {name}")
    return _file(name, media_type)
