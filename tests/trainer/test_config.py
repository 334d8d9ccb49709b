"""Config loading: the operator's real JSON, typos, types, ranges, defaults."""

from __future__ import annotations

import copy
import json

import pytest

from rft_contract.spec import parse_spec
from rft_operator.builders import JobRef, build_trainer_config
from rft_contract.config import ConfigError, load_config
from rft_contract.config import JobConfig as Config
from rft_contract.spec import AlgorithmSpec as AlgorithmConfig
from rft_contract.spec import FSDPSpec as FSDPConfig
from rft_contract.spec import OptimizerSpec as OptimizerConfig

SPEC = {
    "model": {"path": "s3://models/tiny-qwen"},
    "algorithm": {"name": "ppo", "learningRate": 2e-6, "miniBatchSize": 8, "microBatchSize": 2},
    "trainer": {
        "image": "ghcr.io/rft-dev/trainer:0.1.0",
        "nodes": 2,
        "gpusPerNode": 8,
        "totalSteps": 100,
        "batchSize": 64,
        "fsdp": {"cpuOffload": True},
        "resources": {"requests": {"cpu": "8"}},
    },
    "checkpoint": {"uri": "s3://ckpts/demo", "interval": 10, "credentialsSecret": "s3-creds",
                   "endpoint": "http://minio.storage:9000"},
    "inference": {"replicas": 2},
    "explorer": {"tasksetUri": "s3://data/gsm8k"},
    "buffer": {"maxStaleness": 2},
    "sync": {"interval": 5},
}
ENV = {"RFT_JOB_NAME": "demo", "RFT_JOB_NAMESPACE": "team-a", "RFT_ATTEMPT": "3",
       "RFT_POD_NAME": "demo-trainer-3-0"}


@pytest.fixture
def operator_json() -> dict:
    """Exactly what the operator writes into the ConfigMap."""
    data = build_trainer_config(JobRef("demo", "team-a", "uid-1"), parse_spec(copy.deepcopy(SPEC)))
    return json.loads(json.dumps(data))


def error(data: dict) -> str:
    with pytest.raises(ConfigError) as e:
        load_config(data, env={})
    return str(e.value)


def test_loads_the_operators_config(operator_json):
    cfg = load_config(operator_json, env=ENV)
    assert cfg.model.path == "s3://models/tiny-qwen"
    assert cfg.algorithm.name == "ppo" and cfg.algorithm.learning_rate == 2e-6
    assert (cfg.algorithm.mini_batch_size, cfg.algorithm.micro_batch_size) == (8, 2)
    assert (cfg.trainer.total_steps, cfg.trainer.batch_size) == (100, 64)
    assert cfg.fsdp.cpu_offload is True and cfg.fsdp.mixed_precision == "bf16"
    assert cfg.checkpoint.interval == 10 and cfg.checkpoint.endpoint == "http://minio.storage:9000"
    assert cfg.buffer.max_staleness == 2 and cfg.sync.interval == 5
    assert (cfg.job.name, cfg.job.namespace, cfg.job.uid) == ("demo", "team-a", "uid-1")
    assert (cfg.job.attempt, cfg.job.pod) == (3, "demo-trainer-3-0")


def test_defaults(operator_json):
    cfg = load_config(operator_json, env={})
    assert cfg.optimizer == OptimizerConfig()
    assert cfg.optimizer.lr_schedule == "constant" and cfg.optimizer.betas == (0.9, 0.999)
    assert cfg.algorithm.cliprange_value == 0.5 and cfg.algorithm.use_kl_loss is True
    assert cfg.trainer.seed == 0 and cfg.reporting.log_every == 1
    assert cfg.model.dtype == "fp32"
    # Unset buffer settings resolve from the rest of the config (docs/design.md, S3 layout).
    assert cfg.buffer.uri == "s3://ckpts/demo/buffer"
    assert cfg.job.attempt == 0 and cfg.job.pod == ""


def test_minimal_hand_written_config():
    cfg = load_config({
        "model": {"path": "/models/tiny"},
        "algorithm": {"name": "grpo"},
        "trainer": {"total_steps": 3, "batch_size": 4},
        "checkpoint": {"uri": "/tmp/ckpt"},
    }, env={})
    assert cfg.fsdp == FSDPConfig() and cfg.algorithm == AlgorithmConfig(name="grpo")


def test_round_trip_through_to_dict(operator_json):
    cfg = load_config(operator_json, env=ENV)
    data = cfg.to_dict()
    assert data["trainer"]["fsdp"]["cpu_offload"] is True and "fsdp" not in data
    assert load_config(json.loads(json.dumps(data)), env={}) == cfg


@pytest.mark.parametrize("section, key, message", [
    ("algorithm", "lerning_rate", "algorithm.lerning_rate: unknown key (did you mean learning_rate?)"),
    ("trainer", "total_step", "trainer.total_step: unknown key (did you mean total_steps?)"),
    ("checkpoint", "intervall", "checkpoint.intervall: unknown key (did you mean interval?)"),
    ("algorithm", "zzz", "algorithm.zzz: unknown key"),
])
def test_unknown_key_names_dotted_path_and_suggests(operator_json, section, key, message):
    operator_json[section][key] = 1
    assert error(operator_json) == message


def test_unknown_nested_and_top_level_keys(operator_json):
    bad = copy.deepcopy(operator_json)
    bad["trainer"]["fsdp"]["cpu_ofload"] = True
    assert error(bad) == "trainer.fsdp.cpu_ofload: unknown key (did you mean cpu_offload?)"
    bad = copy.deepcopy(operator_json)
    bad["algoritm"] = {}
    assert error(bad) == "algoritm: unknown key (did you mean algorithm?)"


