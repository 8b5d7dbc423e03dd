"""Which metric sums a job up: the one the job list shows and sweeps would rank by default.

One table so the API, the dashboard and the CLI never disagree about it.
"""

from __future__ import annotations

# Built-in task → its main metric. digits reports eval_accuracy once per epoch; the others
# have no held-out split, so their training loss is what people watch.
MAIN_METRICS: dict[str, str] = {
    "regression": "loss",
    "charlm": "loss",
    "digits": "eval_accuracy",
}
# Entrypoint tasks (and any task not in the table): every task reports ``loss``.
DEFAULT_MAIN_METRIC = "loss"


def main_metric_name(task: str) -> str:
    """The name of ``task``'s main metric (``DEFAULT_MAIN_METRIC`` for an unknown task)."""
    return MAIN_METRICS.get(task, DEFAULT_MAIN_METRIC)
