"""Dashboard pages (Jinja2 shells that JavaScript fills from the REST API) and spec parsing.

The pages hold no job data: each carries only ids in ``data-*`` attributes and its script
polls ``/api/v1``. So the pages load without a token even when auth is on (a browser sends
no Authorization header on navigation); their scripts send the token on every API call.
Every page is sent with a Content-Security-Policy that allows scripts from ``/static`` only,
so data that slipped into markup could still not run.
"""

from __future__ import annotations

import json
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2
from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response
from fastapi.templating import Jinja2Templates
from pydantic.fields import FieldInfo
from starlette.concurrency import run_in_threadpool

from service.api.deps import REQUIRE_CALLER, DbDep, SettingsDep
from service.api.errors import VALIDATION_CODE, error_body
from service.api.http import MAX_INT64
from service.core.errors import NotFoundError
from service.core.spec.model import JobSpec
from service.core.spec.task_configs import BUILTIN_TASK_CONFIGS, is_testing_field
from service.core.spec.text import SpecTextError, display_text, parse_spec_text
from service.core.states import JobState
from service.store.jobs import service as jobs
from service.store.sweeps import service as sweeps

WEB_DIR = Path(__file__).resolve().parent
TEMPLATES_DIR = WEB_DIR / "templates"
STATIC_DIR = WEB_DIR / "static"

# Largest spec text /submit/parse-spec accepts (bytes); the API caps the JSON body itself.
MAX_SPEC_TEXT_BYTES = 200_000

CONTENT_SECURITY_POLICY = "; ".join(
    [
        "default-src 'self'",
        "script-src 'self'",
        "style-src 'self' 'unsafe-inline'",
        "img-src 'self' data:",
        "connect-src 'self'",
        "object-src 'none'",
        "base-uri 'none'",
        "form-action 'self'",
        "frame-ancestors 'none'",
    ]
)

router = APIRouter(include_in_schema=False)
templates = Jinja2Templates(directory=str(TEMPLATES_DIR))


@jinja2.pass_context
def static_url(context: Any, path: str) -> str:
    """``/static/<path>`` as a root-relative URL (behind the app's ``root_path`` if any):
    no scheme or host, so pages work behind an HTTPS proxy."""
    request: Request = context["request"]
    return f"{request.scope.get('root_path', '')}/static/{path}"


templates.env.globals["static_url"] = static_url


@dataclass(frozen=True)
class FormField:
    """One input of the submit form, derived from a pydantic field."""

    name: str
    kind: str  # "int" | "float" | "text" | "bool" | "choice" | "list"
    default: str
    optional: bool
    minimum: str
    maximum: str
    pattern: str
    description: str
    path: str = ""  # where the value goes in the spec ("training.lr"); spec fields only
    label: str = ""
    choices: tuple[tuple[str, str], ...] = ()  # a <select>'s (value, text) pairs
    hint: bool = False  # show the description under the input (else only as its title)
    bounds: str = ""  # for people: "≥ 10, ≤ 604800"; spec fields only
    testing: bool = False  # a task's fault-injection knob (shown under "fault injection")


# The spec fields the form offers, as (legend, [(path, label, show the description?)]).
# Defaults, bounds, choices and descriptions come from the spec models, so the form cannot
# drift from what the API fills in. Launcher-specific fields (nnodes, cpus_per_task, mem_gb,
# slurm) are left to a pasted spec: the form submits to the local launcher.
SPEC_FORM_GROUPS: tuple[tuple[str, tuple[tuple[str, str, bool], ...]], ...] = (
    (
        "",
        (
            ("resources.nproc_per_node", "Ranks (nproc_per_node)", False),
            ("resources.gpus_per_node", "GPUs per node", False),
            ("training.epochs", "Epochs", False),
            ("training.max_steps", "Max steps (blank: all epochs)", False),
            ("training.batch_size", "Batch size per rank", False),
            ("training.lr", "Learning rate", False),
            ("training.optimizer", "Optimizer", False),
            ("training.seed", "Seed", False),
            ("training.log_every_steps", "Log every N steps", False),
            ("training.amp", "Mixed precision (amp)", True),
            ("backend", "Backend", False),
            ("resources.timeout_min", "Timeout (minutes)", False),
            ("priority", "Priority (higher runs first)", False),
            ("tags", "Tags (comma-separated)", False),
        ),
    ),
    (
        "Checkpoints, failures and restarts",
        (
            ("training.checkpoint_every_steps", "Checkpoint every N steps", False),
            ("training.checkpoint_every_epochs", "Checkpoint every N epochs", False),
            ("training.keep_checkpoints", "Keep newest N checkpoints", False),
            ("training.stall_timeout_s", "Stall timeout (seconds)", True),
            ("training.nonfinite_loss", "On a NaN/inf loss", True),
            ("max_restarts", "Max restarts after a failure", False),
        ),
    ),
)
# Form defaults that differ from the spec's on purpose: the form is for trying DDP, so 2 ranks.
FORM_DEFAULTS = {"resources.nproc_per_node": "2"}
# The task the form starts on: a real model and dataset (regression is a smoke test).
DEFAULT_FORM_TASK = "digits"


