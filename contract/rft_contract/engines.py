"""The inference-engine catalogue: one `EngineProfile` per `spec.inference.engine`, the single
place an engine's facts live (torch-free: the operator, the CRD and the sync agent read it).

Derived from it:
- the spec's `inference.engine` enum and description, its image rule, and `ENGINE_ENV` (the
  variables the operator sets that `inference.env` may not) (spec.py, and so the CRD);
- the inference pod: the engine's command, env, readiness probe, and for a supervised engine
  the init container that fetches the initial weights and the engine helpers, the shared
  memory, and the supervisor the sync agent restarts it through (rft_operator.rollout_pods);
- the sync agent's adapters, registered under the same names (`rft_serving.engines.ENGINES`,
  whose `restartable` is checked equal to the profile's).

Adding an engine is one line here plus its adapter in `rft_serving/engines.py`
(docs/design.md, "How to add").
"""

from __future__ import annotations

from dataclasses import dataclass

from .names import BASE_MODEL_NAME

# sync.dtype as vLLM's and SGLang's --dtype spell it.
ENGINE_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}

# The flags every OpenAI-compatible server of the catalogue takes alike. --host 0.0.0.0:
# SGLang's default is 127.0.0.1, and the agent and the explorers connect to the pod IP.
# `{dtype}`: the exports' and their probes' (vLLM's "auto" would serve an fp32 export in
# 16 bits, which the fp32 probe refuses).
SERVER_FLAGS = ("--host", "0.0.0.0", "--port", "{port}", "--served-model-name", "{served}", "--dtype", "{dtype}")


@dataclass(frozen=True)
class EngineProfile:
    name: str  # spec.inference.engine, and the sync agent's --engine
    # The engine's command line before `inference.args`, formatted with port, served (the
    # served model name), dtype (ENGINE_DTYPES) and initial (the weights the init container
    # fetched, for an engine that cannot start empty).
    command: tuple[str, ...]
    readiness_path: str  # the readiness probe's HTTP GET
    # Runs under rft_serving.supervise from the helpers the init container copies (on
    # PYTHONPATH), started from the fetched initial weights, with shared memory; the sync
    # agent restarts it through the supervisor when a reload broke it.
    supervised: bool
    restartable: bool  # a probe mismatch is cured by a restart (else the agent refuses the version)
    env: tuple[tuple[str, str], ...] = ()  # set by the operator on the engine container
    own_image: bool = True  # needs spec.inference.image (else it runs in the trainer image)
    # How its completions carry the weights version (rft_rollout.rollouts reads each shape).
    weights_version: str = ""
    # The flags that let it take weights over NCCL from trainer rank 0 (sync.transport nccl;
    # rft_contract.nccl); none: it cannot, and admission refuses that transport with it.
    nccl_flags: tuple[str, ...] = ()
    # Loads a LoRA adapter (PEFT's format) onto the base it serves, at run time: a LoRA job
    # (spec.model.lora) then syncs the adapter alone; else each version is the merged model.
    lora_adapters: bool = False
    # For a LoRA job: the flags that let it load adapters at run time, formatted with
    # lora_rank (`lora_rank`), and its env for them. An engine with such flags serves the
    # policy as an adapter named SERVED_MODEL_NAME and the base alone as BASE_MODEL_NAME
    # (names.py); version 0 is then the base with an adapter of zeros (the sync agent's).
    lora_flags: tuple[str, ...] = ()
    lora_env: tuple[tuple[str, str], ...] = ()
    # The adapter ranks its flags accept (`lora_rank` rounds a job's rank up to one); empty: any.
    lora_ranks: tuple[int, ...] = ()
    # Module names whose adapters it refuses to load (each such version would be refused):
    # admission refuses a LoRA job that targets one with this engine.
    lora_unserved: tuple[str, ...] = ()


