"""The dashboard with auth on, in headless Chromium: it asks for a token, keeps it in session
storage only (no localStorage, no cookie), sends it on every API call, and forgets it."""

from __future__ import annotations

from typing import Any

import pytest

from service.core.wire import API_PREFIX
from service.store.auth.tokens import create_token
from tests.web.auth_pages import UNAUTHORIZED, live_server
from tests.web.conftest import LiveServer, OpenPage

try:
    from playwright.sync_api import expect
except ImportError:  # pragma: no cover - depends on the machine
    pytest.skip(
        "needs playwright; install with: bash scripts/install-browser.sh", allow_module_level=True
    )


__all__ = ["live_server"]  # the module's server fixture (auth on)


@pytest.fixture(scope="module")
def tokens(live_server: LiveServer) -> dict[str, str]:
    """alice's and bob's tokens, and one job each."""
    found = {}
    for owner in ("alice", "bob"):
        with live_server.db.session() as s:
            found[owner] = create_token(s, owner=owner)[1]
        r = live_server.api.post(
            "/jobs",
            json={"name": f"{owner}-job", "task": "regression"},
            headers={"Authorization": f"Bearer {found[owner]}"},
        )
        assert r.status_code == 201, r.text
    return found


def storage(page: Any) -> dict[str, Any]:
    return dict(
        page.evaluate(
            """() => ({session: sessionStorage.getItem("ddpq.token"),
                       local: Object.keys(localStorage), cookie: document.cookie})"""
        )
    )


def test_asks_for_the_token_keeps_it_in_session_storage_and_sends_it(
    open_page: OpenPage, tokens: dict[str, str]
) -> None:
    w = open_page("/")
    w.allow_console(UNAUTHORIZED)  # Chromium logs the first, refused API call
    page = w.page
    expect(page.locator("#auth-panel")).to_be_visible()
    expect(page.locator("#jobs-body tr")).to_have_count(0)
    expect(page.locator("#banner")).to_be_hidden()  # the form says it; no error banner too
    w.screenshot("auth-token-form")

    api_calls: list[dict[str, str]] = []
    page.on(
        "request",
        lambda req: api_calls.append(req.headers) if API_PREFIX + "/" in req.url else None,
    )
    page.fill("#auth-token", tokens["alice"])
    page.click("#auth-submit")
    expect(page.locator("#jobs-body tr")).to_have_count(1)
    expect(page.locator("#jobs-body")).to_contain_text("alice-job")
    expect(page.locator("#jobs-body")).not_to_contain_text("bob-job")
    expect(page.locator("#auth-panel")).to_be_hidden()

    assert storage(page) == {"session": tokens["alice"], "local": [], "cookie": ""}
    assert page.context.cookies() == [], "no cookie that another site could ride"
    assert api_calls and all(
        h.get("authorization") == f"Bearer {tokens['alice']}" for h in api_calls
    ), api_calls

    page.goto(w.base_url + "/workers")  # same tab: the token is still there
    expect(page.locator("#auth-panel")).to_be_hidden()
    page.click("#auth-forget")
    expect(page.locator("#auth-panel")).to_be_visible()
    assert storage(page)["session"] is None
    expect(page.locator("#auth-forget")).to_be_hidden()


def test_a_refused_token_is_dropped_and_the_form_says_why(
    open_page: OpenPage, live_server: LiveServer, tokens: dict[str, str]
) -> None:
    w = open_page("/")
    w.allow_console(UNAUTHORIZED)
    page = w.page
    page.fill("#auth-token", "ddpq_not-a-token")
    page.click("#auth-submit")
    expect(page.locator("#auth-reason")).to_contain_text("refused the stored API token")
    assert storage(page)["session"] is None, "a refused token is not kept"
    page.fill("#auth-token", tokens["bob"])
    page.click("#auth-submit")
    expect(page.locator("#jobs-body")).to_contain_text("bob-job")
    expect(page.locator("#jobs-body tr")).to_have_count(1)

    w.allow_console(r"status of 404")
    alice_job = live_server.api.get(
        "/jobs", headers={"Authorization": f"Bearer {tokens['alice']}"}
    ).json()["jobs"][0]["id"]
    page.goto(f"{w.base_url}/jobs/{alice_job}")  # the shell loads; the API says 404 to bob
    expect(page.locator("#not-found")).to_be_visible()
    expect(page.locator("#facts")).to_be_hidden()  # no empty job layout under the banner
