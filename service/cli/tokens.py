"""The `ddpq token` commands (create, ls, revoke): users' API tokens and workers' tokens,
written straight to the database.

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
    owner: Annotated[
        str | None, typer.Option(help="Owner of the jobs submitted with it (e.g. alice).")
    ] = None,
    admin: Annotated[
        bool, typer.Option("--admin", help="May read and cancel every owner's jobs.")
    ] = False,
    worker: Annotated[
        bool,
        typer.Option(
            "--worker",
            help="A worker's token (DDPQ_WORKER_TOKEN of `ddpq worker`): opens only the "
            "worker API, never a user route.",
        ),
    ] = False,
    name: Annotated[
        str | None, typer.Option(help="A worker token's name, e.g. the host it is for (gpu-07).")
    ] = None,
) -> None:
    """Create a token and print it once, alone on the last line (stdout; notes go to stderr):
    `export DDPQ_TOKEN=$(ddpq token create --owner alice)`, or for a worker host
    `DDPQ_WORKER_TOKEN=$(ddpq token create --worker --name gpu-07)`."""
    if worker:
        if owner is not None or admin:
            fail("--worker tokens have no owner and no admin role", "drop --owner/--admin")
        _create_worker_token(name)
        return
    if owner is None:
        fail("missing --owner", "pass --owner NAME (a user's token) or --worker (a worker's)")
    if name is not None:
        fail("--name is for worker tokens", "add --worker, or drop --name")
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


def _create_worker_token(name: str | None) -> None:
    with _database() as db:
        try:
            created = auth.create_worker_token(db, name=name)
        except InvalidOwnerError as exc:
            fail(str(exc.detail).replace("owner", "name"), "pass --name like gpu-07")
    label = f" {name!r}" if name else ""
    err.print(
        f"created worker token {created.info.id}{label}; it is shown only now. On the worker "
        "host: DDPQ_WORKER_TOKEN=<it> ddpq worker --api http://<api-host>:<port>",
        soft_wrap=True,
    )
    typer.echo(created.token)


@token_app.command("ls")
def token_ls() -> None:
    """List tokens: id, kind (user or worker), owner or worker name, admin, created, revoked
    (the tokens themselves are not kept)."""
    with _database() as db:
        rows = auth.list_tokens(db)
    if not rows:
        out.print("no tokens yet: create one with `ddpq token create --owner NAME`")
        return
    table = Table(box=None, pad_edge=False)
    for column in ("ID", "KIND", "OWNER/NAME", "ADMIN", "CREATED", "REVOKED"):
        table.add_column(column)
    for t in rows:
        who = (t.name or "-") if t.kind == "worker" else t.owner
        created_at, revoked_at = t.created_at, t.revoked_at
        table.add_row(
            str(t.id),
            t.kind,
            cell(who),
            "yes" if t.admin else "",
            short_time(created_at.isoformat()),
            short_time(revoked_at.isoformat()) if revoked_at else "",
        )
    out.print(table)


@token_app.command("revoke")
def token_revoke(
    token_id: Annotated[int, typer.Argument(min=1, max=2**31 - 1, help="Id from `ddpq token ls`.")],
) -> None:
    """Revoke a token: the API refuses it from the next request on (a worker's worker then
    claims nothing more; its jobs are requeued when their leases lapse)."""
    with _database() as db:
        info = auth.revoke_token(db, token_id)
    who = f"worker {info.name or '-'}" if info.kind == "worker" else f"owner {info.owner}"
    out.print(f"token {token_id} ({who}) revoked")
