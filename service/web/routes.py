"""Dashboard pages (placeholder until the dashboard lands; see issue 5)."""

from __future__ import annotations

from fastapi import APIRouter

router = APIRouter(include_in_schema=False)
