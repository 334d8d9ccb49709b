"""`python -m rft_trainer.launch <torchrun args>`: torchrun that keeps the exit code.

torchrun's agent exits 1 whenever a worker fails, whatever the worker's own exit code.
The operator's failure policy needs that code (78 means "a restart cannot fix this",
143 "terminated"), so this launcher runs torchrun in-process and exits with the first
failed worker's code; a signal to the launcher (SIGTERM on preemption or gang restart)
is forwarded to the workers by torchrun and reported as 128 + signal number.

After forwarding SIGTERM torchrun's agent kills the workers `--shutdown-timeout` seconds
later (30 by default), whatever the pod's grace period (300 s by default): a final save
needs more. Unless set explicitly, the launcher sets it to the grace period
(RFT_TERMINATION_GRACE_SECONDS, from the pod spec) minus KILL_MARGIN seconds for the
launcher itself to exit, and the workers read the same value as their save budget
(`trainer.stop_budget_seconds`).
"""

from __future__ import annotations

import logging
import os
import sys

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import get_args_parser, run


log = logging.getLogger("rft_trainer.launch")

KILL_MARGIN = 5
SHUTDOWN_ENV = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"


def set_shutdown_timeout(args, env=os.environ) -> int | None:
    """The workers' kill timeout after SIGTERM: explicit (flag or env) wins, else the
    pod's grace period minus KILL_MARGIN; exported so the workers see their budget."""
    if args.shutdown_timeout is not None:
        env[SHUTDOWN_ENV] = str(args.shutdown_timeout)
        return args.shutdown_timeout
    if env.get(SHUTDOWN_ENV):
        try:
            return int(float(env[SHUTDOWN_ENV]))
        except ValueError:
            raise SystemExit(f"{SHUTDOWN_ENV}={env[SHUTDOWN_ENV]!r}: expected a number of seconds") from None
    try:
        grace = int(float(env.get("RFT_TERMINATION_GRACE_SECONDS", "") or 0))
    except ValueError:
        return None
    if grace <= 0:
        return None
    timeout = max(1, grace - KILL_MARGIN)
    env[SHUTDOWN_ENV] = str(timeout)
    log.info("workers get %ds after SIGTERM (grace period %ds)", timeout, grace)
    return timeout


def exit_code_of(error: ChildFailedError) -> int:
    """The first failed worker's exit code; a worker killed by signal N -> 128 + N."""
    _, failure = error.get_first_failure()
    code = failure.exitcode
    return 128 - code if code < 0 else (code or 1)


# The launcher's last line stays well inside what the kubelet keeps of a failed container's
# log (80 lines, 2 KiB), whatever the worker raised.
SAID_CHARS = 300


def said_by(failure) -> str:
    """One line on why a worker ended: its exception ("Type: message", from the error file
    that `@record` writes; torch hands it over as a dict that also holds the whole
    traceback, which the worker has already printed above) or the signal that killed it."""
    if not (failure.exitcode < 0 or os.path.isfile(failure.error_file or "")):
        return "its log is above"
    said = failure.message
    if isinstance(said, dict):
        said = said.get("message") or ""
    line = " ".join(str(said).split())
    return line if len(line) <= SAID_CHARS else line[:SAID_CHARS - 3] + "..."


def main(argv: list[str] | None = None) -> int:
    args = get_args_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="[launcher] %(levelname)s %(name)s: %(message)s")
    set_shutdown_timeout(args)
    try:
        run(args)
    except ChildFailedError as e:
        code = exit_code_of(e)
        rank, failure = e.get_first_failure()
        # The pod's last log line, which the operator quotes in status.lastFailure.
        log.error("rank %d exited with code %d: %s", rank, code, said_by(failure))
        return code
    except SignalException as e:
        return 128 + int(e.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(main())
