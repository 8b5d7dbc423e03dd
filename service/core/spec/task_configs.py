"""Config schemas of the built-in training tasks (validated by the API before queueing).

They live in ``service`` so the API can check a job's ``config`` without importing
``worker``; the tasks in ``worker/tasks`` import their schema from here.
"""

from __future__ import annotations

from typing import Any, Self

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic.fields import FieldInfo

DIGITS_IMAGES = 1797  # scikit-learn's bundled 8×8 digits
# Both splits of the digits must hold at least one batch on every rank, whatever the seed.
MIN_TEST_FRACTION = 0.05
MAX_TEST_FRACTION = 0.5
# Values (float32) of the regression dataset each rank builds: 2^28 values = 1 GiB.
MAX_REGRESSION_VALUES = 2**28


# Marks a config field as a fault-injection knob for tests (json_schema_extra): the
# dashboard tucks these away under "fault injection (testing)"; the OpenAPI schema shows
# ``"testing": true`` on them.
TESTING: dict[str, Any] = {"testing": True}


def is_testing_field(info: FieldInfo) -> bool:
    """Whether a task config field is a fault-injection knob (marked with ``TESTING``)."""
    extra = info.json_schema_extra
    return isinstance(extra, dict) and extra.get("testing") is True


class _TaskConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class RegressionConfig(_TaskConfig):
    """The seed tutorials' toy: ``Linear(in_features→hidden)→ReLU→Linear(→out_features)``,
    MSE loss on random data regenerated from the seed. Fault-injection knobs for tests."""

    in_features: int = Field(default=10, ge=1, le=100_000)
    hidden: int = Field(default=32, ge=1, le=100_000)
    out_features: int = Field(default=5, ge=1, le=100_000)
    num_samples: int = Field(default=1024, ge=1, le=10_000_000)
    fail_rank: int | None = Field(
        default=None, ge=0, description="Rank that raises.", json_schema_extra=TESTING
    )
    fail_at_step: int | None = Field(default=None, ge=1, json_schema_extra=TESTING)
    hang_rank: int | None = Field(
        default=None, ge=0, description="Rank that stops stepping.", json_schema_extra=TESTING
    )
    hang_at_step: int | None = Field(default=None, ge=1, json_schema_extra=TESTING)
    nan_at_step: int | None = Field(
        default=None, ge=1, description="Step whose loss is NaN.", json_schema_extra=TESTING
    )
    nan_rank: int | None = Field(
        default=None,
        ge=0,
        description="The one rank whose loss is NaN (default: every rank).",
        json_schema_extra=TESTING,
    )
    sleep_per_step_ms: float = Field(
        default=0.0,
        ge=0,
        le=60_000,
        description="Milliseconds each step sleeps (slows a job down for tests).",
        json_schema_extra=TESTING,
    )

    @model_validator(mode="after")
    def _dataset_fits_in_memory(self) -> RegressionConfig:
        """Each rank builds the whole dataset (float32 inputs + targets): refuse at submit
        a size that could only fail at runtime with an allocation error."""
        values = self.num_samples * (self.in_features + self.out_features)
        if values > MAX_REGRESSION_VALUES:
            raise ValueError(
                f"num_samples × (in_features + out_features) = {values:,} values "
                f"({values * 4 / 2**30:,.1f} GiB per rank) exceeds "
                f"{MAX_REGRESSION_VALUES:,} ({MAX_REGRESSION_VALUES * 4 / 2**30:.0f} GiB); "
                "lower num_samples or in_features"
            )
        return self


class DigitsConfig(_TaskConfig):
    """A small MLP or CNN on scikit-learn's bundled 8×8 handwritten digits (1,797 images)."""

    model: str = Field(default="cnn", pattern="^(cnn|mlp)$")
    hidden: int = Field(default=64, ge=1, le=10_000)
    test_fraction: float = Field(
        default=0.2,
        ge=MIN_TEST_FRACTION,
        le=MAX_TEST_FRACTION,
        description="Share of the 1,797 images held out for test accuracy.",
    )

    @field_validator("test_fraction", mode="before")
    @classmethod
    def _both_splits_hold_a_batch(cls, value: Any) -> Any:
        """Explain the bounds (pydantic's own message would not say why, or what to use)."""
        number = isinstance(value, int | float) and not isinstance(value, bool)
        # Only a fraction (0–1) is explained: NaN, ±inf or 1e308 would break the image count
        # (OverflowError, a 500); the Field bounds refuse those.
        if number and 0 <= value <= 1 and not MIN_TEST_FRACTION <= value <= MAX_TEST_FRACTION:
            test = round(DIGITS_IMAGES * value)
            raise ValueError(
                f"test_fraction={value} would hold out {test} of the {DIGITS_IMAGES:,} "
                f"images, leaving {DIGITS_IMAGES - test} to train on; set test_fraction "
                f"between {MIN_TEST_FRACTION} and {MAX_TEST_FRACTION} (default 0.2) so "
                "both the train and the test split hold at least one batch"
            )
        return value


class CharLMConfig(_TaskConfig):
    """A small causal transformer over the Python standard library's source text."""

    context: int = Field(default=64, ge=4, le=4096, description="Tokens (bytes) per sample.")
    d_model: int = Field(default=64, ge=8, le=4096)
    n_heads: int = Field(default=4, ge=1, le=64)
    n_layers: int = Field(default=2, ge=1, le=48)
    corpus_bytes: int = Field(
        default=2_000_000, ge=10_000, le=500_000_000, description="Bytes of stdlib text to use."
    )

    @model_validator(mode="after")
    def _heads_divide_d_model(self) -> Self:
        """Each attention head gets ``d_model / n_heads`` dimensions: it must divide."""
        d, h = self.d_model, self.n_heads
        if d % h:
            heads = [n for n in range(1, min(d, 64) + 1) if d % n == 0]
            lower, upper = d - d % h, d - d % h + h
            models = " or ".join(str(m) for m in (lower, upper) if 8 <= m <= 4096)
            raise ValueError(
                f"d_model={d} must be divisible by n_heads={h} (each attention head gets "
                f"d_model / n_heads dimensions): set n_heads to one of "
                f"{', '.join(map(str, heads))}, or d_model to {models}"
            )
        return self


BUILTIN_TASK_CONFIGS: dict[str, type[_TaskConfig]] = {
    "regression": RegressionConfig,
    "digits": DigitsConfig,
    "charlm": CharLMConfig,
}
