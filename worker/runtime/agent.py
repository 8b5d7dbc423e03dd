"""``python -m worker.runtime.agent [torchrun options] -m worker.runtime``: torchrun, with the
ranks forked from a warm interpreter instead of started as fresh ones.

torchrun starts every rank as a new ``python``. Before its first step each one imports torch
(~1.2 s on a 2-core box), ddpq's runtime (~0.4 s), and DistributedDataParallel's constructor
imports ``torch._dynamo`` (~3 s): most of the time from launch to step 1. This
agent takes torchrun's own options (``torch.distributed.run``'s parser) and runs torchrun's
own elastic agent (restarts, monitoring, the failure summary) with one change when the rank
entry is ``-m worker.runtime``: the rank is a function run with the ``forkserver`` start
method, whose server imports all of the above once, while this process imports torch and
does the rendezvous. Every rank is then forked with them loaded.

``forkserver``, not ``fork``: at fork time the agent runs the rendezvous store's thread, and a
fork of a multi-threaded process may deadlock the child; the fork server is single-threaded
(the default start method from Python 3.14 for that reason). It also never touches CUDA, so
CUDA ranks start as they do under torchrun.

Any other rank entry (a script, another module) runs exactly as torchrun runs it.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import sys
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from worker.attempt import RANK_CODE
from worker.processes import exit_now  # stdlib only: cheap for the fork server

WARM_ENTRY = "worker.runtime"
# What the fork server imports before it forks a rank (see those modules): every rank's, and
# what ddpq's trainer adds (not for a command job: the user's script imports its own).
PRELOAD = ("worker.runtime.forkserver_preload",)
TRAINER_PRELOAD = ("worker.runtime.forkserver_trainer",)


def preload_modules(environ: Mapping[str, str]) -> list[str]:
    """The modules the fork server imports for this attempt's ranks: ``PRELOAD``, plus
    ``TRAINER_PRELOAD`` unless ``DDPQ_RANK_CODE`` is ``script`` (a command job)."""
    if environ.get(RANK_CODE) == "script":
        return list(PRELOAD)
    return [*PRELOAD, *TRAINER_PRELOAD]


def warm_entry(argv: Sequence[str]) -> bool:
    """True when torchrun options ``argv`` end with the rank entry ``-m worker.runtime`` (no
    script arguments): the ranks this agent can fork warm."""
    return len(argv) >= 2 and tuple(argv[-2:]) in (("-m", WARM_ENTRY), ("--module", WARM_ENTRY))


def _release_fork_server() -> None:
    """Close this rank's copy of the fork server's "agent alive" pipe.

    The fork server exits when that pipe's write end closes, i.e. when torchrun's agent dies.
    multiprocessing hands every forked child a copy of the write end; a rank that kept it would
    keep the fork server, its parent, alive after a SIGKILLed agent, and so its own
    ``PR_SET_PDEATHSIG`` would never fire (tests/e2e/test_rank_parent_death.py).
    """
    from multiprocessing import forkserver

    server: Any = getattr(forkserver, "_forkserver", None)
    fd = getattr(server, "_forkserver_alive_fd", None)
    if isinstance(fd, int):
        with contextlib.suppress(OSError):
            os.close(fd)
        server._forkserver_alive_fd = None


def report_rank_exits() -> None:
    """Have the agent print every rank's exit code once a rank failed, one line each:
    ``ddpq agent: rank 1 exitcode -9`` (the rank is the local rank: the local launcher runs
    one node).

    torchrun's failure summary for forked ranks names only the first dead rank torch's process
    context happened to find, often a peer whose collective saw the real culprit go; the
    launcher reads these lines to blame the rank that died first without an error report
    (``worker.launchers.failure_text.silent_culprit``). Wraps the poll of torch's
    ``MultiprocessContext`` (torch's private API, pinned by tests/unit/test_runtime_agent.py):
    on a failure it has already stopped and joined every rank, so all exit codes are known.
    """
    from torch.distributed.elastic.multiprocessing import api

    original = api.MultiprocessContext._poll

    def _poll(self: Any) -> Any:
        context = self._pc
        result = original(self)
        if result is not None and result.failures and context is not None:
            for local_rank, process in enumerate(context.processes):
                sys.stderr.write(f"ddpq agent: rank {local_rank} exitcode {process.exitcode}\n")
            sys.stderr.flush()
        return result

    api.MultiprocessContext._poll = _poll  # type: ignore[method-assign]


def restore_sigterm() -> None:
    """Undo the fork server's SIGTERM settings in a rank: default action, unblocked. A SIGTERM
    that reached the rank since its fork is pending and acts now (see forkserver_preload)."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})


def rank_main() -> None:
    """One rank, forked by the fork server: ``worker.runtime.main.run_rank``.

    Success returns normally, because torchrun's agent counts a rank as done only once it has
    handed back a return value; the process then leaves without teardown as soon as that value
    is handed back (see below). Any other exit code leaves at once with that code, and
    torchrun's agent reports it as that rank's failure.
    """
    restore_sigterm()
    _release_fork_server()
    from worker.runtime.main import run_rank

    code = run_rank()
    if code != 0:
        exit_now(code)
    # After the return value is handed back, multiprocessing's exit joins every non-daemon
    # thread and child process the user's code left behind: one sleeping thread would hold
    # the attempt open until the launcher kills it. That exit runs this finalizer first.
    from multiprocessing import util

    util.Finalize(None, exit_now, args=(0,), exitpriority=sys.maxsize)


def main(argv: Sequence[str] | None = None) -> None:
    """Parse torchrun's options and run its elastic agent (see the module docstring).

    Raises:
        SystemExit: bad options (torchrun's parser), or a rank failed (exit code 1, after
            torchrun's failure summary on stderr, as torchrun does).
    """
    args = list(sys.argv[1:] if argv is None else argv)
    warm = warm_entry(args)
    if warm:
        # Start the fork server first: it imports PRELOAD on one core while this process
        # imports torch on the other.
        multiprocessing.set_forkserver_preload(preload_modules(os.environ))
        from multiprocessing import forkserver

        forkserver.ensure_running()
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import record

    if not warm:
        record(torchrun.main)(args)
        return
    options = torchrun.parse_args(args)
    report_rank_exits()

    @record
    def launch() -> None:
        if options.standalone:
            # As torch.distributed.run.run does for --standalone: a c10d rendezvous on a free
            # local port, with its own id.
            options.rdzv_backend = "c10d"
            options.rdzv_endpoint = "localhost:0"
            options.rdzv_id = str(uuid.uuid4())
        if options.master_port is None:
            options.master_port = 29500
        config, _, _ = torchrun.config_from_args(options)
        config.start_method = "forkserver"
        torchrun.elastic_launch(config=config, entrypoint=rank_main)()

    launch()


if __name__ == "__main__":
    main()