def test_operator_only_keys_are_ignored(operator_json):
    # trainer.image, masterPort, ... are the pod spec's (rft_contract.podconfig): not written ...
    assert operator_json["inference"] and not {"image", "master_port", "resources"} & set(operator_json["trainer"])
    # ... and a config that has them (the previous release's, a hand-written one) still loads.
    load_config({**operator_json, "trainer": {**operator_json["trainer"], "image": "x:1", "master_port": 29500}},
                env={})


@pytest.mark.parametrize("path, value, message", [
    (("algorithm", "learning_rate"), "fast", "algorithm.learning_rate: expected float, got str 'fast'"),
    (("trainer", "batch_size"), 4.5, "trainer.batch_size: expected int, got float 4.5"),
    (("trainer", "total_steps"), True, "trainer.total_steps: expected int, got bool True"),
    (("trainer", "fsdp", "cpu_offload"), "yes", "trainer.fsdp.cpu_offload: expected bool, got str 'yes'"),
    (("algorithm", "name"), "dpo", "algorithm.name: must be one of 'grpo', 'ppo', 'reinforce_plus_plus', got 'dpo'"),
    (("model",), "x", "model: expected a mapping, got str"),
])
def test_wrong_types(operator_json, path, value, message):
    target = operator_json
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    assert error(operator_json) == message


@pytest.mark.parametrize("section, key, value, message", [
    ("algorithm", "clip_ratio", 1.5, "algorithm.clip_ratio: must be < 1, got 1.5"),
    ("algorithm", "learning_rate", 0, "algorithm.learning_rate: must be > 0, got 0.0"),
    ("trainer", "total_steps", 0, "trainer.total_steps: must be >= 1, got 0"),
    ("buffer", "max_staleness", -1, "buffer.max_staleness: must be >= 0, got -1"),
    ("optimizer", "betas", [0.9, 1.0], "optimizer.betas[1]: must be < 1, got 1.0"),
    ("optimizer", "betas", [0.9], "optimizer.betas: expected a list of 2 numbers, got [0.9]"),
    ("algorithm", "micro_batch_size", 16,
     "algorithm.micro_batch_size: must not exceed algorithm.mini_batch_size (16 > 8)"),
])
def test_out_of_range(operator_json, section, key, value, message):
    operator_json.setdefault(section, {})[key] = value
    assert error(operator_json) == message


def test_missing_required(operator_json):
    del operator_json["trainer"]["total_steps"]
    assert error(operator_json) == "trainer.total_steps: required key is missing"
    del operator_json["model"]
    assert error(operator_json) == "model: required section is missing"


def test_bad_attempt_env(operator_json):
    with pytest.raises(ConfigError, match="RFT_ATTEMPT"):
        load_config(operator_json, env={"RFT_ATTEMPT": "two"})


def test_json_and_yaml_files(tmp_path, operator_json, monkeypatch):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(operator_json))
    monkeypatch.setenv("RFT_CONFIG", str(path))
    assert load_config().trainer.batch_size == 64  # default path from $RFT_CONFIG
    yaml_path = tmp_path / "config.yaml"
    # PyYAML alone reads 1e-6 as a string; learning rates are written like that.
    yaml_path.write_text(
        "model: {path: /m}\nalgorithm:\n  name: grpo\n  learning_rate: 1e-6\n"
        "trainer: {total_steps: 2, batch_size: 2, fsdp: {mixed_precision: fp32}}\n"
        "checkpoint: {uri: /tmp/c}\noptimizer: {lr_schedule: cosine, warmup_steps: 5}\n"
    )
    cfg = load_config(yaml_path, env={})
    assert isinstance(cfg, Config) and cfg.algorithm.learning_rate == 1e-6
    assert cfg.fsdp.mixed_precision == "fp32" and cfg.optimizer.lr_schedule == "cosine"
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    with pytest.raises(ConfigError, match="broken.json: not valid json"):
        load_config(broken, env={})
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.json", env={})


def test_config_is_frozen(operator_json):
    cfg = load_config(operator_json, env={})
    with pytest.raises(AttributeError):
        cfg.trainer.batch_size = 1  # type: ignore[misc]


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d["trainer"].update(resources={"requests": {"cpu": 1.5}}),
     "trainer.resources.requests.cpu: expected int or str, got float 1.5"),
    (lambda d: d.setdefault("optimizer", {}).update(betas=[0.9, 0.99, 0.999]),
     "optimizer.betas: expected a list of 2 numbers, got [0.9, 0.99, 0.999]"),
    (lambda d: d.setdefault("optimizer", {}).update(betas="x"),
     "optimizer.betas: expected a list of 2 numbers, got 'x'"),
    (lambda d: d.update(fsdp={}), "fsdp: unknown key (did you mean trainer.fsdp?)"),
    (lambda d: d.update(algorithm=None), "algorithm: required section is missing"),
    (lambda d: d["checkpoint"].update(uri=""), "checkpoint.uri: must not be empty"),
])
def test_messages_name_the_key_in_the_users_words(operator_json, mutate, message):
    """The contract's wording (rft_contract.errors) for cases pydantic words its own way:
    union members, tuples, a section one level too high, a null section."""
    mutate(operator_json)
    assert error(operator_json) == message


def test_operator_and_pods_word_errors_alike(operator_json):
    """The operator parses the camelCase spec, pods the snake_case config: same message,
    each in its own spelling."""
    from rft_contract.spec import parse_spec

    spec = copy.deepcopy(SPEC)
    spec["algorithm"]["lerningRate"] = 1
    with pytest.raises(ValueError) as e:
        parse_spec(spec)
    assert str(e.value) == "spec.algorithm.lerningRate: unknown key (did you mean learningRate?)"
