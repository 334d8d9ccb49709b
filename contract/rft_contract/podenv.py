"""The knobs a pod's environment sets beside its config file, read once (`PodEnv.read`).

The operator sets the paths of the volumes it mounts (`RFT_MODEL_CACHE`,
`RFT_STAGING_DIR`) and the model download timeout (from `spec.model.cache`); a user may set
the S3 ones through `trainer.env`. `load_config` reads them into `JobConfig.env`, and the
pod's objects take their values from there: nothing else in the trainer, the explorer or
the sync agent reads these variables. Outside a pod (a library call, a test, a benchmark)
a constructor given no `PodEnv` reads the process environment through the same parser.

A bad value is a config error naming the variable: `RFT_S3_RETRY_SECONDS='soon': ...`.
"""

from __future__ import annotations

import os
import tempfile
from typing import Literal, Mapping

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .names import ENV_POD_IP, ENV_STAGING_DIR, ENV_WEIGHTS_PEER_PORT, ENV_WEIGHTS_TRANSPORT

DEFAULT_S3_RETRY_SECONDS = 300.0
DEFAULT_MODEL_DOWNLOAD_TIMEOUT = 3600.0

# field -> the variable that sets it: the one list of these knobs.
VARIABLES: dict[str, str] = {
    "ckpt_staging": "RFT_CKPT_STAGING",
    "staging_dir": ENV_STAGING_DIR,
    "model_cache": "RFT_MODEL_CACHE",
    "model_download_timeout": "RFT_MODEL_DOWNLOAD_TIMEOUT",
    "s3_retry_seconds": "RFT_S3_RETRY_SECONDS",
    "s3_addressing": "RFT_S3_ADDRESSING",
    "pod_ip": ENV_POD_IP,
    "weights_peer_port": ENV_WEIGHTS_PEER_PORT,
    "weights_transport": ENV_WEIGHTS_TRANSPORT,
}


def _tmp(name: str) -> str:
    return os.path.join(tempfile.gettempdir(), name)


class PodEnv(BaseModel):
    """What the variables in `VARIABLES` say, with their defaults."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    ckpt_staging: str = Field(default_factory=lambda: _tmp("rft-ckpt"), min_length=1,
                              description="Each rank's local staging dir for checkpoint saves.")
    staging_dir: str | None = Field(default=None, min_length=1, description=(
        "The node's shared resume download dir (the operator's staging volume); unset: every "
        "rank downloads into ckpt_staging."))
    model_cache: str = Field(default_factory=lambda: _tmp("rft-models"), min_length=1,
                             description="Where an s3:// model is downloaded, once per node.")
    model_download_timeout: float = Field(default=DEFAULT_MODEL_DOWNLOAD_TIMEOUT, gt=0, allow_inf_nan=False,
                                          description="Seconds every rank waits for the model download.")
    s3_retry_seconds: float = Field(default=DEFAULT_S3_RETRY_SECONDS, ge=0, allow_inf_nan=False, description=(
        "How long an S3 request that keeps failing transiently is retried (s3.DeadlineRetries)."))
    s3_addressing: Literal["auto", "path", "virtual"] = Field(
        default="auto", description="botocore's addressing_style.")
    pod_ip: str | None = Field(default=None, min_length=1, description=(
        "The pod's IP (the downward API): where peers reach its weights server."))
    weights_peer_port: int = Field(default=0, ge=0, le=65535, description=(
        "Trainer rank 0 serves each exported version on this port (the fast path) while it "
        "uploads it to S3; 0: off, the replicas read S3 once the upload is committed."))
    weights_transport: Literal["files", "nccl"] = Field(default="files", description=(
        "nccl: rank 0's weights server also sends each version to vLLM engines over NCCL "
        "(spec.sync.transport; rft_trainer.nccl_sender)."))

    @classmethod
    def read(cls, env: Mapping[str, str] | None = None) -> "PodEnv":
        """The knobs set in `env` (default: the process environment); an empty variable is
        unset. Raises ValueError naming the variable and its value."""
        env = os.environ if env is None else env
        raw = {field: env[var] for field, var in VARIABLES.items() if env.get(var)}
        try:
            return cls.model_validate(raw)
        except ValidationError as e:
            err = e.errors()[0]
            field = str(err["loc"][0])
            raise ValueError(f"{VARIABLES[field]}={raw.get(field)!r}: {_plain(err)}") from None


def _plain(err: dict) -> str:
    """pydantic's message in the words of an env variable."""
    if err["type"] in ("float_parsing", "float_type"):
        return "not a number of seconds"
    if err["type"] in ("int_parsing", "int_type"):
        return "not a whole number"
    if err["type"] == "finite_number":
        return "must be a finite number"
    return err["msg"][0].lower() + err["msg"][1:]
