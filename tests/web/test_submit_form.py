"""The submit form's training, checkpoint and restart settings in headless Chromium against a
real server and SQLite: the spec's defaults shown, each 422 next to its input, and a job
submitted with them set stores them."""

from __future__ import annotations

from typing import Any

import pytest

from service.core.spec.model import JobSpec

try:
    from playwright.sync_api import expect
except ImportError:  # pragma: no cover - depends on the machine
    pytest.skip(
        "needs playwright; install with: bash scripts/install-browser.sh", allow_module_level=True
    )

pytestmark = pytest.mark.slow

UNPROCESSABLE = r"status of 422"
# The inputs this test sets, and what the spec holds when the form leaves them alone.
SPEC_DEFAULTS = JobSpec(name="x", task="regression").model_dump()
SHOWN_DEFAULTS = {
    "training.stall_timeout_s": str(SPEC_DEFAULTS["training"]["stall_timeout_s"]),
    "training.nonfinite_loss": SPEC_DEFAULTS["training"]["nonfinite_loss"],
    "training.keep_checkpoints": str(SPEC_DEFAULTS["training"]["keep_checkpoints"]),
    "training.checkpoint_every_epochs": "",
    "training.amp": "true",
    "training.seed": str(SPEC_DEFAULTS["training"]["seed"]),
    "max_restarts": str(SPEC_DEFAULTS["max_restarts"]),
    "priority": str(SPEC_DEFAULTS["priority"]),
    "backend": SPEC_DEFAULTS["backend"],
    "tags": "",
}


def test_form_shows_spec_defaults_then_stores_what_was_set(
    open_page: Any, live_server: Any
) -> None:
    before = live_server.job_count()
    w = open_page("/submit")
    w.allow_console(UNPROCESSABLE)
    page = w.page
    field = page.locator
    for path, default in SHOWN_DEFAULTS.items():
        expect(field(f'[data-path="{path}"]')).to_have_value(default)

    page.fill('[name="name"]', "form-settings")
    page.fill('[data-path="training.max_steps"]', "5")
    page.fill('[data-path="training.stall_timeout_s"]', "5")
    page.click("#submit-form")
    stall_error = field('[data-error-for="training.stall_timeout_s"]')
    expect(stall_error).to_contain_text("greater than or equal to 10")
    expect(field('.field.invalid[data-field="training.stall_timeout_s"]')).to_have_count(1)
    assert live_server.job_count() == before, "a rejected spec must not be stored"

    # A rule spanning two inputs has no single input: it is listed under the form.
    page.fill('[data-path="training.stall_timeout_s"]', "120")
    page.fill('[data-path="training.checkpoint_every_steps"]', "10")
    page.fill('[data-path="training.checkpoint_every_epochs"]', "1")
    page.click("#submit-form")
    expect(field("#form-errors")).to_contain_text("not both")
    expect(stall_error).to_have_text("")

    # An error inside a list lands under the list's input, naming the item (1-based).
    page.fill('[data-path="training.checkpoint_every_steps"]', "")
    page.fill('[data-path="tags"]', "web, " + "t" * 101)
    page.click("#submit-form")
    expect(field('[data-error-for="tags"]')).to_contain_text("item 2: each tag must be 1–100")
    expect(field("#form-errors")).to_be_hidden()
    w.screenshot("submit-settings-errors-desktop")
    assert live_server.job_count() == before

    page.fill('[data-path="tags"]', " web , nightly,")
    page.select_option('[data-path="training.nonfinite_loss"]', "skip_step")
    page.select_option('[data-path="training.amp"]', "false")
    page.select_option('[data-path="backend"]', "gloo")
    page.fill('[data-path="training.keep_checkpoints"]', "5")
    page.fill('[data-path="training.seed"]', "7")
    page.fill('[data-path="max_restarts"]', "2")
    page.fill('[data-path="priority"]', "-5")
    page.click("#submit-form")
    page.wait_for_url("**/jobs/*")
    expect(page.locator("#job-name")).to_have_text("form-settings")
    job_id = int(page.url.rsplit("/", 1)[1])
    spec = live_server.job(job_id)["spec"]
    assert spec["training"] == {
        **SPEC_DEFAULTS["training"],
        "max_steps": 5,
        "stall_timeout_s": 120,
        "nonfinite_loss": "skip_step",
        "amp": False,
        "keep_checkpoints": 5,
        "checkpoint_every_epochs": 1,
        "seed": 7,
    }, spec["training"]
    assert (spec["max_restarts"], spec["priority"], spec["backend"]) == (2, -5, "gloo"), spec
    assert spec["tags"] == ["web", "nightly"], "blank items between commas are dropped"
    assert live_server.job_count() == before + 1
    assert live_server.api.post(f"/jobs/{job_id}/cancel").status_code == 202


def test_untouched_form_submits_the_spec_defaults(open_page: Any, live_server: Any) -> None:
    w = open_page("/submit", "phone")
    page = w.page
    page.fill('[name="name"]', "form-defaults")
    page.click("#submit-form")
    page.wait_for_url("**/jobs/*")
    job_id = int(page.url.rsplit("/", 1)[1])
    spec = live_server.job(job_id)["spec"]
    assert spec["training"] == SPEC_DEFAULTS["training"], spec["training"]
    assert spec["resources"]["nproc_per_node"] == 2, "the form's one deliberate default"
    for key in ("max_restarts", "priority", "backend", "tags", "strategy"):
        assert spec[key] == SPEC_DEFAULTS[key], (key, spec[key])
    assert live_server.api.post(f"/jobs/{job_id}/cancel").status_code == 202
