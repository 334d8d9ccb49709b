"""The knobs a pod's environment sets are read once, by one parser, into the config
(`rft_contract.podenv`), and nothing else reads them."""

import ast
from pathlib import Path

import pytest

from rft_contract import names
from rft_contract.config import ConfigError, load_config
from rft_contract.podenv import VARIABLES, PodEnv

ROOT = Path(__file__).resolve().parents[2]
MINIMAL = {"model": {"path": "/models/tiny"}, "algorithm": {"name": "grpo"},
           "trainer": {"total_steps": 1, "batch_size": 1}, "checkpoint": {"uri": "/ckpt"}}


def test_each_variable_sets_its_field_and_an_empty_one_is_unset():
    env = {"RFT_CKPT_STAGING": "/save", "RFT_STAGING_DIR": "/staging", "RFT_MODEL_CACHE": "/models",
           "RFT_MODEL_DOWNLOAD_TIMEOUT": "600", "RFT_S3_RETRY_SECONDS": "2.5", "RFT_S3_ADDRESSING": "path",
           "RFT_POD_IP": "10.0.0.7", "RFT_WEIGHTS_PEER_PORT": "8471", "RFT_WEIGHTS_TRANSPORT": "nccl"}
    assert set(env) == set(VARIABLES.values())
    got = PodEnv.read(env)
    assert (got.ckpt_staging, got.staging_dir, got.model_cache) == ("/save", "/staging", "/models")
    assert (got.model_download_timeout, got.s3_retry_seconds, got.s3_addressing) == (600.0, 2.5, "path")
    assert (got.pod_ip, got.weights_peer_port, got.weights_transport) == ("10.0.0.7", 8471, "nccl")
    assert PodEnv.read({"RFT_S3_RETRY_SECONDS": ""}) == PodEnv.read({})
    default = PodEnv.read({})
    assert default.staging_dir is None and default.s3_retry_seconds == 300 and default.s3_addressing == "auto"


@pytest.mark.parametrize("var, raw, words", [
    ("RFT_S3_RETRY_SECONDS", "soon", "not a number of seconds"),
    ("RFT_S3_RETRY_SECONDS", "-1", "greater than or equal to 0"),
    ("RFT_S3_RETRY_SECONDS", "nan", "finite"),
    ("RFT_MODEL_DOWNLOAD_TIMEOUT", "0", "greater than 0"),
    ("RFT_MODEL_DOWNLOAD_TIMEOUT", "1h", "not a number of seconds"),
    ("RFT_S3_ADDRESSING", "dns", "'auto', 'path' or 'virtual'"),
    ("RFT_WEIGHTS_PEER_PORT", "http", "not a whole number"),
    ("RFT_WEIGHTS_PEER_PORT", "70000", "less than or equal to 65535"),
    ("RFT_WEIGHTS_TRANSPORT", "tcp", "'files' or 'nccl'"),
])
def test_a_bad_value_is_named_by_its_variable_in_every_pod(var, raw, words):
    with pytest.raises(ValueError) as e:
        PodEnv.read({var: raw})
    assert str(e.value).startswith(f"{var}={raw!r}: ") and words in str(e.value)
    with pytest.raises(ConfigError) as e:  # what the trainer and the explorers exit 78 with
        load_config(MINIMAL, env={var: raw})
    assert f"{var}={raw!r}" in str(e.value)


def test_the_config_carries_them_but_its_file_and_hash_do_not():
    cfg = load_config(MINIMAL, env={"RFT_STAGING_DIR": "/staging", "RFT_S3_RETRY_SECONDS": "7"})
    assert cfg.env.staging_dir == "/staging" and cfg.env.s3_retry_seconds == 7
    assert "env" not in cfg.to_dict()  # not in the file format, nor in checkpoint.config_hash
    assert load_config(cfg.to_dict(), env={}).env == PodEnv.read({})
    with pytest.raises(ConfigError, match=r"^env: not a config key"):
        load_config({**MINIMAL, "env": {"staging_dir": "/x"}}, env={})


def test_the_operator_sets_them_by_the_same_names():
    from rft_contract.spec import RFTJobSpec
    from rft_operator.objects import JobRef
    from rft_operator.trainer_pods import build_trainer_env

    spec = RFTJobSpec.model_validate({**MINIMAL, "trainer": {**MINIMAL["trainer"], "image": "t:1"}})
    env = {e["name"]: e.get("value") for e in build_trainer_env(JobRef("j", "ns", "u"), spec, 0)}
    read = PodEnv.read({k: v for k, v in env.items() if isinstance(v, str)})
    assert read.model_cache == env[VARIABLES["model_cache"]] and read.staging_dir == env[VARIABLES["staging_dir"]]
    assert read.model_download_timeout == spec.model.cache.download_timeout_seconds


def _reads_of_the_environment(path: Path) -> list[tuple[int, str]]:
    """(line, variable) of each os.environ[...] / .get(...) / os.getenv(...) with a literal name."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        name = None
        if isinstance(node, ast.Subscript) and ast.unparse(node.value).endswith("environ"):
            name = node.slice
        elif isinstance(node, ast.Call) and node.args and (
                ast.unparse(node.func).endswith(("environ.get", "getenv", "environ.setdefault"))):
            name = node.args[0]
        if isinstance(name, (ast.Name, ast.Attribute)):  # a constant of names.py, e.g. ENV_STAGING_DIR
            name = ast.Constant(getattr(names, ast.unparse(name).rpartition(".")[2], None))
        if isinstance(name, ast.Constant) and isinstance(name.value, str):
            found.append((node.lineno, name.value))
    return found


def test_nothing_but_podenv_reads_these_variables():
    knobs = set(VARIABLES.values())
    offenders = []
    for package in ("contract/rft_contract", "trainer_image", "operator/rft_operator"):
        for path in sorted((ROOT / package).rglob("*.py")):
            if path.name == "podenv.py":
                continue
            offenders += [f"{path.relative_to(ROOT)}:{line} reads {var}"
                          for line, var in _reads_of_the_environment(path) if var in knobs]
    assert not offenders, offenders


def test_the_scanner_sees_a_read():
    """The test above would pass on a scanner that finds nothing."""
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write("import os\na = os.environ.get('RFT_S3_ADDRESSING', 'auto')\nb = os.environ['RFT_MODEL_CACHE']\n"
                "c = os.getenv('RFT_CKPT_STAGING')\nd = os.environ.get(names.ENV_STAGING_DIR)\n")
    assert [v for _, v in _reads_of_the_environment(Path(f.name))] == [
        "RFT_S3_ADDRESSING", "RFT_MODEL_CACHE", "RFT_CKPT_STAGING", "RFT_STAGING_DIR"]
