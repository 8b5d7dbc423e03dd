"""The PostgreSQL ingest statement stays short enough for psycopg to cache its parsed form:
a longer one is parsed again for every metric batch, which cost more than the rest of a
batch's client side (``service.store.metrics.rollups._pg_merge_set``)."""

from __future__ import annotations

from sqlalchemy.dialects import postgresql

from service.store.metrics import pg_ingest

try:  # psycopg's own limits, private: their values as of psycopg 3.2 if they ever move
    from psycopg._queries import MAX_CACHED_STATEMENT_LENGTH, MAX_CACHED_STATEMENT_PARAMS
except ImportError:  # pragma: no cover
    MAX_CACHED_STATEMENT_LENGTH, MAX_CACHED_STATEMENT_PARAMS = 4096, 50


def test_the_ingest_statement_as_psycopg_gets_it_fits_its_parse_cache() -> None:
    compiled = pg_ingest.PG_RECORD.compile(dialect=postgresql.psycopg.dialect())
    sent = str(compiled).encode()
    assert len(sent) <= MAX_CACHED_STATEMENT_LENGTH, len(sent)
    assert len(compiled.params) <= MAX_CACHED_STATEMENT_PARAMS, sorted(compiled.params)
