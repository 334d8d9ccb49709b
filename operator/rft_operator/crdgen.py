"""Generate the RFTJob CustomResourceDefinition from the pydantic models.

    python -m rft_operator.crdgen > crds/rftjob.yaml

pydantic emits JSON Schema (with `$ref`s, `anyOf` for optionals, titles and defaults);
Kubernetes wants a *structural* OpenAPI v3 schema: every node typed, no `$ref`, no
defaults we did not mean, CEL rules as `x-kubernetes-validations`, list types (`set`, or
`map` with its keys) as the models' `json_schema_extra` says. `to_structural` does that
conversion; the test suite fails when the committed file differs from its output.
"""

from __future__ import annotations

import sys
from typing import Any

import yaml

from rft_contract import names, spec as api, status
from rft_contract.spec import ADMISSION_REQUIRED

# JSON Schema keys that carry over to OpenAPI v3 unchanged.
_KEEP = {
    "description", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
    "minLength", "maxLength", "pattern", "enum", "minItems", "maxItems",
    "minProperties", "maxProperties", "format", "nullable",
    "x-kubernetes-list-type", "x-kubernetes-list-map-keys",
}


def _resolve(node: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    if "$ref" in node:
        name = node["$ref"].rsplit("/", 1)[-1]
        merged = dict(defs[name])
        merged.update({k: v for k, v in node.items() if k != "$ref"})
        return merged
    return node


def _collapse_optional(node: dict[str, Any]) -> dict[str, Any]:
    """`X | None` arrives as anyOf[X, null]; optionality is expressed by `required`."""
    options = [o for o in node.get("anyOf", []) if o.get("type") != "null"]
    if "anyOf" not in node or len(options) != 1:
        return node
    merged = dict(options[0])
    merged.update({k: v for k, v in node.items() if k != "anyOf"})
    if "rules" in options[0] and "rules" in node:  # the type's rules and the field's
        merged["rules"] = options[0]["rules"] + node["rules"]
    return merged


def _is_int_or_string(node: dict[str, Any]) -> bool:
    types = sorted(o.get("type", "") for o in node.get("anyOf", []))
    return types == ["integer", "string"]


def to_structural(node: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    """Convert one pydantic JSON-schema node (recursively) to structural OpenAPI v3."""
    node = _collapse_optional(_resolve(node, defs))
    node = _collapse_optional(_resolve(node, defs))  # a $ref inside the optional
    if _is_int_or_string(node):
        out: dict[str, Any] = {"x-kubernetes-int-or-string": True}
        out.update({k: node[k] for k in ("description", "maxLength") if k in node})
        if node.get("rules"):
            out["x-kubernetes-validations"] = node["rules"]
        return out
    if "anyOf" in node:
        raise ValueError(f"cannot express anyOf in a structural schema: {node}")

    out = {k: v for k, v in node.items() if k in _KEEP}
    # JSON Schema 2020 writes exclusive bounds as numbers; OpenAPI v3.0 as booleans.
    for bound, exclusive in (("minimum", "exclusiveMinimum"), ("maximum", "exclusiveMaximum")):
        if isinstance(out.get(exclusive), (int, float)) and not isinstance(out[exclusive], bool):
            out[bound], out[exclusive] = out[exclusive], True
    if "const" in node:
        out["enum"] = [node["const"]]
    typ = node.get("type")
    if typ is None and "enum" in node:
        typ = "string"
    if typ == "object" or "properties" in node or "additionalProperties" in node:
        out["type"] = "object"
        props = node.get("properties", {})
        if props:
            out["properties"] = {k: to_structural(v, defs) for k, v in props.items()}
        required = list(node.get("required", []))
        required += [k for k, v in props.items() if v.get(ADMISSION_REQUIRED) and k not in required]
        if required:
            out["required"] = required
        extra = node.get("additionalProperties")
        if isinstance(extra, dict) and extra:
            out["additionalProperties"] = to_structural(extra, defs)
        elif extra is True or (not props and extra is None):
            out["x-kubernetes-preserve-unknown-fields"] = True
    elif typ == "array":
        out["type"] = "array"
        # A fixed-length tuple (prefixItems) of one item type: an array with min = max items.
        items = node.get("items") or (node.get("prefixItems") or [{}])[0]
        out["items"] = to_structural(items, defs)
    elif typ is not None:
        out["type"] = typ
    else:
        out["x-kubernetes-preserve-unknown-fields"] = True
    if node.get("x-kubernetes-preserve-unknown-fields"):
        out["x-kubernetes-preserve-unknown-fields"] = True
    if node.get("rules"):
        out["x-kubernetes-validations"] = node["rules"]
    return out


def _status_schema() -> dict[str, Any]:
    schema = status.RFTJobStatus.model_json_schema(by_alias=True, mode="serialization")
    out = to_structural(schema, schema.get("$defs", {}))
    # The trainer adds fields of its own here (the sync agents inside their replica entries,
    # whose model allows extra fields).
    out["properties"]["trainer"]["x-kubernetes-preserve-unknown-fields"] = True
    return out


def build_crd() -> dict[str, Any]:
    spec_schema = api.RFTJobSpec.model_json_schema(by_alias=True, mode="validation")
    spec = to_structural(spec_schema, spec_schema.get("$defs", {}))
    spec["description"] = "Desired state of a reinforcement fine-tuning job."
    root = {
        "type": "object",
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
            "spec": spec,
            "status": _status_schema(),
        },
        "x-kubernetes-validations": api.ROOT_RULES,
    }
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{names.PLURAL}.{names.GROUP}"},
        "spec": {
            "group": names.GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": names.KIND,
                "listKind": f"{names.KIND}List",
                "plural": names.PLURAL,
                "singular": names.SINGULAR,
                "shortNames": [names.SHORT_NAME],
                "categories": [names.CATEGORY],
            },
            "versions": [
                {
                    "name": names.VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": status.PRINTER_COLUMNS,
                    "schema": {"openAPIV3Schema": root},
                }
            ],
        },
    }


def render() -> str:
    header = "# Generated by `python -m rft_operator.crdgen` from rft_contract/spec.py and status.py. Do not edit.\n"
    return header + yaml.safe_dump(build_crd(), sort_keys=False, width=100)


def main() -> None:
    sys.stdout.write(render())


if __name__ == "__main__":
    main()
