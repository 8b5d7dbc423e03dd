"""Config schemas of the built-in training tasks (validated by the API before queueing).

They live in ``service`` so the API can check a job's ``config`` without importing
``worker``; the tasks in ``worker/tasks`` import their schema from here.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class _TaskConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class RegressionConfig(_TaskConfig):
    """The seed tutorials' toy: ``Linear(in_features→hidden)→ReLU→Linear(→out_features)``,
    MSE loss on random data regenerated from the seed. Fault-injection knobs for tests."""

    in_features: int = Field(default=10, ge=1, le=100_000)
    hidden: int = Field(default=32, ge=1, le=100_000)
    out_features: int = Field(default=5, ge=1, le=100_000)
    num_samples: int = Field(default=1024, ge=1, le=10_000_000)
    fail_rank: int | None = Field(default=None, ge=0, description="Rank that raises.")
    fail_at_step: int | None = Field(default=None, ge=1)
    hang_rank: int | None = Field(default=None, ge=0, description="Rank that stops stepping.")
    hang_at_step: int | None = Field(default=None, ge=1)
    nan_at_step: int | None = Field(default=None, ge=1, description="Step whose loss is NaN.")
    sleep_per_step_ms: float = Field(default=0.0, ge=0, le=60_000)


class DigitsConfig(_TaskConfig):
    """A small MLP or CNN on scikit-learn's bundled 8×8 handwritten digits (1,797 images)."""

    model: str = Field(default="cnn", pattern="^(cnn|mlp)$")
    hidden: int = Field(default=64, ge=1, le=10_000)
    test_fraction: float = Field(default=0.2, gt=0, lt=1)


class CharLMConfig(_TaskConfig):
    """A small causal transformer over the Python standard library's source text."""

    context: int = Field(default=64, ge=4, le=4096, description="Tokens (bytes) per sample.")
    d_model: int = Field(default=64, ge=8, le=4096)
    n_heads: int = Field(default=4, ge=1, le=64)
    n_layers: int = Field(default=2, ge=1, le=48)
    corpus_bytes: int = Field(
        default=2_000_000, ge=10_000, le=500_000_000, description="Bytes of stdlib text to use."
    )


BUILTIN_TASK_CONFIGS: dict[str, type[_TaskConfig]] = {
    "regression": RegressionConfig,
    "digits": DigitsConfig,
    "charlm": CharLMConfig,
}
