"""A live child against the operator's render: whose it is (`classify_owner`: never adopt),
whether it still holds what was rendered (`covers`), and the patch that brings it back.

Pure, no I/O: the controller and the reconcile's static children read the live objects.
"""

from __future__ import annotations

import copy
import json
from typing import Any

from rft_contract.names import ANNOTATION_MANAGED_KEYS, GROUP, LABEL_MANAGED_BY

OURS, PREVIOUS, FOREIGN = "ours", "previous", "foreign"


def classify_owner(live_meta: dict[str, Any], job_name: str, job_uid: str, job_kind: str) -> str:
    """Whose is an existing child named like one of ours? `ours` when its controller
    ownerReference is this job (by uid); `previous` when it is a deleted job of the same
    name (another uid: the garbage collector is removing it, wait); `foreign` otherwise
    (no controller, or another controller): never adopt it."""
    ref = next((r for r in live_meta.get("ownerReferences") or [] if r.get("controller")), None)
    if ref is None:
        return FOREIGN
    if ref.get("uid") == job_uid:
        return OURS
    if ref.get("kind") == job_kind and ref.get("name") == job_name:
        return PREVIOUS
    return FOREIGN


def covers(live: Any, want: Any) -> bool:
    """Whether the live value still holds everything the operator rendered: every key of
    a rendered dict with a covering value (the API server's defaults, e.g. a port's
    protocol, are extra keys and fine), lists element by element with the same length
    (an added port or subject is drift), scalars equal."""
    if isinstance(want, dict):
        return isinstance(live, dict) and all(k in live and covers(live[k], v) for k, v in want.items())
    if isinstance(want, list):
        return isinstance(live, list) and len(live) == len(want) and all(map(covers, live, want))
    return live == want


def is_our_key(key: str) -> bool:
    """A label or annotation key in the operator's own namespaces."""
    return key.startswith(f"{GROUP}/") or key == LABEL_MANAGED_BY


def compute_patch(rendered: dict[str, Any], live: dict[str, Any] | None) -> dict[str, Any]:
    """The merge patch that brings a live child back to `rendered`: the rendered object,
    plus null for each label and annotation the live object has, the operator rendered
    before and no longer renders. Ours are the keys in our namespaces (`is_our_key`) and
    the ones the previous render listed in `rft.dev/managed-keys`; any other key (the API
    server's, another controller's, a user's) stays. `live`: the child's live fields
    (`model.managed_fields`) or the whole object."""
    meta = (live or {}).get("metadata") or {}
    listed = json.loads((meta.get("annotations") or {}).get(ANNOTATION_MANAGED_KEYS) or "{}")
    out = copy.deepcopy(rendered)
    for part in ("labels", "annotations"):
        want = out["metadata"].get(part) or {}
        stale = {k: None for k in meta.get(part) or {}
                 if k not in want and (is_our_key(k) or k in listed.get(part, ()))}
        if stale:
            out["metadata"][part] = {**want, **stale}
    return out


def build_managed_keys(meta: dict[str, Any]) -> str:
    """The `rft.dev/managed-keys` value for rendered metadata: its label and annotation
    keys outside our namespaces (e.g. spec.serviceAccountAnnotations), so the next render
    knows to remove those it drops; "" when there are none."""
    keys = {part: sorted(k for k in meta.get(part) or {} if not is_our_key(k)) for part in ("labels", "annotations")}
    keys = {part: v for part, v in keys.items() if v}
    return json.dumps(keys, sort_keys=True, separators=(",", ":")) if keys else ""
