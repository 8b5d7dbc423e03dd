"""``POST /attempts/self/notes``: rank 0 tells a decision the job's events must show (it
uploads although told to share a filesystem; an ``init_from`` start leaves nothing to train).
The server words the event from the note's kind, so a rank adds no free text to the events.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Request, Response

from service.api.attempts.routes import ERRORS, _body_doc, _db, _json_body
from service.api.deps import REQUIRE_ATTEMPT, AttemptDep
from service.core.wire import attempt as wire
from service.store.checkpoints import service as checkpoints

router = APIRouter(tags=["attempts"], dependencies=[REQUIRE_ATTEMPT], responses=ERRORS)


@router.post(
    wire.NOTES_PATH,
    status_code=204,
    response_class=Response,
    summary="Note a decision of rank 0's as a job event",
    openapi_extra=_body_doc(wire.AttemptNote),
)
def note_route(
    request: Request,
    ref: AttemptDep,
    note: Annotated[wire.AttemptNote, _json_body(wire.AttemptNote)],
) -> Response:
    """Write ``note`` as a job event of the token's attempt (once per attempt and text).

    Caller: a rank holding the attempt token (nobody else: a user's token is 401); 409
    ``attempt superseded`` when the attempt is not current (nothing written), 422 for a body
    that is not an ``AttemptNote``.
    """
    checkpoints.record_rank_note(
        _db(request), ref, note.kind, step=note.step, total_steps=note.total_steps
    )
    return Response(status_code=204)
