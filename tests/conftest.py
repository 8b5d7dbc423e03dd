"""Shared fixtures: settings in a temp dir, and a migrated database on SQLite and PostgreSQL.

PostgreSQL comes from ``DDPQ_TEST_PG_URL`` (default: the local server's ``test`` database);
each test gets its own schema, dropped afterwards. Set ``DDPQ_TEST_SKIP_PG=1`` to run the
SQLite half alone on a machine without PostgreSQL (CI never sets it).

``db`` is cloned from a database migrated once per session (``tests/databases.py``);
``db_url`` and ``settings`` alone name an empty database. Every test that uses PostgreSQL
carries the ``postgres`` marker (added here), so ``-m "not postgres"`` runs the SQLite half.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import create_engine, text

from service.app import create_app
from service.core.config import Settings
from service.store import migrate
from service.store.db import Database
from tests import databases

PG_URL = os.environ.get("DDPQ_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
SKIP_PG = os.environ.get("DDPQ_TEST_SKIP_PG") == "1"
PG_FIXTURES = frozenset({"pg_schema_url", "pg_schema", "pg_deployment"})


# Tests that share one thing outside the test process run one after another on one xdist
# worker: the dev Slurm cluster's two nodes (queue lengths, max_concurrent are asserted), and
# the root namespace's veth addresses.
XDIST_GROUPS = {
    "tests/slurm/": "slurm",
    "tests/e2e/test_checkpoint_hosts.py": "netns",
    "tests/e2e/test_script_followed.py": "netns",
    "tests/e2e/test_worker_hosts.py": "netns",
    "tests/e2e/test_worker_partition.py": "netns",
    # Benchmarks at their tiny size are CPU-bound by design (a fleet, two CPU-bound jobs):
    # one at a time, so they never crowd the 2 cores together.
    "tests/procs/test_bench_smoke.py": "bench",
    # Ranks run as the same test Unix users here, whose RLIMIT_NPROC counts every task of
    # the user system-wide: one test's fork bomb would starve another's ranks.
    "tests/e2e/test_hostile_owner.py": "rank-users",
    "tests/e2e/test_hostile_entrypoint.py": "rank-users",
    "tests/e2e/test_rank_user.py": "rank-users",
}


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """With ``--dist loadgroup``: xdist's group scheduling, with each test's group taken
    from its path (``XDIST_GROUPS``; any other test is a group of its own), so the tests
    that share the Slurm cluster or the root network namespace run one at a time on one
    process. xdist reads an ``xdist_group`` mark by rewriting a private node id field that
    pytest 9 no longer reads, so its marks group nothing here."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class PathGroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            for prefix, group in XDIST_GROUPS.items():
                if nodeid.startswith(prefix):
                    return group
            return nodeid

    return PathGroupScheduling(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark every test that reaches PostgreSQL ``postgres`` (the ``[postgresql]`` half of the
    dialect parameter, and users of the PostgreSQL fixtures), and spread the heavy tests."""
    root = Path(str(config.rootpath))
    for item in items:
        callspec = getattr(item, "callspec", None)
        params = callspec.params.values() if callspec is not None else ()
        fixtures = set(getattr(item, "fixturenames", ()))
        if "postgresql" in params or fixtures & PG_FIXTURES:
            item.add_marker(pytest.mark.postgres)
    items[:] = _spread_heavy(items, root)


# Tests that run whole deployments, ranks or a browser: many processes each.
HEAVY_PREFIXES = ("tests/e2e/", "tests/web/", "tests/slurm/", "tests/fuzz/", "tests/procs/")


def _spread_heavy(items: list[pytest.Item], root: Path) -> list[pytest.Item]:
    """The same tests with the heavy ones spread evenly among the light ones (each kind in
    its own order): xdist hands out tests in this order, so its processes do not all start a
    deployment at once on a 2-core box, which slows every one and makes timings flaky."""
    heavy, light = [], []
    kinds: dict[str, list[pytest.Item]] = {}
    for item in items:
        where = Path(str(item.path)).relative_to(root).as_posix()
        kind = next((p for p in HEAVY_PREFIXES if where.startswith(p)), None)
        if kind is None:
            light.append(item)
        else:
            kinds.setdefault(kind, []).append(item)
    # Each kind spread over the whole run too: the e2e deployments, the heaviest, would else
    # all come in the first third (collection order) and crowd the 2 cores there. The browser
    # tests stay last: their session-wide Playwright keeps an asyncio loop running on the
    # process's main thread, where any later asyncio.run() or second Playwright fails.
    browser = kinds.pop("tests/web/", [])
    heavy = [
        item
        for _, _, item in sorted(
            ((i + 0.5) / len(group), n, item)
            for n, group in enumerate(kinds.values())
            for i, item in enumerate(group)
        )
    ] + browser
    if not heavy or not light:
        return items
    spread: list[pytest.Item] = []
    step = len(light) / len(heavy)
    taken = 0
    for i, item in enumerate(heavy):
        upto = round((i + 1) * step)
        spread.extend(light[taken:upto])
        taken = upto
        spread.append(item)
    spread.extend(light[taken:])
    return spread


def _pg_schema_url(schema: str) -> str:
    sep = "&" if "?" in PG_URL else "?"
    return f"{PG_URL}{sep}options={quote(f'-csearch_path={schema}')}"


@pytest.fixture
def pg_schema() -> Iterator[str]:
    """The name of a fresh, empty PostgreSQL schema, dropped after the test."""
    if SKIP_PG:
        pytest.skip("DDPQ_TEST_SKIP_PG=1")
    schema = databases.unique_schema_name()
    # pre-ping: a test may restart the server meanwhile (tests/e2e/test_db_outage.py)
    admin = create_engine(PG_URL, isolation_level="AUTOCOMMIT", pool_pre_ping=True)
    try:
        with admin.connect() as conn:
            conn.execute(text(f'CREATE SCHEMA "{schema}"'))
        yield schema
    finally:
        admin.dispose()
        databases.drop_schema(PG_URL, schema)


@pytest.fixture
def pg_schema_url(pg_schema: str) -> str:
    """A database URL whose search_path is a fresh, empty PostgreSQL schema."""
    return _pg_schema_url(pg_schema)


@pytest.fixture(scope="session")
def sqlite_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A SQLite file migrated to head, once per session (and xdist worker)."""
    return databases.migrated_sqlite_file(tmp_path_factory.mktemp("sqlite-template"))


@pytest.fixture(scope="session")
def pg_template() -> Iterator[tuple[str, str] | None]:
    """(template schema name, its dump) migrated once per session; None without ``pg_dump``."""
    if SKIP_PG:
        yield None
        return
    schema = databases.unique_schema_name("ddpqtemplate")
    admin = create_engine(PG_URL, isolation_level="AUTOCOMMIT", pool_pre_ping=True)
    try:
        with admin.connect() as conn:
            conn.execute(text(f'CREATE SCHEMA "{schema}"'))
    finally:
        admin.dispose()
    try:
        dump = databases.pg_schema_dump(PG_URL, _pg_schema_url(schema), schema)
        yield (schema, dump) if dump is not None else None
    finally:
        databases.drop_schema(PG_URL, schema)


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """An empty database's URL, once for SQLite and once for PostgreSQL."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'ddpq.db'}"
    return str(request.getfixturevalue("pg_schema_url"))


@pytest.fixture
def settings(tmp_path: Path, db_url: str) -> Settings:
    """Settings for one test: its own database and artifact dir under ``tmp_path``."""
    return Settings(
        home=tmp_path / ".ddpq",
        database_url=db_url,
        artifact_dir=tmp_path / "artifacts",
        allowed_entrypoints=["examples.*:*"],
    )


@pytest.fixture
def db(settings: Settings, request: pytest.FixtureRequest) -> Iterator[Database]:
    """A database at Alembic head for ``settings``: a clone of the session's template."""
    url = settings.resolved_database_url
    if url.startswith("sqlite"):
        databases.clone_sqlite(request.getfixturevalue("sqlite_template"), url)
    else:
        template = request.getfixturevalue("pg_template")
        if template is None:
            migrate_db = Database.from_url(url)
            migrate.upgrade(migrate_db.engine)
            migrate_db.dispose()
        else:
            template_schema, dump = template
            databases.replay_pg_dump(
                url, dump, template_schema, request.getfixturevalue("pg_schema")
            )
    database = Database.from_url(url)
    yield database
    database.dispose()


@pytest.fixture
def app_settings(settings: Settings) -> Settings:
    """The settings ``api`` serves; a module overrides this fixture to serve others (auth on,
    a checkpoint store, a rate limit)."""
    return settings


@pytest.fixture
def api(app_settings: Settings, db: Database) -> Iterator[TestClient]:
    """The app for ``app_settings`` over a migrated ``db``, in a TestClient (lifespan run)."""
    with TestClient(create_app(app_settings)) as client:
        yield client
