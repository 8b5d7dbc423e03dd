"""Workspaces: users' working directories, stored as manifests by digest over content-addressed
files per owner (``service.core.wire.workspace`` is the wire format); ``service`` and
``upload_service`` are the use cases."""
