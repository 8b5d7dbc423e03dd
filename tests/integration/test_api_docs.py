"""/docs (Swagger UI) works offline: the page names only this server's URLs, and each answers."""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from service.app import create_app
from service.core.config import Settings
from service.store.db import Database

# src="…", href="…" and Swagger UI's `url: '/openapi.json'` in the page's script.
REFERENCE = re.compile(r"""(?:src|href)\s*=\s*["']([^"']+)["']|\burl:\s*["']([^"']+)["']""")


def referenced_urls(html: str) -> list[str]:
    """Every asset and document URL the docs page loads."""
    return [a or b for a, b in REFERENCE.findall(html)]


@pytest.fixture(params=["off", "on"])
def api(request: pytest.FixtureRequest, settings: Settings, db: Database) -> Iterator[TestClient]:
    """The app with auth off and on: /docs needs no token either way (as FastAPI's own)."""
    with TestClient(create_app(settings.model_copy(update={"auth": request.param}))) as client:
        yield client


def test_docs_page_loads_only_local_assets(api: TestClient) -> None:
    page = api.get("/docs")
    assert page.status_code == 200, page.text
    assert page.headers["content-type"].startswith("text/html")
    hosts = re.findall(r"https?://[^\s\"'<>]+", page.text)
    assert hosts == [], f"/docs must load nothing from another host (offline), found {hosts}"
    urls = referenced_urls(page.text)
    assert "/openapi.json" in urls, urls
    assert any(u.endswith("swagger-ui-bundle.js") for u in urls), urls
    assert any(u.endswith("swagger-ui.css") for u in urls), urls
    for url in urls:
        assert url.startswith("/"), f"{url}: expected a path on this server"
        answer = api.get(url)
        assert answer.status_code == 200, f"{url} answered {answer.status_code}, expected 200"
        assert answer.content, f"{url} is empty"
    script = api.get(next(u for u in urls if u.endswith(".js")))
    assert "SwaggerUIBundle" in script.text, "the script is Swagger UI's bundle"
    assert api.get("/docs/oauth2-redirect").status_code == 200


def test_docs_assets_are_a_fixed_set(api: TestClient) -> None:
    for name in ("index.html", "..%2F..%2F__init__.py", "swagger-ui.js.map"):
        answer = api.get(f"/docs/assets/{name}")
        assert answer.status_code == 404, (name, answer.status_code)
    assert "/docs" not in api.get("/openapi.json").json()["paths"], "docs stay out of the schema"


def test_the_schema_says_which_epoch_is_0_based_and_which_1_based(api: TestClient) -> None:
    schemas = api.get("/openapi.json").json()["components"]["schemas"]
    for model in ("ProgressOut", "CheckpointOut"):
        props = schemas[model]["properties"]
        assert "0-based" in props["epoch"]["description"], (model, props["epoch"])
        assert "epoch + 1" in props["epoch_number"]["description"], (model, props)
    assert "0-based" in schemas["MetricPointOut"]["properties"]["epoch"]["description"]
