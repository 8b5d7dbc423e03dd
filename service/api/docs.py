"""The interactive API docs (/docs, Swagger UI) served from files installed with ddpq.

FastAPI's own /docs page loads Swagger UI's script and stylesheet from a CDN, so it is blank
on a machine without internet access. This router serves the same page with the assets of
the ``swagger-ui-bundle-v2`` package (a vendored copy of swagger-ui-dist) under
/docs/assets/. Like FastAPI's page it needs no token: the OpenAPI document is public, and
Swagger UI's "Authorize" button takes the token for the calls made from the page.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.openapi.docs import get_swagger_ui_html, get_swagger_ui_oauth2_redirect_html
from fastapi.responses import FileResponse, HTMLResponse
from swagger_ui_bundle import swagger_ui_path

from service.core.errors import NotFoundError

DOCS_URL = "/docs"
ASSETS_URL = f"{DOCS_URL}/assets"
OAUTH2_REDIRECT_URL = f"{DOCS_URL}/oauth2-redirect"
SWAGGER_UI_DIR = Path(str(swagger_ui_path))

# Only these files are served: a fixed table, so no request path reaches the file system.
ASSET_MEDIA_TYPES: dict[str, str] = {
    "swagger-ui-bundle.js": "text/javascript",
    "swagger-ui.css": "text/css",
    "favicon-32x32.png": "image/png",
}

router = APIRouter(include_in_schema=False)


@router.get(DOCS_URL, response_class=HTMLResponse)
def swagger_ui(request: Request) -> HTMLResponse:
    """Swagger UI for the app's OpenAPI document, with every asset from this server."""
    app = request.app
    root = request.scope.get("root_path", "")
    return get_swagger_ui_html(
        openapi_url=f"{root}{app.openapi_url}",
        title=f"{app.title} - Swagger UI",
        oauth2_redirect_url=f"{root}{OAUTH2_REDIRECT_URL}",
        init_oauth=app.swagger_ui_init_oauth,
        swagger_js_url=f"{root}{ASSETS_URL}/swagger-ui-bundle.js",
        swagger_css_url=f"{root}{ASSETS_URL}/swagger-ui.css",
        swagger_favicon_url=f"{root}{ASSETS_URL}/favicon-32x32.png",
        swagger_ui_parameters=app.swagger_ui_parameters,
    )


@router.get(OAUTH2_REDIRECT_URL, response_class=HTMLResponse)
def swagger_ui_oauth2_redirect() -> HTMLResponse:
    """The page Swagger UI's OAuth2 flow returns to (FastAPI's own /docs serves it too)."""
    return get_swagger_ui_oauth2_redirect_html()


@router.get(f"{ASSETS_URL}/{{name}}")
def swagger_ui_asset(name: str) -> FileResponse:
    """One of Swagger UI's files (script, stylesheet, icon).

    Raises:
        NotFoundError: ``name`` is not one of ``ASSET_MEDIA_TYPES`` (404).
    """
    media_type = ASSET_MEDIA_TYPES.get(name)
    if media_type is None:
        raise NotFoundError(f"no docs asset {name!r}")
    return FileResponse(SWAGGER_UI_DIR / name, media_type=media_type)
