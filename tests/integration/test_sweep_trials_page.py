"""The trials table paged and sorted on the server, its delta poll (``changed_since``) and the
curves of picked trials, over the real app on SQLite and PostgreSQL: sort by any column (the
objective's value, an override's) either way with missing values last, offset paging, only
the trials whose job changed (a row committed late still comes), 422 naming a bad
parameter, and who may call it."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import update

from service.app import create_app
from service.client import ApiError, DdpqClient
from service.core.config import Settings
from service.core.states import JobState
from service.core.sweeps.trials import CHANGED_OVERLAP_S
from service.core.wire import API_PREFIX
from service.store.attempts.tokens import mint_attempt_token
from service.store.auth.tokens import create_token
from service.store.db import Database
from service.store.jobs import crud as jobs
from service.store.metrics.points import MetricPoint, record_metrics
from service.store.models import Job
from tests.live import serve_app

API = API_PREFIX
LRS = [0.001, 0.01, 0.1]
SWEEP: dict[str, Any] = {
    "name": "paged",
    "base": {"name": "b", "task": "regression", "training": {"max_steps": 5}},
    "axes": {"training.lr": {"grid": LRS}, "config.hidden": {"grid": [8, 16]}},
    "objective": {"metric": "loss", "mode": "min", "at": "last"},
}
# Final loss by trial position; positions 4 and 5 report nothing.
FINALS = {0: 0.5, 1: 0.2, 2: 0.9, 3: 0.2}


def start(db: Database, job_id: int) -> None:
    """Move a queued trial to running (attempt 1), as a worker would."""
    with db.session() as s:
        jobs.apply_transition(s, jobs.Transition(job_id, JobState.QUEUED, JobState.STARTING))
        jobs.apply_transition(s, jobs.Transition(job_id, JobState.STARTING, JobState.RUNNING))


def report(db: Database, job_id: int, value: float, step: int = 1) -> None:
    """Record the loss ``value`` at ``step`` (attempt 1), with progress."""
    with db.session() as s:
        record_metrics(
            s,
            job_id,
            1,
            [MetricPoint(name="loss", step=step, value=value)],
            progress={"step": step},
        )


def stamp(db: Database, job_ids: list[int], at: datetime) -> None:
    """Set the jobs' ``updated_at`` to ``at`` (as if they last changed then)."""
    with db.session() as s:
        s.execute(update(Job).where(Job.id.in_(job_ids)).values(updated_at=at))


def seeded(api: TestClient, db: Database, **headers: Any) -> tuple[int, list[dict[str, Any]]]:
    """The sweep of ``SWEEP`` with ``FINALS`` reported; its trials in position order."""
    r = api.post(f"{API}/sweeps", json=SWEEP, **headers)
    assert r.status_code == 201, r.text
    sweep_id = int(r.json()["id"])
    rows = api.get(f"{API}/sweeps/{sweep_id}/trials", **headers).json()["trials"]
    for pos, final in FINALS.items():
        start(db, rows[pos]["job_id"])
        report(db, rows[pos]["job_id"], final, step=pos + 1)
    return sweep_id, rows


def trials(api: TestClient, sweep_id: int, **params: Any) -> dict[str, Any]:
    r = api.get(f"{API}/sweeps/{sweep_id}/trials", params=params)
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    return body


def positions(body: dict[str, Any]) -> list[int]:
    return [t["position"] for t in body["trials"]]


def test_without_parameters_every_trial_in_position_order(api: TestClient, db: Database) -> None:
    sweep_id, _ = seeded(api, db)
    body = trials(api, sweep_id)
    assert positions(body) == [0, 1, 2, 3, 4, 5]
    assert (body["total"], body["offset"], body["next_offset"]) == (6, 0, None)
    assert datetime.fromisoformat(body["changed_since"]) <= datetime.now(UTC)


def test_pages_sorted_by_the_objective_either_way_missing_last(
    api: TestClient, db: Database
) -> None:
    sweep_id, _ = seeded(api, db)
    first = trials(api, sweep_id, sort="objective_value", limit=2)
    # 0.2 twice (positions 1 and 3: ties in position order), then 0.5, 0.9, then unscored.
    assert positions(first) == [1, 3]
    assert (first["total"], first["offset"], first["next_offset"]) == (6, 0, 2)
    second = trials(api, sweep_id, sort="objective_value", limit=2, offset=2)
    assert positions(second) == [0, 2] and second["next_offset"] == 4
    last = trials(api, sweep_id, sort="objective_value", limit=2, offset=4)
    assert positions(last) == [4, 5] and last["next_offset"] is None
    assert [t["objective_value"] for t in last["trials"]] == [None, None]

    down = trials(api, sweep_id, sort="objective_value", order="desc")
    assert positions(down) == [2, 0, 1, 3, 4, 5], "descending; ties and missing as before"
    assert positions(trials(api, sweep_id, sort="steps_done", order="desc")) == [3, 2, 1, 0, 4, 5]
    assert trials(api, sweep_id, offset=10, limit=5)["trials"] == []
    for sort in ("position", "objective_value"):  # past the end by any amount: an empty page
        far = trials(api, sweep_id, sort=sort, offset=2**63 - 1)
        assert far["trials"] == [] and far["total"] == 6 and far["next_offset"] is None
    # The table's own order is cut in SQL: the same rows and totals.
    back = trials(api, sweep_id, order="desc", limit=4, offset=1)
    assert positions(back) == [4, 3, 2, 1] and back["total"] == 6 and back["next_offset"] == 5


