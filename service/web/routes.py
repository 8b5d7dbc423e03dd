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
from service.api.jobs import MAX_INT64
from service.errors import NotFoundError
from service.jobs import get_job
from service.spec_text import SpecTextError, display_text, parse_spec_text
from service.states import ACTIVE_STATES, TERMINAL_STATES, JobState
from service.task_configs import BUILTIN_TASK_CONFIGS

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
    kind: str  # "int" | "float" | "text"
    default: str
    optional: bool
    minimum: str
    maximum: str
    pattern: str
    description: str


def _bound(info: FieldInfo, *names: str) -> str:
    for meta in info.metadata:
        for name in names:
            value = getattr(meta, name, None)
            if value is not None:
                return str(value)
    return ""


def _kind(annotation: Any) -> tuple[str, bool]:
    """``("int" | "float" | "text", optional)`` for a field's annotation."""
    args = typing.get_args(annotation)
    optional = False
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        optional = type(None) in args
        inner = [a for a in args if a is not type(None)]
        annotation = inner[0] if len(inner) == 1 else str
    if annotation is int:
        return "int", optional
    if annotation is float:
        return "float", optional
    return "text", optional


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


def _state_lists() -> dict[str, list[str]]:
    return {
        "states": [s.value for s in JobState],
        "live_states": sorted({JobState.QUEUED.value} | {s.value for s in ACTIVE_STATES}),
        "terminal_states": sorted(s.value for s in TERMINAL_STATES),
    }


@router.get("/", response_class=HTMLResponse)
def jobs_page(request: Request) -> HTMLResponse:
    """The job list (filter by state, newest first, cursor paging)."""
    return _page(request, "jobs.html", title="Jobs", **_state_lists())


@router.get("/jobs/{job_id}", response_class=HTMLResponse)
def job_page(request: Request, job_id: int, db: DbDep, settings: SettingsDep) -> HTMLResponse:
    """One job: spec, timeline, curves, progress, logs, checkpoints, error, cancel.
    With auth off, a job that does not exist gets a small 404 page. With auth on the page
    cannot know the caller, so it says nothing about the job: its script shows "not found"
    when the API answers 404."""
    exists = 1 <= job_id <= MAX_INT64  # ids are 64-bit: no other id can exist
    if exists and not settings.auth_enabled:
        try:
            with db.session(write=False) as session:
                get_job(session, job_id)
        except NotFoundError:
            exists = False
    if not exists:
        page = _page(
            request, "not_found.html", title="Job not found", message=f"Job {job_id} was not found."
        )
        page.status_code = 404
        return page
    return _page(request, "job.html", title=f"Job {job_id}", job_id=job_id, **_state_lists())


@router.get("/submit", response_class=HTMLResponse)
def submit_page(request: Request) -> HTMLResponse:
    """Submit a built-in task from a form, or a pasted YAML/JSON spec."""
    return _page(
        request,
        "submit.html",
        title="Submit a job",
        task_fields=task_form_fields(),
        default_task="regression",
    )


@router.get("/workers", response_class=HTMLResponse)
def workers_page(request: Request) -> HTMLResponse:
    """Workers, their capacity, running jobs and heartbeat age."""
    return _page(request, "workers.html", title="Workers")


def _spec_text_error(msg: str, type_: str = "value_error") -> JSONResponse:
    return JSONResponse(
        status_code=422, content={"detail": [{"loc": ["body", "text"], "msg": msg, "type": type_}]}
    )


@router.post("/submit/parse-spec", dependencies=[REQUIRE_CALLER])
async def parse_spec(request: Request) -> Response:
    """Turn pasted YAML or JSON (``{"text": str}``) into ``{"spec": object}`` for the API.

    Only parses (``service.spec_text.parse_spec_text``, in a worker thread so the event loop
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
