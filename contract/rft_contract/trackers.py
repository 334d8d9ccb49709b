"""The tracker catalogue: one `TrackerProfile` per `spec.tracking.<name>`, the single place its
Secret facts live (torch-free: the operator, its owner webhook and the trainer read it).

Derived from it:
- the trainer and explorer pods' secretKeyRefs (`rft_operator.objects.build_tracking_env`);
- the Secrets a job's pods may read (`rft_operator.ownerhook.spec_secrets`, and its message);
- the variables whose values are scrubbed from logs and status (`rft_trainer.tracking.SECRET_ENV`);
- the trainer's backends, registered under the same names (`rft_trainer.tracking.BACKENDS`).

Adding a tracker is one line here, its settings in `spec.TrackingSpec` (a section named as
the entry), and its backend in `rft_trainer/tracking.py` (docs/design.md, "How to add").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic.alias_generators import to_camel


@dataclass(frozen=True)
class SecretKey:
    name: str  # the key in the Secret, given to the pods as the variable of the same name
    optional: bool  # the pod starts without it
    redact: bool = True  # its value never appears in a log line, an event or the status


@dataclass(frozen=True)
class TrackerProfile:
    name: str  # spec.tracking.<name>, status.trainer.tracking.<name>, the backend's name
    secret_field: str | None = None  # the field of spec.tracking.<name> naming its Secret (Python's name)
    secret_keys: tuple[SecretKey, ...] = ()
    package: str | None = None  # the client library the trainer image installs (pyproject.toml)

    @property
    def secret_path(self) -> str | None:
        """The Secret's field as the RFTJob spells it, e.g. tracking.wandb.apiKeySecret."""
        return f"tracking.{self.name}.{to_camel(self.secret_field)}" if self.secret_field else None

    def secret_in(self, tracking: Any) -> str | None:
        """The Secret this tracker's section names in `spec.tracking`: the parsed model, or
        the stored object (camelCase keys)."""
        if not self.secret_field or tracking is None:
            return None
        if isinstance(tracking, dict):
            return (tracking.get(self.name) or {}).get(to_camel(self.secret_field))
        section = getattr(tracking, self.name, None)
        return getattr(section, self.secret_field, None) if section is not None else None


TRACKERS: dict[str, TrackerProfile] = {p.name: p for p in (
    TrackerProfile("tensorboard", package="tensorboardX"),
    # MLflow takes a username and password or a token, so each is optional.
    TrackerProfile("mlflow", "credentials_secret", (SecretKey("MLFLOW_TRACKING_USERNAME", True, redact=False),
                                                    SecretKey("MLFLOW_TRACKING_PASSWORD", True),
                                                    SecretKey("MLFLOW_TRACKING_TOKEN", True)), package="mlflow-skinny"),
    # W&B online mode needs its key.
    TrackerProfile("wandb", "api_key_secret", (SecretKey("WANDB_API_KEY", False),), package="wandb"),
)}

# The rollouts tables (`spec.tracking.rolloutSamples`, rft_trainer.tracking.log_samples).
DEFAULT_ROLLOUT_SAMPLES = 4  # rows per step unless the spec says
MAX_SAMPLE_CHARS = 2000  # of a text cell, after scrubbing
# What of a task's text the explorer keeps in a sample's info: the cell's length plus room
# for the scrubbing to see a whole secret that straddles the cut.
PROMPT_INFO_CHARS = MAX_SAMPLE_CHARS + 512

REDACTED_ENV: tuple[str, ...] = tuple(k.name for p in TRACKERS.values() for k in p.secret_keys if k.redact)
SECRET_PATHS: tuple[str, ...] = tuple(p.secret_path for p in TRACKERS.values() if p.secret_path)
