"""The built-in training tasks: name → builder (configs live in service.core.spec.task_configs) and
name → entrypoint (``def train(ctx: TrainContext)``, what a rank runs, as for users' code)."""

from __future__ import annotations

from worker.runtime.train.context import Entrypoint
from worker.tasks import charlm, digits, regression
from worker.tasks.base import TaskBuilder

TASKS: dict[str, TaskBuilder] = {
    "regression": regression.build,
    "digits": digits.build,
    "charlm": charlm.build,
}
ENTRYPOINTS: dict[str, Entrypoint] = {
    "regression": regression.train,
    "digits": digits.train,
    "charlm": charlm.train,
}
