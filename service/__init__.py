"""The control plane: the REST API (``app.create_app``), its database store, the dashboard, the
``ddpq`` command line and the Python client; ``core`` is the vocabulary every process shares."""
