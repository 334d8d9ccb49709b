"""A guard on the reconcile benchmark (bench/reconcile.py, issue 38): our operator as the
default install runs it (admission policies, the owner webhook served by the operator,
leader election with two replicas, Kueue running) against bare pods, in the same run on
the same cluster, one wave each of JOBS jobs x PODS pods. It fails only on a gross
regression: create -> all pods Running at p50, ours over bare pods, above MAX_RATIO; or the
API server's time in admission policies above MAX_POLICY_SECONDS per job (issue 38's kind:
a policy evaluated once per RFTJob of the namespace, O(jobs^2) a wave).

Measured on the 2-core dev machine, shared with other test runs (load average 1.5-4),
100 jobs x 4 pods, ours/bare p50 (policy time per job):

    c98aec4 (owner policy gone, owner webhook fixed), default   6.4x 7.5x 8.3x 9.7x 12.2x (15-47 ms)
      + 3ed90d1's owner policy and binding (selector {})        22.0x 26.3x (5.6 s, 6.8 s)
      without the webhook                                       4.6x 6.0x 6.2x 6.4x
    3ed90d1, default (binding + webhook shedding past 16 calls)  61x 70x, 14 jobs late (22-27 s)
      its owner binding deleted                                 8.5x 8.9x 9.1x (33-39 ms)
      binding deleted, without the webhook                      3.6x 4.2x 4.2x 4.9x 5.0x 7.9x (12-36 ms)
      with the binding, without the webhook                     13.3x 15.5x 17.2x 20.7x (4.6-5.2 s)

Ours needs CPU where bare pods need little, so other work on a 2-core machine inflates the
ratio (the same install measured 5.0x and 7.9x minutes apart): MAX_RATIO sits above the
passing installs' worst with room, and a ratio just above it (up to RETRY_BELOW times it) is
measured once more and fails only if both runs are above. The policy time is not load-bound
that way: 12-88 ms per job without a per-job policy, 4.6-6.8 s with one. Wall time: about
65-80 s when it passes, about 3 min when it measures twice.

The benchmark runs as a subprocess with its own control plane (about 15 s to start): the
session's cluster has its own operator watching every namespace, which would reconcile
the benchmark's jobs too, and whatever earlier tests left there would be measured with
them. The figures are printed in any case: in the test's line (pytest -v, no -s needed), in
a section of pytest's summary, as junitxml properties, and in the assertion's message.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
JOBS, PODS = 100, 4
MAX_RATIO = 16.0
MAX_POLICY_SECONDS = 1.0  # per job: the API server's time in admission policies
RETRY_BELOW = 1.5  # a ratio within RETRY_BELOW x the bound is measured once more; it fails if both are above
WAVE_TIMEOUT = 60  # seconds for a wave's jobs to run (ours p99 10-17 s when it passes)
SUBPROCESS_TIMEOUT = 300
pytestmark = [pytest.mark.integration, pytest.mark.timeout(2 * SUBPROCESS_TIMEOUT + 30)]

_summary: list[str] = []


class _Summary:
    """A section of pytest's terminal summary with the guard's figures."""

    @staticmethod
    def pytest_terminal_summary(terminalreporter) -> None:
        if _summary:
            terminalreporter.section("reconcile guard (bench/reconcile.py, ours vs bare pods)")
            for line in _summary:
                terminalreporter.write_line(line)


def describe(fig: dict) -> str:
    ours, bare = fig["sides"]["ours"], fig["sides"]["bare"]
    ratio = fig["ours_over_bare"] or {}
    adm = ours["admission"]
    jobs = max(1, ours["jobs"] + ours["missing"])  # created
    return "\n".join([
        (f"{fig['jobs']} jobs x {fig['pods']} pods, one wave; {fig['cores']} cores, load average "
         f"{fig['load_average']:.1f}; ours: {fig['ours_install']}"),
        (f"create -> all pods Running p50 / p99: ours {ours['pods_p50']:.2f} / {ours['pods_p99']:.2f} s, "
         f"bare {bare['pods_p50']:.2f} / {bare['pods_p99']:.2f} s"),
        (f"ours / bare: p50 {ratio.get('pods_p50', float('nan')):.2f}x (bound {MAX_RATIO:g}x), "
         f"p99 {ratio.get('pods_p99', float('nan')):.2f}x"),
        (f"ours: jobs not Running {ours['missing']}, writes per job {ours['writes_per_job'] or float('nan'):.1f}, "
         f"error lines {ours['errors']}; admission policies {1000 * adm['policy_seconds'] / jobs:.0f} ms per job; "
         f"owner webhook calls per job {adm['webhook_calls'] / jobs:.1f} "
         f"({adm['webhook_failures'] / jobs:.1f} unanswered)"),
    ])


def run_bench(tmp_path: Path, attempt: int) -> tuple[dict, str]:
    """One run of the benchmark: its figures and the tail of its output."""
    out = tmp_path / f"figures-{attempt}.json"
    argv = [sys.executable, str(ROOT / "bench/reconcile.py"), "--jobs", str(JOBS), "--pods", str(PODS),
            "--waves", "1", "--timeout", str(WAVE_TIMEOUT), "--json", str(out)]
    try:
        run = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT,
                             check=False)
    except subprocess.TimeoutExpired as e:
        stdout = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        pytest.fail(f"bench/reconcile.py ran over {SUBPROCESS_TIMEOUT}s:\n{stdout[-3000:]}")
    output = run.stdout[-4000:] + ("\n" + run.stderr[-3000:] if run.stderr.strip() else "")
    assert run.returncode == 0 and out.exists(), f"bench/reconcile.py exited with {run.returncode}:\n{output}"
    return json.loads(out.read_text()), output


def test_ours_is_not_grossly_slower_than_bare_pods(tmp_path, request, record_property, capsys):
    if not request.config.pluginmanager.has_plugin("reconcile-guard-summary"):
        request.config.pluginmanager.register(_Summary(), "reconcile-guard-summary")
    ratios = []
    for attempt in (1, 2):
        fig, output = run_bench(tmp_path, attempt)
        text = describe(fig)
        ratio = (fig["ours_over_bare"] or {}).get("pods_p50")
        ratios.append(ratio)
        record_property(f"run{attempt}_ours_over_bare_p50", ratio)
        record_property(f"run{attempt}_ours_over_bare_p99", (fig["ours_over_bare"] or {}).get("pods_p99"))
        record_property(f"run{attempt}_figures", json.dumps(fig))
        lines = [f"run {attempt}: {line}" for line in text.splitlines()]
        _summary.extend(lines)
        with capsys.disabled():
            print("\n" + "\n".join(f"[reconcile guard] {line}" for line in lines))
        ours, bare = fig["sides"]["ours"], fig["sides"]["bare"]
        assert ours["missing"] == 0 and bare["missing"] == 0, (
            f"jobs not Running within {WAVE_TIMEOUT} s:\n{text}\n\n{output}")
        assert ratio is not None, f"no ratio:\n{text}\n\n{output}"
        policy = ours["admission"]["policy_seconds"] / max(1, ours["jobs"] + ours["missing"])
        assert policy <= MAX_POLICY_SECONDS, (
            f"the API server spent {policy:.2f} s per job in admission policies (bound {MAX_POLICY_SECONDS:g} s): "
            f"a policy evaluated per object of a kind, e.g. a paramRef selector matching every RFTJob "
            f"(issue 38)\n{text}\n\n{output}")
        # Within the bound: passed. Far beyond it: no noise does that. Just beyond: once more.
        if ratio <= MAX_RATIO or ratio > RETRY_BELOW * MAX_RATIO:
            break
    assert ratio <= MAX_RATIO, (
        f"ours is {ratio:.2f}x bare pods at p50 (bound {MAX_RATIO:g}x"
        + (f"; {len(ratios)} runs: " + ", ".join(f"{r:.2f}x" for r in ratios) if len(ratios) > 1 else "")
        + f"): a gross regression of the reconcile path (see the admission and webhook figures; "
        f"`python bench/reconcile.py --jobs {JOBS} --waves 1 --without ...` turns parts of the install off)"
        f"\n{text}\n\n{output}")
