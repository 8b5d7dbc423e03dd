"""The `ddpq token` commands (create, ls, revoke): API tokens, written straight to the database.

They talk to DDPQ_DATABASE_URL, not to the API, so the operator can make the first token of a
server that already demands one; whoever runs them needs the database's credentials.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Annotated

import typer
from rich.table import Table

from service.cli.common import app, err, fail, friendly_errors, load_settings, out
from service.cli.output import cell, short_time
from service.store.auth import service as auth
from service.store.auth.tokens import InvalidOwnerError
from service.store.db import Database

token_app = typer.Typer(
    help="API tokens (stored hashed; the server checks them when its auth is on).",
    no_args_is_help=True,
    rich_markup_mode=None,
)
app.add_typer(token_app, name="token")


@contextmanager
def _database() -> Iterator[Database]:
    """The settings' database, checked to be reachable and at head (else exit 2 saying how
    to fix it; the URL's password is never printed)."""
    from service.store.migrate import check_database

    db = Database.from_url(load_settings().resolved_database_url)
    try:
        with friendly_errors():
            check_database(db)
            yield db
    finally:
        db.dispose()


@token_app.command("create")
def token_create(
    owner: Annotated[str, typer.Option(help="Owner of the jobs submitted with it (e.g. alice).")],
    admin: Annotated[
        bool, typer.Option("--admin", help="May read and cancel every owner's jobs.")
    ] = False,
) -> None:
    """Create a token and print it once, alone on the last line (stdout; notes go to stderr):
    `export DDPQ_TOKEN=$(ddpq token create --owner alice)`."""
    with _database() as db:
        try:
            created = auth.create_token(db, owner=owner, admin=admin)
        except InvalidOwnerError as exc:
            fail(str(exc.detail), "pass --owner with a name like alice or team-vision")
    token_id, token = created.info.id, created.token
    role = "admin token" if admin else "token"
    err.print(f"created {role} {token_id} for owner {owner}; it is shown only now:", soft_wrap=True)
    err.print(
        "(a server checks tokens only with auth on: DDPQ_AUTH=on, or a non-loopback --host)",
        soft_wrap=True,
    )
    typer.echo(token)


@token_app.command("ls")
def token_ls() -> None:
    """List tokens: id, owner, admin, created, revoked (the tokens themselves are not kept)."""
    with _database() as db:
        rows = [(t.id, t.owner, t.admin, t.created_at, t.revoked_at) for t in auth.list_tokens(db)]
    if not rows:
        out.print("no tokens yet: create one with `ddpq token create --owner NAME`")
        return
    table = Table(box=None, pad_edge=False)
    for column in ("ID", "OWNER", "ADMIN", "CREATED", "REVOKED"):
        table.add_column(column)
    for token_id, owner, is_admin, created_at, revoked_at in rows:
        table.add_row(
            str(token_id),
            cell(owner),
            "yes" if is_admin else "",
            short_time(created_at.isoformat()),
            short_time(revoked_at.isoformat()) if revoked_at else "",
        )
    out.print(table)


@token_app.command("revoke")
def token_revoke(
    token_id: Annotated[int, typer.Argument(min=1, max=2**31 - 1, help="Id from `ddpq token ls`.")],
) -> None:
    """Revoke a token: the API refuses it from the next request on."""
    with _database() as db:
        owner = auth.revoke_token(db, token_id).owner
    out.print(f"token {token_id} (owner {owner}) revoked")
