"""Entry point of the trainer pods: `torchrun ... -m rft_trainer --config PATH`.

Exit codes: 0 done; 78 (EX_CONFIG) for errors a restart cannot fix (bad config, bad
data layout, a model the trainer cannot train): the operator's default fatalExitCodes fail
the job at once; 143 after SIGTERM (preemption, suspend, gang restart) so the gang
semantics apply; 1 otherwise (retryable). A fatal error's one line ends the worker's log
and is what the launcher's last line quotes, so `status.lastFailure.message` says it
(e.g. `unsupported model: model_type 'bert': encoder-only (...) (BertLMHeadModel)`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
import time

from torch.distributed.elastic.multiprocessing.errors import record

EX_CONFIG = 78
EX_TERMINATED = 143


@record  # an uncaught exception goes to torchrun's error file too: the launcher names it
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="rft_trainer")
    ap.add_argument("--config", default=os.environ.get("RFT_CONFIG"),
                    help="resolved job config (JSON/YAML); default $RFT_CONFIG")
    args = ap.parse_args(argv)
    rank = os.environ.get("RANK", "0")
    logging.basicConfig(level=logging.INFO, format=f"[rank{rank}] %(levelname)s %(name)s: %(message)s")
    log = logging.getLogger("rft_trainer")
    if not args.config:
        return fatal(log, "no config: pass --config or set RFT_CONFIG")

    from rft_contract.config import ConfigError, load_config
    from .models import UnsupportedModelError
    from .trainer import Trainer

    try:
        config = load_config(args.config)
    except (ConfigError, OSError) as e:
        return fatal(log, f"invalid config {args.config}: {e}")

    trainer = Trainer(config)

    def on_sigterm(signum, frame) -> None:  # finish the current step, then leave
        log.warning("SIGTERM: stopping after the current step")
        trainer.request_stop()

    signal.signal(signal.SIGTERM, on_sigterm)
    try:
        trainer.prepare()
    except UnsupportedModelError as e:
        return fatal(log, f"unsupported model: {e}")
    except ValueError as e:  # a data or layout problem a restart will not fix
        return fatal(log, f"cannot start: {e}")
    try:
        outcome = asyncio.run(trainer.train())
    finally:
        asyncio.run(trainer.shutdown())
    log.info("trainer %s at step %d", outcome, trainer.train_step_num)
    return EX_TERMINATED if outcome == "stopped" else 0


def fatal(log: logging.Logger, line: str) -> int:
    """A failure a restart cannot fix: `line` ends this worker's log and goes to torchrun's
    error file (as `@record` writes an exception there), so the launcher's last line, the
    pod's, quotes it instead of "its log is above". Returns EX_CONFIG."""
    line = " ".join(line.split())
    log.error("%s", line)
    if path := os.environ.get("TORCHELASTIC_ERROR_FILE"):
        with open(path, "w") as f:
            json.dump({"message": line, "timestamp": str(int(time.time()))}, f)
    return EX_CONFIG


def exit_process(code: int) -> None:
    """Leave without running C++ static destructors. Everything the job needs is already
    durable (checkpoint committed, status and metrics flushed, process group destroyed),
    but the interpreter's teardown can still abort in torch's distributed objects
    ("terminate called without an active exception", SIGABRT, seen in about 1 of 6 runs of
    the 2-rank export test on torch 2.15): exit code 134 for a job that succeeded would make
    the operator restart its gang."""
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)


if __name__ == "__main__":
    exit_process(main())
