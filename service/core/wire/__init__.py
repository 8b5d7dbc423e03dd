"""Wire formats shared by the API and its non-user clients (ranks, workers)."""
