"""The workspace routes of users: which files are missing, chunked file uploads, manifests
(``service.core.wire.workspace`` is the contract; the ranks' reads are
``service.api.attempts.workspace``)."""