def test_sorted_by_an_override_and_other_columns(api: TestClient, db: Database) -> None:
    sweep_id, rows = seeded(api, db)
    by_lr = trials(api, sweep_id, sort="overrides.training.lr", order="desc")
    assert [t["overrides"]["training.lr"] for t in by_lr["trials"]] == [0.1, 0.1, 0.01, 0.01,
                                                                         0.001, 0.001]  # fmt: skip
    by_hidden = trials(api, sweep_id, sort="overrides.config.hidden")
    assert [t["overrides"]["config.hidden"] for t in by_hidden["trials"]] == [8] * 3 + [16] * 3
    # A path no trial sets: every value missing, position order.
    assert positions(trials(api, sweep_id, sort="overrides.nowhere")) == [0, 1, 2, 3, 4, 5]
    by_outcome = trials(api, sweep_id, sort="outcome")
    assert [t["outcome"] for t in by_outcome["trials"]] == ["queued"] * 2 + ["running"] * 4
    by_job = trials(api, sweep_id, sort="job_id", order="desc", limit=1)
    assert by_job["trials"][0]["job_id"] == max(r["job_id"] for r in rows)
    csv = api.get(
        f"{API}/sweeps/{sweep_id}/trials",
        params={"format": "csv", "sort": "objective_value", "limit": 2},
    )
    assert csv.status_code == 200, csv.text
    lines = csv.text.strip().splitlines()
    assert len(lines) == 3 and lines[1].startswith("1,") and lines[2].startswith("3,"), lines


def test_the_delta_poll_returns_only_changed_trials_and_rows_committed_late(
    api: TestClient, db: Database
) -> None:
    sweep_id, rows = seeded(api, db)
    job_ids = [r["job_id"] for r in rows]
    an_hour_ago = datetime.now(UTC) - timedelta(hours=1)
    stamp(db, job_ids, an_hour_ago)
    since = (an_hour_ago + timedelta(minutes=1)).isoformat()
    quiet = trials(api, sweep_id, changed_since=since)
    assert quiet["trials"] == [] and quiet["total"] == 0, "nothing changed since"

    report(db, job_ids[2], 0.1, step=9)  # trial 2 reports again: its job row changes
    delta = trials(api, sweep_id, changed_since=quiet["changed_since"])
    assert positions(delta) == [2]
    assert delta["trials"][0]["objective_value"] == 0.1
    assert delta["trials"][0]["steps_done"] == 9
    # The next token overlaps this answer: trial 2 comes again (clients dedupe by key)...
    token = datetime.fromisoformat(delta["changed_since"])
    assert token <= datetime.now(UTC) - timedelta(seconds=CHANGED_OVERLAP_S)
    # ...and a row stamped before that read but committed after it is not missed.
    stamp(db, [job_ids[4]], token + timedelta(seconds=CHANGED_OVERLAP_S - 1))
    late = trials(api, sweep_id, changed_since=delta["changed_since"])
    assert 4 in positions(late), f"a late-committed row was missed: {positions(late)}"
    # Sorted and paged like the whole table.
    both = trials(api, sweep_id, changed_since=since, sort="objective_value", limit=1)
    assert positions(both) == [2] and both["total"] == 2 and both["next_offset"] == 1
    by_position = trials(api, sweep_id, changed_since=since, order="desc", limit=1, offset=1)
    assert positions(by_position) == [2] and by_position["total"] == 2
    assert by_position["next_offset"] is None


