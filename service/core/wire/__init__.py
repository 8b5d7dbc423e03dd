"""Wire formats shared by the API and its non-user clients (ranks, workers), and the API's
route prefix: every route path in ``service.core.wire`` is relative to it."""

# The one prefix of every REST route (the dashboard's pages and /healthz stay outside it).
API_PREFIX = "/api/v1"
