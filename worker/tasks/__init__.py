"""The built-in training tasks: name → builder (configs live in service.core.task_configs)."""

from __future__ import annotations

from worker.tasks import charlm, digits, regression
from worker.tasks.base import TaskBuilder

TASKS: dict[str, TaskBuilder] = {
    "regression": regression.build,
    "digits": digits.build,
    "charlm": charlm.build,
}