def _bound(info: FieldInfo, *names: str) -> str:
    for meta in info.metadata:
        for name in names:
            value = getattr(meta, name, None)
            if value is not None:
                return str(value)
    return ""


def _kind(annotation: Any) -> tuple[str, bool]:
    """``("int" | "float" | "bool" | "choice" | "list" | "text", optional)`` for a field's
    annotation (``choice``: a ``Literal``)."""
    args = typing.get_args(annotation)
    optional = False
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        optional = type(None) in args
        inner = [a for a in args if a is not type(None)]
        annotation = inner[0] if len(inner) == 1 else str
    if annotation is bool:
        return "bool", optional
    if annotation is int:
        return "int", optional
    if annotation is float:
        return "float", optional
    if typing.get_origin(annotation) is typing.Literal:
        return "choice", optional
    if typing.get_origin(annotation) is list:
        return "list", optional
    return "text", optional


def _bounds_text(info: FieldInfo) -> str:
    """A field's numeric bounds for its tooltip: ``"> 0, ≤ 100"``; blank when it has none."""
    parts = []
    for name, sign in (("gt", ">"), ("ge", "≥"), ("lt", "<"), ("le", "≤")):
        value = _bound(info, name)
        if value:
            parts.append(f"{sign} {value}")
    return ", ".join(parts)


def _form_default(value: Any) -> str:
    """A field's default as the text its input starts with (None and [] → blank)."""
    if value is None or value == []:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _spec_field(path: str) -> FieldInfo:
    """The pydantic field at a dotted spec ``path`` (``"training.lr"``).

    Raises:
        KeyError: no such field (a typo in ``SPEC_FORM_GROUPS``; the route tests catch it).
    """
    model: Any = JobSpec
    *parents, name = path.split(".")
    for part in parents:
        model = model.model_fields[part].annotation
    info: FieldInfo = model.model_fields[name]
    return info


def spec_form_fields() -> list[tuple[str, list[FormField]]]:
    """The form's spec inputs as ``(legend, fields)`` groups (``SPEC_FORM_GROUPS``), each
    with the spec's default (``FORM_DEFAULTS`` aside), bounds, choices and description."""
    groups: list[tuple[str, list[FormField]]] = []
    for legend, entries in SPEC_FORM_GROUPS:
        fields: list[FormField] = []
        for path, label, hint in entries:
            info = _spec_field(path)
            kind, optional = _kind(info.annotation)
            inner = info.annotation
            if optional:
                inner = next(a for a in typing.get_args(inner) if a is not type(None))
            choices: tuple[tuple[str, str], ...] = ()
            if kind == "choice":
                choices = tuple((str(c), str(c)) for c in typing.get_args(inner))
            elif kind == "bool":
                choices = (("true", "on"), ("false", "off"))
            default = _form_default(info.get_default(call_default_factory=True))
            fields.append(
                FormField(
                    name=path.rsplit(".", 1)[-1],
                    kind=kind,
                    default=FORM_DEFAULTS.get(path, default),
                    optional=optional,
                    minimum=_bound(info, "ge", "gt"),
                    maximum=_bound(info, "le", "lt"),
                    pattern=_bound(info, "pattern"),
                    description=info.description or "",
                    path=path,
                    label=label,
                    choices=choices,
                    hint=hint,
                    bounds=_bounds_text(info),
                )
            )
        groups.append((legend, fields))
    return groups


def task_form_fields() -> dict[str, list[FormField]]:
    """The config inputs of each built-in task, in schema order, with defaults and bounds."""
    out: dict[str, list[FormField]] = {}
    for task, schema in BUILTIN_TASK_CONFIGS.items():
        fields: list[FormField] = []
        for name, info in schema.model_fields.items():
            kind, optional = _kind(info.annotation)
            default = info.get_default(call_default_factory=True)
            fields.append(
                FormField(
                    name=name,
                    kind=kind,
                    default="" if default is None else str(default),
                    optional=optional,
                    minimum=_bound(info, "ge", "gt"),
                    maximum=_bound(info, "le", "lt"),
                    pattern=_bound(info, "pattern"),
                    description=info.description or "",
                    testing=is_testing_field(info),
                )
            )
        out[task] = fields
    return out


def _page(request: Request, template: str, **context: Any) -> HTMLResponse:
    context.setdefault("page", template.removesuffix(".html"))
    response = templates.TemplateResponse(request, template, context)
    response.headers["Content-Security-Policy"] = CONTENT_SECURITY_POLICY
    response.headers["X-Content-Type-Options"] = "nosniff"
    response.headers["Referrer-Policy"] = "same-origin"
    response.headers["Cache-Control"] = "no-cache"
    return response


@router.get("/", response_class=HTMLResponse)
def jobs_page(request: Request) -> HTMLResponse:
    """The job list (filter by state, newest first, cursor paging)."""
    return _page(request, "jobs.html", title="Jobs", states=[s.value for s in JobState])