ENGINES: dict[str, EngineProfile] = {p.name: p for p in (
    # Our reference server (rft_serving.serve): starts empty and loads through the agent.
    EngineProfile("reference", ("python", "-m", "rft_serving.serve", "--port", "{port}", "--served-model-name",
                                "{served}"),
                  readiness_path="/health", supervised=False, restartable=False, own_image=False,
                  weights_version="`weights_version` in the body", lora_adapters=True),
    # vLLM 0.32.0: the module (the CPU wheel's `vllm serve` cannot find its own package
    # name), dev-mode routes for the reload, our worker extension (vllm_worker.py). It
    # starts labelled "default" (no flag sets the label), so the agent reloads it once.
    EngineProfile("vllm", ("python3", "-m", "vllm.entrypoints.openai.api_server", "--model", "{initial}",
                           *SERVER_FLAGS, "--worker-extension-cls", "rft_serving.vllm_worker.RFTWorkerExtension"),
                  readiness_path="/health", supervised=True, restartable=True, env=(("VLLM_SERVER_DEV_MODE", "1"),),
                  weights_version="`choices[i].weight_versions` spans of the output tokens",
                  nccl_flags=("--weight-transfer-config", '{"backend":"nccl"}'), lora_adapters=True,
                  # Runtime adapters (/v1/load_lora_adapter), one at a time: each version
                  # loads in place of the last under the same name. --max-lora-rank takes
                  # vLLM's MaxLoRARanks only.
                  lora_flags=("--enable-lora", "--max-lora-rank", "{lora_rank}", "--max-loras", "1"),
                  lora_env=(("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "1"),),
                  lora_ranks=(1, 8, 16, 32, 64, 128, 256, 320, 512),
                  # 0.32.0 adapts no output head: "expected target modules in {...} but
                  # received ['lm_head']" (HTTP 500) at every load.
                  lora_unserved=("lm_head",)),
    # SGLang 0.5.23: no --weight-version, so it starts as "default" and the agent reloads
    # (and labels) it. /ready is 200 once up (its /health generates a token and takes over
    # the probe's 1 s timeout).
    EngineProfile("sglang", ("python3", "-m", "sglang.launch_server", "--model-path", "{initial}", *SERVER_FLAGS),
                  readiness_path="/ready", supervised=True, restartable=True,
                  weights_version="top-level `metadata.weight_versions`, the first choice's"),
)}

ENGINE_NAMES: tuple[str, ...] = tuple(ENGINES)
TRAINER_IMAGE_ENGINES: tuple[str, ...] = tuple(n for n, p in ENGINES.items() if not p.own_image)
NCCL_ENGINES: tuple[str, ...] = tuple(n for n, p in ENGINES.items() if p.nccl_flags)
LORA_ENGINES: tuple[str, ...] = tuple(n for n, p in ENGINES.items() if p.lora_adapters)
# The modules each engine that loads adapters refuses them on.
LORA_UNSERVED: dict[str, tuple[str, ...]] = {n: p.lora_unserved for n, p in ENGINES.items()
                                             if p.lora_adapters and p.lora_unserved}
# What the operator sets on an engine container and `inference.env` may not set: the
# helpers' PYTHONPATH of supervised engines and each engine's own variables.
ENGINE_ENV: tuple[str, ...] = ("PYTHONPATH", *dict.fromkeys(k for p in ENGINES.values() for k, _ in (*p.env, *p.lora_env)))


def lora_rank(profile: EngineProfile, rank: int) -> int:
    """The smallest adapter rank the engine's flags accept that holds `rank` (spec.model.lora.rank)."""
    return next((r for r in profile.lora_ranks if r >= rank), rank) if profile.lora_ranks else rank


def adapter_policy(profile: EngineProfile, lora: bool) -> bool:
    """Whether the engine serves a job's policy as a run-time adapter (a LoRA job on an
    engine with `lora_flags`): the base then serves as BASE_MODEL_NAME."""
    return lora and profile.lora_adapters and bool(profile.lora_flags)


def engine_command(profile: EngineProfile, port: int, served: str, dtype: str, initial: str,
                   lora: int | None = None) -> list[str]:
    """The profile's command line, formatted (`dtype` as sync.dtype spells it). `lora`: a
    LoRA job's rank: the engine's `lora_flags` follow, and where the policy is an adapter
    (`adapter_policy`) the base serves as BASE_MODEL_NAME and `served` is the adapter's."""
    values = {"port": str(port), "served": BASE_MODEL_NAME if adapter_policy(profile, lora is not None) else served,
              "dtype": ENGINE_DTYPES[dtype], "initial": initial}
    if lora is not None:
        values["lora_rank"] = str(lora_rank(profile, lora))
    flags = profile.lora_flags if lora is not None else ()
    return [part.format(**values) for part in (*profile.command, *flags)]