def test_curves_of_picked_trials_only(api: TestClient, db: Database) -> None:
    sweep_id, rows = seeded(api, db)
    picked = [rows[3]["job_id"], rows[0]["job_id"], rows[5]["job_id"]]
    r = api.get(f"{API}/sweeps/{sweep_id}/metrics", params={"name": "loss", "job_id": picked})
    assert r.status_code == 200, r.text
    series = r.json()["series"]
    assert [s["job_id"] for s in series] == [rows[0]["job_id"], rows[3]["job_id"]], (
        "trial order; a picked trial without points left out"
    )
    assert series[1]["points"] == [[4, 0.2]]
    every = api.get(f"{API}/sweeps/{sweep_id}/metrics", params={"name": "loss"}).json()
    assert len(every["series"]) == 4, "without job_id: every trial that reported"


@pytest.mark.parametrize(
    ("path", "params", "field"),
    [
        ("trials", {"sort": "bogus"}, "sort"),
        ("trials", {"sort": "overrides."}, "sort"),
        ("trials", {"order": "up"}, "order"),
        ("trials", {"limit": 0}, "limit"),
        ("trials", {"limit": 100_000}, "limit"),
        ("trials", {"offset": -1}, "offset"),
        ("trials", {"offset": "x"}, "offset"),
        ("trials", {"changed_since": "yesterday"}, "changed_since"),
        ("trials", {"changed_since": "2026-01-01T00:00:00"}, "changed_since"),  # no zone
        ("metrics", {"job_id": 0}, "job_id"),
        ("metrics", {"job_id": "x"}, "job_id"),
        ("metrics", {"job_id": list(range(1, 300))}, "job_id"),
    ],
)
def test_bad_parameters_are_422_naming_the_field(
    api: TestClient, db: Database, path: str, params: dict[str, Any], field: str
) -> None:
    r = api.post(f"{API}/sweeps", json=SWEEP)
    assert r.status_code == 201, r.text
    got = api.get(f"{API}/sweeps/{r.json()['id']}/{path}", params=params)
    assert got.status_code == 422, got.text
    assert got.json()["detail"][0]["loc"][:2] == ["query", field], got.text


def test_only_the_owner_or_an_admin_may_read_them(settings: Settings, db: Database) -> None:
    with db.session() as s:
        alice = create_token(s, owner="alice")[1]
        bob = create_token(s, owner="bob")[1]
        admin = create_token(s, owner="root", admin=True)[1]
        worker = create_token(s, owner="", kind="worker", name="w1")[1]
    auth = settings.model_copy(update={"auth": "on"})
    with TestClient(create_app(auth)) as api:
        mine = {"headers": {"Authorization": f"Bearer {alice}"}}
        sweep_id, rows = seeded(api, db, **mine)
        with db.session() as s:
            rank = mint_attempt_token(s, rows[0]["job_id"], 1)
        since = (datetime.now(UTC) - timedelta(hours=1)).isoformat()
        calls = [
            ("trials", {"sort": "objective_value", "order": "desc", "limit": 2, "offset": 1}),
            ("trials", {"changed_since": since}),
            ("metrics", {"name": "loss", "job_id": [rows[0]["job_id"]]}),
        ]
        for path, params in calls:
            url = f"{API}/sweeps/{sweep_id}/{path}"

            def get(token: str | None, url: str = url, params: Any = params) -> Any:
                headers = {"Authorization": f"Bearer {token}"} if token else {}
                return api.get(url, params=params, headers=headers)

            r = get(bob)
            assert r.status_code == 404, f"bob GET {path} {params}: {r.status_code} {r.text}"
            assert "training.lr" not in r.text and "loss" not in r.text.replace("not_found", "")
            for who, token in (("attempt", rank), ("worker", worker), ("none", None)):
                assert get(token).status_code == 401, f"{who} token GET {path} {params}"
            assert get(alice).status_code == 200, f"alice GET {path} {params}"
            assert get(admin).status_code == 200, f"an admin GET {path} {params}"
        page = api.get(f"{API}/sweeps/{sweep_id}/trials", params={"limit": 2}, **mine).json()
        assert page["total"] == 6 and len(page["trials"]) == 2


def test_the_python_client_pages_sorted_trials(settings: Settings, db: Database) -> None:
    with TestClient(create_app(settings)) as api:
        sweep_id, _ = seeded(api, db)
    with serve_app(create_app(settings)) as url, DdpqClient(url + "/") as client:
        page = client.sweep_trials_page(sweep_id, sort="objective_value", order="desc", limit=3)
        assert positions(page) == [2, 0, 1] and page["next_offset"] == 3
        delta = client.sweep_trials_page(sweep_id, changed_since=page["changed_since"])
        assert {t["position"] for t in delta["trials"]} <= set(range(6))
        assert len(client.sweep_trials(sweep_id)) == 6, "the whole table, as before"
        with pytest.raises(ApiError) as bad:
            client.sweep_trials_page(sweep_id, sort="nope")
        assert bad.value.status_code == 422 and "sort" in str(bad.value.detail)
