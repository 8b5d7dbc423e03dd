"""Who this rank is: job id, attempt and torch.distributed topology, read from the environment."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from service.core.errors import DdpqError
from worker import attempt as contract

DEFAULT_PG_TIMEOUT_S = 300.0


class RankEnvironmentError(DdpqError):
    """The rank's environment lacks a variable the launcher must set, or holds a bad value."""

    code = "rank_environment"


def _int(environ: Mapping[str, str], name: str, default: int | None = None) -> int:
    raw = environ.get(name)
    if raw is None or raw == "":
        if default is None:
            raise RankEnvironmentError(
                f"{name} is not set; the launcher must set it for every rank"
            )
        return default
    try:
        return int(raw)
    except ValueError:
        raise RankEnvironmentError(f"{name}={raw!r} is not an integer") from None


def _required(environ: Mapping[str, str], name: str) -> str:
    value = (environ.get(name) or "").strip()
    if not value:
        raise RankEnvironmentError(
            f"{name} is not set; the worker must set it for every rank (the attempt API's "
            "URL and this attempt's token: a rank reports through the API, never the database)"
        )
    return value


@dataclass(frozen=True)
class RankEnv:
    """One rank's identity. ``rank``/``world_size`` default to 0/1 (a lone process, e.g. dp).

    ``api_url`` and ``attempt_token`` are where and as whom the rank reports (the attempt
    API); the token is the only secret a rank holds. Its repr hides the token.
    """

    job_id: int
    attempt: int
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    master_addr: str | None
    master_port: int | None
    pg_timeout_s: float
    api_url: str
    attempt_token: str = field(repr=False)

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> RankEnv:
        """Parse the launcher's variables (names in ``worker.attempt``).

        Raises:
            RankEnvironmentError: ``DDPQ_JOB_ID``/``DDPQ_ATTEMPT``/``DDPQ_API_URL``/
                ``DDPQ_ATTEMPT_TOKEN`` missing, or a bad number.
        """
        world_size = _int(environ, contract.WORLD_SIZE, 1)
        rank = _int(environ, contract.RANK, 0)
        if not 0 <= rank < world_size:
            raise RankEnvironmentError(f"RANK={rank} is outside WORLD_SIZE={world_size}")
        port = environ.get(contract.MASTER_PORT)
        timeout_raw = environ.get(contract.PG_TIMEOUT_S) or str(DEFAULT_PG_TIMEOUT_S)
        try:
            pg_timeout_s = float(timeout_raw)
        except ValueError:
            raise RankEnvironmentError(
                f"{contract.PG_TIMEOUT_S}={timeout_raw!r} is not a number of seconds"
            ) from None
        return cls(
            job_id=_int(environ, contract.JOB_ID),
            attempt=_int(environ, contract.ATTEMPT),
            rank=rank,
            local_rank=_int(environ, contract.LOCAL_RANK, 0),
            world_size=world_size,
            local_world_size=_int(environ, contract.LOCAL_WORLD_SIZE, 1),
            master_addr=environ.get(contract.MASTER_ADDR) or None,
            master_port=int(port) if port else None,
            pg_timeout_s=pg_timeout_s,
            api_url=_required(environ, contract.API_URL),
            attempt_token=_required(environ, contract.ATTEMPT_TOKEN),
        )
