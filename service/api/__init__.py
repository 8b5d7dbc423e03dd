"""The REST API under the prefix /api/v1: one router per resource, the exception handlers (the one
place HTTP statuses are decided), the body-size middleware and the shared HTTP helpers."""
