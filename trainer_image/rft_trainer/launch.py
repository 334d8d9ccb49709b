"""`python -m rft_trainer.launch <torchrun args>`: torchrun that keeps the exit code.

torchrun's agent exits 1 whenever a worker fails, whatever the worker's own exit code.
The operator's failure policy needs that code (78 means "a restart cannot fix this",
143 "terminated"), so this launcher runs torchrun in-process and exits with the first
failed worker's code; a signal to the launcher (SIGTERM on preemption or gang restart)
is forwarded to the workers by torchrun and reported as 128 + signal number.
"""

from __future__ import annotations

import sys

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import get_args_parser, run


def exit_code_of(error: ChildFailedError) -> int:
    """The first failed worker's exit code; a worker killed by signal N -> 128 + N."""
    _, failure = error.get_first_failure()
    code = failure.exitcode
    return 128 - code if code < 0 else (code or 1)


def main(argv: list[str] | None = None) -> int:
    args = get_args_parser().parse_args(argv)
    try:
        run(args)
    except ChildFailedError as e:
        return exit_code_of(e)
    except SignalException as e:
        return 128 + int(e.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(main())
