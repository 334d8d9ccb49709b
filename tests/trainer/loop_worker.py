"""`python -m rft_trainer` with every rank recording what it trains: one JSON line per
step to $RFT_TEST_TRACE_DIR/rank<R>.jsonl with the step and the batch's sample ids (the
`info[*]["id"]` the test wrote). Run under rft_trainer.launch like the real entry point."""

import json
import os
import sys
from pathlib import Path

from rft_trainer import __main__ as entry
from rft_trainer.engine import FSDPTrainEngine

_train_step = FSDPTrainEngine.train_step


def traced(self, batch):
    out = _train_step(self, batch)
    trace = Path(os.environ["RFT_TEST_TRACE_DIR"]) / f"rank{self.rt.rank}.jsonl"
    with trace.open("a") as f:
        f.write(json.dumps({"step": self.train_step_num, "ids": [i["id"] for i in batch.info]}) + "\n")
    return out


FSDPTrainEngine.train_step = traced

if __name__ == "__main__":
    entry.exit_process(entry.main(sys.argv[1:]))
