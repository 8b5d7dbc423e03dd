"""The claim statements (``service.store.jobs.claims``, ``batch_claims``) are built once per
process and shared by every thread of the API's threadpool, so their first compilations can
run at once (a fresh ``ddpq serve`` whose waiting workers all claim together). Each must then
compile to the same SQL in every thread: once, with an aliased entity over the claim's CTE,
some threads compiled ``… FROM claimed, jobs`` (one row per job in the table, most columns
from other jobs' rows; a claim answered 500 or handed out other jobs' attempts). Compiled
against the PostgreSQL dialect, no database."""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from sqlalchemy.dialects import postgresql

from service.store.jobs import batch_claims, claims

THREADS = 6
ROUNDS = 40  # the aliased-entity statement went wrong in ~1 round of 5 here


@pytest.fixture
def eager_thread_switches() -> Iterator[None]:
    """Switch threads as often as the interpreter can, so first compilations overlap."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        yield
    finally:
        sys.setswitchinterval(before)


def _compile_together(statement: Any) -> list[str]:
    """``statement`` compiled by THREADS threads released together; each one's SQL (or the
    error it raised, as text)."""
    dialect = postgresql.dialect()
    out: list[str] = []
    start = threading.Barrier(THREADS)

    def compile_once() -> None:
        start.wait()
        try:
            out.append(str(statement.compile(dialect=dialect)))
        except Exception as exc:  # a broken compilation is what this test looks for
            out.append(f"error: {exc!r}")

    threads = [threading.Thread(target=compile_once) for _ in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


@pytest.mark.parametrize(
    "build",
    [claims._claim_statements.__wrapped__, batch_claims._batch_statements.__wrapped__],
    ids=["claim", "batch_claim"],
)
def test_a_fresh_claim_statement_compiles_the_same_in_every_thread(
    build: Callable[[], tuple[Any, Any]], eager_thread_switches: None
) -> None:
    for _ in range(ROUNDS):
        _, with_events = build()  # a fresh statement: nothing compiled or adapted yet
        compiled = _compile_together(with_events)
        assert len(set(compiled)) == 1, (
            "threads compiling one fresh claim statement together got different SQL; expected "
            "one text. Load the claimed rows through a Core SELECT of the CTE "
            f"(select(Job).from_statement(...)), not an aliased entity:\n{set(compiled)}"
        )
        final_from = compiled[0].rsplit("FROM", 1)[1]
        assert "jobs" not in final_from, f"claimed rows come from the CTE alone: {final_from}"
