"""The submit form as a newcomer meets it, in headless Chromium against a real server and
SQLite: it starts on the digits task with regression's fault-injection knobs folded away, and
"clone and edit" on a job page opens it filled with that job's spec."""

from __future__ import annotations

import json
from typing import Any

import pytest

from service.core.spec.task_configs import BUILTIN_TASK_CONFIGS, is_testing_field

try:
    from playwright.sync_api import expect
except ImportError:  # pragma: no cover - depends on the machine
    pytest.skip(
        "needs playwright; install with: bash scripts/install-browser.sh", allow_module_level=True
    )

pytestmark = pytest.mark.slow

# The knobs come from the config models' marks, as the form's do.
KNOBS = {
    task: [n for n, info in schema.model_fields.items() if is_testing_field(info)]
    for task, schema in BUILTIN_TASK_CONFIGS.items()
}


def test_the_form_starts_on_digits_with_fault_knobs_folded_away(
    open_page: Any, live_server: Any
) -> None:
    assert set(KNOBS["regression"]) >= {
        "fail_rank",
        "fail_at_step",
        "hang_rank",
        "hang_at_step",
        "nan_at_step",
        "nan_rank",
        "sleep_per_step_ms",
    }
    w = open_page("/submit")
    page = w.page
    expect(page.locator("#in-task")).to_have_value("digits")
    expect(page.locator("#in-name")).to_have_value("digits-demo")
    expect(page.locator('fieldset[data-task="digits"]')).to_be_visible()
    expect(page.locator('fieldset[data-task="digits"] details')).to_have_count(0)

    page.select_option("#in-task", "regression")
    expect(page.locator("#in-name")).to_have_value("regression-demo")
    regression = page.locator('fieldset[data-task="regression"]')
    details = regression.locator("details.fault-injection")
    expect(details.locator("summary")).to_have_text("fault injection (testing)")
    assert details.evaluate("node => node.open") is False, "folded by default"
    for name in KNOBS["regression"]:
        knob = regression.locator(f'input[data-path="config.{name}"]')
        expect(knob).to_be_hidden()
        assert knob.evaluate("n => Boolean(n.closest('details.fault-injection'))"), name
    for name in ("hidden", "num_samples", "in_features"):
        real = regression.locator(f'input[data-path="config.{name}"]')
        expect(real).to_be_visible()
        assert not real.evaluate("n => Boolean(n.closest('details'))"), name
    w.screenshot("submit-regression-knobs-folded")

    # Unfolded, a knob is submitted like any other setting.
    details.locator("summary").click()
    regression.locator('input[data-path="config.fail_at_step"]').fill("3")
    page.fill("#in-name", "knob-set")
    page.click("#submit-form")
    page.wait_for_url("**/jobs/*")
    job_id = int(page.url.rsplit("/", 1)[1])
    assert live_server.job(job_id)["spec"]["config"]["fail_at_step"] == 3
    assert live_server.api.post(f"/jobs/{job_id}/cancel").status_code == 202


def test_the_untouched_form_submits_a_digits_job(open_page: Any, live_server: Any) -> None:
    w = open_page("/submit")
    w.page.click("#submit-form")
    w.page.wait_for_url("**/jobs/*")
    job = live_server.job(int(w.page.url.rsplit("/", 1)[1]))
    assert (job["name"], job["spec"]["task"]) == ("digits-demo", "digits")
    assert live_server.api.post(f"/jobs/{job['id']}/cancel").status_code == 202


def test_clone_and_edit_fills_the_form_with_the_jobs_spec(open_page: Any, live_server: Any) -> None:
    original = live_server.submit(
        "to-clone",
        tags=["exp-7", "lr-sweep"],
        training={"max_steps": 40, "lr": 0.003, "batch_size": 16, "amp": False},
        config={"hidden": 48, "fail_rank": 1, "fail_at_step": 9},
        priority=4,
    )
    w = open_page(f"/jobs/{original['id']}")
    page = w.page
    page.click("#clone-link")
    page.wait_for_url(f"**/submit?from={original['id']}")
    expect(page.locator("#clone-note")).to_contain_text(f"#{original['id']}")
    expect(page.locator("#in-task")).to_have_value("regression")
    expect(page.locator("#form-pane")).to_be_visible()
    expect(page.locator("#in-name")).to_have_value("to-clone")
    expect(page.locator('[data-path="tags"]')).to_have_value("exp-7, lr-sweep")
    expect(page.locator('[data-path="training.lr"]')).to_have_value("0.003")
    expect(page.locator('[data-path="training.max_steps"]')).to_have_value("40")
    expect(page.locator('[data-path="training.amp"]')).to_have_value("false")
    expect(page.locator('[data-path="priority"]')).to_have_value("4")
    regression = page.locator('fieldset[data-task="regression"]')
    expect(regression.locator('input[data-path="config.hidden"]')).to_have_value("48")
    # The cloned job set fault knobs: they are shown, not left folded away.
    expect(regression.locator('input[data-path="config.fail_rank"]')).to_be_visible()
    expect(regression.locator('input[data-path="config.fail_rank"]')).to_have_value("1")
    pasted = json.loads(page.locator("#spec-text").input_value())
    assert pasted == original["spec"], "the paste box holds the whole spec"
    w.screenshot("submit-cloned")

    page.fill("#in-name", "cloned")
    page.fill('[data-path="training.lr"]', "0.01")
    page.click("#submit-form")
    page.wait_for_url("**/jobs/*")
    clone = live_server.job(int(page.url.rsplit("/", 1)[1]))
    assert clone["id"] != original["id"]
    expected = {**original["spec"], "name": "cloned"}
    expected["training"] = {**original["spec"]["training"], "lr": 0.01}
    assert clone["spec"] == expected
    for job_id in (original["id"], clone["id"]):
        assert live_server.api.post(f"/jobs/{job_id}/cancel").status_code == 202


def test_a_spec_the_form_cannot_hold_is_cloned_as_text(open_page: Any, live_server: Any) -> None:
    original = live_server.submit(
        "beyond-the-form", resources={"nproc_per_node": 2, "cpus_per_task": 3}
    )
    w = open_page(f"/submit?from={original['id']}")
    page = w.page
    expect(page.locator("#paste-pane")).to_be_visible()
    expect(page.locator("#clone-note")).to_contain_text("resources.cpus_per_task")
    expect(page.locator("#spec-text")).not_to_have_value("")
    page.click("#submit-paste")
    page.wait_for_url("**/jobs/*")
    clone = live_server.job(int(page.url.rsplit("/", 1)[1]))
    assert clone["spec"] == original["spec"] and clone["id"] != original["id"]
    for job_id in (original["id"], clone["id"]):
        assert live_server.api.post(f"/jobs/{job_id}/cancel").status_code == 202
