"""Request dependencies: the app's Database and Settings, and who the caller is (owner)."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from service.config import Settings
from service.db import Database


def get_db(request: Request) -> Database:
    """The Database that ``create_app`` built for this app."""
    db: Database = request.app.state.db
    return db


def get_app_settings(request: Request) -> Settings:
    """The Settings that ``create_app`` was given."""
    settings: Settings = request.app.state.settings
    return settings


def get_owner(request: Request, settings: Annotated[Settings, Depends(get_app_settings)]) -> str:
    """The owner of the caller's jobs.

    Every caller is ``settings.default_owner`` for now; API tokens (the ``Authorization:
    Bearer`` header, ``api_tokens`` table) will be looked up here, and nowhere else.
    """
    return settings.default_owner


DbDep = Annotated[Database, Depends(get_db)]
SettingsDep = Annotated[Settings, Depends(get_app_settings)]
OwnerDep = Annotated[str, Depends(get_owner)]