@router.get("/jobs/{job_id}", response_class=HTMLResponse)
def job_page(request: Request, job_id: int, db: DbDep, settings: SettingsDep) -> HTMLResponse:
    """One job: spec, timeline, curves, progress, logs, checkpoints, error, cancel.
    With auth off, a job that does not exist gets a small 404 page. With auth on the page
    cannot know the caller, so it says nothing about the job: its script shows "not found"
    when the API answers 404."""
    exists = 1 <= job_id <= MAX_INT64  # ids are 64-bit: no other id can exist
    if exists and not settings.auth_enabled:
        try:
            jobs.get_job(db, job_id, owner=None)
        except NotFoundError:
            exists = False
    if not exists:
        page = _page(
            request, "not_found.html", title="Job not found", message=f"Job {job_id} was not found."
        )
        page.status_code = 404
        return page
    return _page(request, "job.html", title=f"Job {job_id}", job_id=job_id)


@router.get("/compare", response_class=HTMLResponse)
def compare_page(request: Request) -> HTMLResponse:
    """Jobs side by side (``?jobs=1,2,3``, picked on the job list): every metric's curves
    overlaid and the spec fields that differ. The ids are read by the page's script; a job
    the caller may not see is shown as not found."""
    return _page(request, "compare.html", title="Compare jobs")


@router.get("/sweeps", response_class=HTMLResponse)
def sweeps_page(request: Request) -> HTMLResponse:
    """The sweep list (newest first) with each sweep's counts by state and its best trial."""
    return _page(request, "sweeps.html", title="Sweeps")


@router.get("/sweeps/{sweep_id}", response_class=HTMLResponse)
def sweep_page(request: Request, sweep_id: int, db: DbDep, settings: SettingsDep) -> HTMLResponse:
    """One sweep: its trials (sortable, the best highlighted, states live), the selected
    metric's curves of all trials overlaid, and the objective against each axis. As for the
    job page, a sweep that does not exist gets a small 404 page with auth off; with auth on
    the page says nothing of the sweep: its script shows "not found" when the API answers
    404."""
    exists = 1 <= sweep_id <= MAX_INT64
    if exists and not settings.auth_enabled:
        try:
            sweeps.get_sweep(db, sweep_id, owner=None)
        except NotFoundError:
            exists = False
    if not exists:
        page = _page(
            request,
            "not_found.html",
            title="Sweep not found",
            message=f"Sweep {sweep_id} was not found.",
        )
        page.status_code = 404
        return page
    return _page(request, "sweep.html", title=f"Sweep {sweep_id}", sweep_id=sweep_id)


@router.get("/submit", response_class=HTMLResponse)
def submit_page(request: Request) -> HTMLResponse:
    """Submit a built-in task from a form, or a pasted YAML/JSON spec; ``?from=<job id>``
    pre-fills both from that job's spec (its script reads the job from the API). The spec's
    defaults ride along (``data-spec-defaults``) so the script can tell whether a cloned spec
    sets anything the form has no input for."""
    return _page(
        request,
        "submit.html",
        title="Submit a job",
        task_fields=task_form_fields(),
        spec_groups=spec_form_fields(),
        default_task=DEFAULT_FORM_TASK,
        spec_defaults=JobSpec(name="x", task=DEFAULT_FORM_TASK).model_dump(mode="json"),
    )


@router.get("/workers", response_class=HTMLResponse)
def workers_page(request: Request) -> HTMLResponse:
    """Workers, their capacity, running jobs and heartbeat age."""
    return _page(request, "workers.html", title="Workers")


def _spec_text_error(msg: str, type_: str = "value_error") -> JSONResponse:
    return JSONResponse(
        status_code=422,
        content=error_body([{"loc": ["body", "text"], "msg": msg, "type": type_}], VALIDATION_CODE),
    )


@router.post("/submit/parse-spec", dependencies=[REQUIRE_CALLER])
async def parse_spec(request: Request) -> Response:
    """Turn pasted YAML or JSON (``{"text": str}``) into ``{"spec": object}`` for the API.

    Only parses (``service.core.spec.text.parse_spec_text``, in a worker thread so the event loop
    stays free): validation and storage stay with ``POST /api/v1/jobs``. Errors are 422 in
    the API's shape, located at ``["body", "text"]``.
    """
    body = await request.body()
    if len(body) > MAX_SPEC_TEXT_BYTES * 2:
        return _spec_text_error(f"spec text is larger than {MAX_SPEC_TEXT_BYTES} bytes")
    try:
        payload = json.loads(body)
    except (ValueError, RecursionError):
        return _spec_text_error('send JSON: {"text": "<YAML or JSON spec>"}', "json_invalid")
    text = payload.get("text") if isinstance(payload, dict) else None
    if not isinstance(text, str) or not text.strip():
        return _spec_text_error("paste a job spec (YAML or JSON)", "missing")
    if len(text.encode("utf-8", "surrogatepass")) > MAX_SPEC_TEXT_BYTES:
        return _spec_text_error(f"spec text is larger than {MAX_SPEC_TEXT_BYTES} bytes")
    try:
        spec = await run_in_threadpool(parse_spec_text, text)
    except SpecTextError as exc:
        return _spec_text_error(display_text(str(exc)), exc.kind)
    return JSONResponse({"spec": spec})
