"""The adversarial admission corpus (tests/integration/admission/): the API server itself
must refuse every manifest under invalid/, with a message naming the field, and accept
every manifest under valid/ unchanged. Each file is one RFTJob; its leading comments say
what to expect:

    # expect: <fragment of the API server's message>   (invalid/ only; names the field;
                                                          several lines: each must appear)
    # status: 400         the HTTP status when not 422 (unknown fields: strict decoding)
    # causes: 2           the number of errors when not exactly one
    # secret: <text>      must not appear in the message (a credential in the manifest)
    # admission-only: ... parse_spec need not refuse it (tests/unit/test_api.py)

Server-side dry runs with strict field validation, as `kubectl apply --dry-run=server
--validate=strict` does: nothing is stored, so every case can use the same name.
"""

from __future__ import annotations

import json
from pathlib import Path

import kubernetes
import pytest
import yaml
from kubernetes.client.rest import ApiException

from rft_contract import names
from rft_contract.spec import parse_spec



pytestmark = pytest.mark.integration

CORPUS = Path(__file__).parent / "admission"
# Added by the API server when a schema error kept CEL rules from running: not a cause.
_NOT_CHECKED = "some validation rules were not checked"


def corpus(kind: str) -> list[Path]:
    return sorted((CORPUS / kind).glob("*.yaml"))


def load(path: Path) -> tuple[dict[str, list[str]], dict]:
    """The header comments (`# key: value` lines before the manifest) and the manifest."""
    text = path.read_text()
    header: dict[str, list[str]] = {}
    for line in text.splitlines():
        if not line.startswith("# "):
            break
        key, _, value = line[2:].partition(": ")
        header.setdefault(key, []).append(value)
    return header, yaml.safe_load(text)


def dry_run(api, namespace: str, manifest: dict, strict: bool = True) -> dict:
    return kubernetes.client.CustomObjectsApi(api).create_namespaced_custom_object(
        names.GROUP, names.VERSION, namespace, names.PLURAL, manifest, dry_run="All",
        field_validation="Strict" if strict else "Ignore")


def refusal(e: ApiException) -> tuple[str, list[str]]:
    """The Status message and its causes (minus the "not checked" note)."""
    body = json.loads(e.body)
    causes = [x.get("message", "") for x in (body.get("details") or {}).get("causes", [])]
    return body.get("message", ""), [x for x in causes if _NOT_CHECKED not in x]


def test_corpus_covers_enough_cases():
    invalid, valid = corpus("invalid"), corpus("valid")
    assert len(invalid) >= 110 and len(valid) >= 25, (len(invalid), len(valid))
    for path in invalid:
        expect = load(path)[0].get("expect", [""])[0]
        assert expect.startswith(("spec", "metadata.name", "unknown field")), f"{path.name}: name the field first"


@pytest.mark.parametrize("path", corpus("invalid"), ids=lambda p: p.stem)
def test_invalid_manifest_is_refused(installed, api, namespace, path):
    header, manifest = load(path)
    with pytest.raises(ApiException) as e:
        dry_run(api, namespace, manifest)
    message, causes = refusal(e.value)
    assert e.value.status == int(header.get("status", ["422"])[0]), message
    for fragment in header["expect"]:
        assert fragment in message, message
    for secret in header.get("secret", []):
        assert secret not in e.value.body, "the refusal echoes a credential"
    if e.value.status == 422:  # one reason per file: start from a valid base, change one thing
        assert len(causes) == int(header.get("causes", ["1"])[0]), message


@pytest.mark.parametrize("path", corpus("valid"), ids=lambda p: p.stem)
def test_valid_manifest_is_accepted(installed, api, namespace, path):
    _, manifest = load(path)
    created = dry_run(api, namespace, manifest)
    assert created["spec"] == manifest["spec"]  # nothing pruned, nothing defaulted
    parse_spec(created["spec"])  # and the operator parses what was stored


UNKNOWN = "serviceAccountName"  # removed from spec.trainer: the operator creates the accounts


def _with_unknown_field() -> dict:
    _, manifest = load(CORPUS / "valid" / "minimal.yaml")
    manifest["spec"]["trainer"][UNKNOWN] = "default"
    return manifest


def test_unknown_field_is_pruned_silently_without_strict_validation(installed, api, namespace):
    created = dry_run(api, namespace, _with_unknown_field(), strict=False)
    assert UNKNOWN not in created["spec"]["trainer"]


def test_unknown_field_is_refused_by_kubectl_strict_validation(installed, kubectl, namespace, tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(_with_unknown_field()))
    strict = kubectl("apply", "--dry-run=server", "--validate=strict", "-n", namespace, "-f", str(path), check=False)
    assert strict.returncode != 0 and f'unknown field "spec.trainer.{UNKNOWN}"' in strict.stderr, strict.stderr
    loose = kubectl("apply", "--dry-run=server", "--validate=false", "-n", namespace, "-f", str(path), check=False)
    assert loose.returncode == 0, loose.stderr
