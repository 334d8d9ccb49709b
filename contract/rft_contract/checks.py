"""Field formats and the rules that check them, each written once for both places.

A `Check` is a CEL rule for the API server (`x-kubernetes-validations` in the generated
CRD) and the same test in Python (run by pydantic when the operator or a pod parses a
spec), with one message that names the rule and never repeats the value. The formats
below are the ones Kubernetes, S3 and container registries apply themselves (qualified
names, label values, quantities, image references, bucket names, endpoints), so a spec
that would be refused later, by the pods' API or by S3, is refused at admission.
`rft_contract.spec` builds the RFTJob models from them.
"""

from __future__ import annotations

import re
from decimal import Decimal
from typing import Annotated, Any, Callable, NamedTuple

from pydantic import AfterValidator, Field

_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_SUBDOMAIN = rf"{_LABEL}(\.{_LABEL})*"
DNS_SUBDOMAIN = rf"^{_SUBDOMAIN}$"  # with max_length=253: Secret, PVC, PriorityClass names
_NAME = r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]"  # the name part of a qualified name
MAX_ID = 2**31 - 1  # the largest UID/GID a pod may name

# Container image references: [registry[:port]/]path[:tag][@sha256:digest]. A registry
# has a '.' or a port, or is localhost, so `Foo/bar` is a (refused) uppercase path.
_HOST = r"[a-zA-Z0-9]([-a-zA-Z0-9]*[a-zA-Z0-9])?"
_PORT = r"(:[0-9]{1,5})?"
_REGISTRY = rf"(localhost{_PORT}|{_HOST}(\.{_HOST})+{_PORT}|{_HOST}:[0-9]{{1,5}}|\[[0-9a-fA-F:]+\]{_PORT})"
_COMPONENT = r"[a-z0-9]+((\.|_|__|-+)[a-z0-9]+)*"
IMAGE = (rf"^({_REGISTRY}/)?{_COMPONENT}(/{_COMPONENT})*"
         r"(:[a-zA-Z0-9_][a-zA-Z0-9_.-]{0,127})?(@sha256:[a-f0-9]{64})?$")

BUILTIN_REWARDS = ("math_accuracy", "format", "math_accuracy_format")  # rft_rollout.rewards
_IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
REWARD_REF = rf"^{_IDENT}(\.{_IDENT})*:{_IDENT}(\.{_IDENT})*$"  # package.module:function

# Set by the operator in every trainer pod (torchrun's, ours, the S3 client's).
# The S3 client's credentials, and every variable that would send it to other credentials,
# are reserved too: they come from checkpoint.credentialsSecret or the pod's identity.
# Other AWS_* settings (AWS_CA_BUNDLE, AWS_MAX_ATTEMPTS, checksum modes) stay the user's.
RESERVED_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                "MASTER_ADDR", "MASTER_PORT", "PYTHONUNBUFFERED",
                "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_REGION",
                "AWS_DEFAULT_REGION", "AWS_PROFILE", "AWS_SHARED_CREDENTIALS_FILE", "AWS_CONFIG_FILE",
                "AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_ROLE_ARN", "AWS_ROLE_SESSION_NAME")
RESERVED_ENV_PREFIXES = ("RFT_", "TORCHELASTIC_", "PET_", "AWS_ENDPOINT_URL", "AWS_CONTAINER_")
# What the Pod Security "baseline" profile lets a container add.
BASELINE_CAPABILITIES = ("AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL",
                         "MKNOD", "NET_BIND_SERVICE", "SETFCAP", "SETGID", "SETPCAP", "SETUID",
                         "SYS_CHROOT")


class Check(NamedTuple):
    """One rule in both places: `rule` is CEL on `self` for the API server, `ok` the same
    test in Python (None: admission only), `message` what both say, never the value.
    `field_path` and `message_expression` as in `x-kubernetes-validations`."""

    rule: str
    ok: Callable[[Any], bool] | None
    message: str
    field_path: str | None = None
    message_expression: str | None = None


def cel(rule: str, message: str, field_path: str | None = None,
        message_expression: str | None = None) -> dict[str, str]:
    """One CEL validation rule (`x-kubernetes-validations` entry)."""
    out = {"rule": rule, "message": message}
    if message_expression:
        out["messageExpression"] = message_expression
    if field_path:
        out["fieldPath"] = field_path
    return out


def cel_rules(checks: tuple[Check, ...]) -> list[dict[str, str]]:
    return [cel(c.rule, c.message, c.field_path, c.message_expression) for c in checks]


def run_checks(checks: tuple[Check, ...], value: Any) -> Any:
    for check in checks:
        if check.ok is not None and not check.ok(value):
            raise ValueError(check.message)
    return value


def checked(base: Any, *checks: Check, **constraints: Any) -> Any:
    """`base` with `checks` (on the value) and field `constraints` (max_length, ...)."""
    return Annotated[base, Field(json_schema_extra={"rules": cel_rules(checks)}, **constraints),
                     AfterValidator(lambda v: run_checks(checks, v))]


def search_regex(regex: str) -> Callable[[str], bool]:
    """Python's reading of CEL's `matches` (RE2, unanchored; `$` only at the very end)."""
    compiled = re.compile(regex[:-1] + r"\Z" if regex.endswith("$") else regex)
    return lambda s: compiled.search(s) is not None


def matching(regex: str, message: str) -> Check:
    return Check(f"self.matches(r'{regex}')", search_regex(regex), message)


def immutable(field: str, path: str, why: str = "create a new RFTJob to change it") -> Check:
    """A transition rule that forbids changing, adding or removing a (nested) field."""
    parts = field.split(".")

    def present(root: str) -> str:
        return " && ".join(f"has({root}.{'.'.join(parts[:n + 1])})" for n in range(len(parts)))
    return Check(f"({present('self')}) == ({present('oldSelf')}) && "
                 f"(!({present('self')}) || self.{field} == oldSelf.{field})",
                 None, f"{path} is immutable: {why}", f".{field}")


def unique_list(item: Any, key: str | None = None) -> Any:
    """A list of distinct items (`listType: set`), or keyed by `key` (`listType: map`):
    the API server refuses a duplicate, and so does pydantic."""
    def check(items: list) -> list:
        keys = [getattr(i, key) if key else i for i in items]
        for n, k in enumerate(keys):
            if k in keys[:n]:
                raise ValueError(f"duplicate {key or 'item'} {k!r}")
        return items
    extra = ({"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": [key]} if key
             else {"x-kubernetes-list-type": "set"})
    return Annotated[list[item], Field(json_schema_extra=extra), AfterValidator(check)]


# ------------------------------------------------------------------ Kubernetes formats

def is_dns_subdomain(s: str) -> bool:
    return len(s) <= 253 and re.fullmatch(_SUBDOMAIN, s) is not None


def is_qualified_name(s: str) -> bool:
    """`[dns-subdomain/]name`, name <= 63 chars: label keys, annotation keys, resources."""
    prefix, slash, name = s.rpartition("/")
    return (len(name) <= 63 and re.fullmatch(_NAME, name) is not None
            and (not slash or is_dns_subdomain(prefix)))


def is_label_value(s: str) -> bool:
    return len(s) <= 63 and re.fullmatch(f"({_NAME})?", s) is not None


_QUANTITY = re.compile(r"([+-]?[0-9]+\.?[0-9]*|[+-]?\.[0-9]+)([KMGTPE]i|[numkMGTPE]|[eE][+-]?[0-9]+)?")
_SCALE = {"n": Decimal("1e-9"), "u": Decimal("1e-6"), "m": Decimal("1e-3"), "": 1,
          **{s: 1000 ** (i + 1) for i, s in enumerate("kMGTPE")},
          **{f"{s}i": 1024 ** (i + 1) for i, s in enumerate("KMGTPE")}}


def parse_quantity(q: int | str) -> Decimal | None:
    """A Kubernetes resource quantity's value ("500m" -> 0.5), None if it is not one."""
    if isinstance(q, int):
        return Decimal(q)
    m = _QUANTITY.fullmatch(q)
    if not m:
        return None
    number, suffix = Decimal(m[1]), m[2] or ""
    try:
        return number * _SCALE[suffix] if suffix in _SCALE else number.scaleb(int(suffix[1:]))
    except ArithmeticError:
        return None


def _quantity(positive: bool) -> Callable[[Any], bool]:
    def ok(q: Any) -> bool:
        v = parse_quantity(q) if len(str(q)) <= 64 else None
        return v is not None and (v > 0 if positive else v >= 0)
    return ok


QUALIFIED_KEYS = Check(
    "self.all(k, !format.qualifiedName().validate(k).hasValue())",
    lambda d: all(map(is_qualified_name, d)),
    "keys must be qualified names: an optional DNS subdomain and '/', then at most 63 "
    "letters, digits, '-', '_' or '.' starting and ending with a letter or digit")
LABEL_VALUE = Check("!format.labelValue().validate(self).hasValue()", is_label_value,
                    "must be a label value: at most 63 letters, digits, '-', '_' or '.', "
                    "starting and ending with a letter or digit")
# Resource quantities travel as int-or-string ("cpu: 8" or "memory: 16Gi").
_QUANTITY_CHECK = Check(
    "type(self) == int ? self >= 0 : isQuantity(self) && !quantity(self).isLessThan(quantity('0'))",
    _quantity(positive=False), "must be a non-negative Kubernetes quantity such as 8, 500m or 16Gi")
Quantity = Annotated[int | str, Field(json_schema_extra={"maxLength": 64, "rules": cel_rules((_QUANTITY_CHECK,))}),
                     AfterValidator(lambda v: run_checks((_QUANTITY_CHECK,), v))]
Size = checked(str, Check(
    "isQuantity(self) && quantity(self).isGreaterThan(quantity('0'))",
    _quantity(positive=True), "must be a positive Kubernetes quantity such as 512Mi or 16Gi"),
    max_length=64)
# /dev/shm: a size, or "0" for none (the container keeps the runtime's 64 MiB default).
ShmSize = checked(str, Check(
    "isQuantity(self) && !quantity(self).isLessThan(quantity('0'))",
    _quantity(positive=False), "must be a Kubernetes quantity such as 1Gi, or 0 for no /dev/shm volume"),
    max_length=64)
Image = checked(str, matching(IMAGE, "must be a container image reference "
                              "[registry[:port]/]path[:tag][@sha256:<64 hex digits>] with a lowercase path"),
                max_length=512)

# S3 URIs: the bucket naming rules AWS and MinIO enforce, and keys without empty, '.' or
# '..' segments (the checkpoint layout joins keys with '/'; `a//b` and `a/./b` would be
# other objects than `a/b`). The strict checks apply wherever the value is an s3:// URI.
_S3_BUCKET_LENGTH, _S3_BUCKET = search_regex(r"^s3://[^/]{3,63}(/|$)"), search_regex(rf"^s3://{_SUBDOMAIN}(/|$)")
_S3_BUCKET_IP, _S3_BAD_KEY = search_regex(r"^s3://[0-9]+\.[0-9]+\.[0-9]+\.[0-9]+(/|$)"), search_regex(r"//|/\.\.?(/|$)")
S3_BUCKET = Check(
    rf"!self.startsWith('s3://') || (self.matches(r'^s3://[^/]{{3,63}}(/|$)') && "
    rf"self.matches(r'^s3://{_SUBDOMAIN}(/|$)') && "
    r"!self.matches(r'^s3://[0-9]+\.[0-9]+\.[0-9]+\.[0-9]+(/|$)'))",
    lambda v: not v.startswith("s3://") or (_S3_BUCKET_LENGTH(v) and _S3_BUCKET(v) and not _S3_BUCKET_IP(v)),
    "the S3 bucket must be 3 to 63 lowercase letters, digits, '.' and '-', in dot-separated "
    "labels that start and end with a letter or digit, and not an IP address")
S3_KEY = Check(r"!self.startsWith('s3://') || !self.substring(5).matches(r'//|/\.\.?(/|$)')",
               lambda v: not v.startswith("s3://") or not _S3_BAD_KEY(v[5:]),
               "the S3 key must not contain empty ('//'), '.' or '..' path segments")
S3Uri = checked(str, Check("self.startsWith('s3://')", None, "must be an S3 URI of the form s3://<bucket>/<prefix>"),
                S3_BUCKET, S3_KEY, min_length=1, max_length=1024)
ImagePath = checked(
    str,
    Check("self.startsWith('s3://') || self.startsWith('/')", None,
          "must be an s3:// URI or an absolute path inside the image"),
    Check(r"self.startsWith('s3://') || !self.matches(r'(^|/)\.\.(/|$)')", None,
          "a path inside the image must not contain '..' segments"),
    S3_BUCKET, S3_KEY, min_length=1, max_length=1024)


_OCTET = r"(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
_PORT_NUMBER = r"([1-9][0-9]{0,3}|[1-5][0-9]{4}|6[0-4][0-9]{3}|65[0-4][0-9]{2}|655[0-2][0-9]|6553[0-5])"
# After the scheme: a DNS name, an IPv4 address or a bracketed IPv6 address, then an
# optional port. A DNS name of digits and dots only must be an IPv4 address.
_ENDPOINT_HOST = rf"^https?://({_SUBDOMAIN}|\[[0-9a-fA-F]*:[0-9a-fA-F:.]*\])(:{_PORT_NUMBER})?(/|$)"
_ENDPOINT_NUMERIC = r"^https?://[0-9.]+(:[0-9]*)?(/|$)"
_ENDPOINT_IPV4 = rf"^https?://{_OCTET}(\.{_OCTET}){{3}}(:{_PORT_NUMBER})?(/|$)"
_ENDPOINT_USERINFO = r"^[^/?#]*//[^/?#]*@"
_ENDPOINT_SHAPE = r"^https?://[^/?#]+(/[^?#]*)?$"
ENDPOINT_CHECKS = (
    Check(f"!self.matches(r'{_ENDPOINT_USERINFO}')", lambda v: not search_regex(_ENDPOINT_USERINFO)(v),
          "must not carry credentials (user:password@host): put them in the Secret named by "
          "checkpoint.credentialsSecret"),
    Check(f"self.matches(r'{_ENDPOINT_SHAPE}')", search_regex(_ENDPOINT_SHAPE),
          "must be an http:// or https:// URL without a query or fragment"),
    Check(f"!self.matches(r'{_ENDPOINT_SHAPE}') || self.matches(r'{_ENDPOINT_USERINFO}') || "
          f"(self.matches(r'{_ENDPOINT_NUMERIC}') ? self.matches(r'{_ENDPOINT_IPV4}') : "
          f"self.matches(r'{_ENDPOINT_HOST}'))",
          lambda v: (not search_regex(_ENDPOINT_SHAPE)(v) or search_regex(_ENDPOINT_USERINFO)(v)
                     or (search_regex(_ENDPOINT_IPV4)(v) if search_regex(_ENDPOINT_NUMERIC)(v) else search_regex(_ENDPOINT_HOST)(v))),
          "must have a DNS name or an IP address as its host and, if any, a port from 1 to 65535"),
)


def on_field(check: Check, field: str, attr: str, name: str) -> Check:
    """`check` on the optional string `field`, run on the object that holds it: the API
    server quotes a string that fails its own rule, an object's rule only names the field
    (the endpoint may carry a secret)."""
    return Check(f"!has(self.{field}) || ({check.rule.replace('self.', f'self.{field}.')})",
                 lambda o: getattr(o, attr) is None or check.ok(getattr(o, attr)),
                 f"{name} {check.message}", f".{field}")


Reward = checked(str, Check(
    f"self in {list(BUILTIN_REWARDS)} || self.matches(r'{REWARD_REF}')",
    lambda v: v in BUILTIN_REWARDS or search_regex(REWARD_REF)(v),
    f"must be a built-in reward ({', '.join(BUILTIN_REWARDS)}) or 'package.module:function'"),
    min_length=1, max_length=256)
Capability = checked(str, Check(
    r"self.matches(r'^[A-Z][A-Z0-9_]*$') && !self.startsWith('CAP_')",
    lambda v: search_regex(r"^[A-Z][A-Z0-9_]*$")(v) and not v.startswith("CAP_"),
    "must be a capability name in upper case without the CAP_ prefix, e.g. NET_BIND_SERVICE"),
    max_length=64)
EnvName = checked(
    str,
    # Kubernetes' rule since 1.32 (RelaxedEnvironmentVariableValidation): printable ASCII but '='.
    matching(r"^[ -<>-~]+$", "must be printable ASCII characters other than '=' (as Kubernetes takes "
                             "environment variable names)"),
    Check(f"!(self in {list(RESERVED_ENV)}) && !{list(RESERVED_ENV_PREFIXES)}.exists(p, self.startsWith(p))",
          lambda v: v not in RESERVED_ENV and not v.startswith(RESERVED_ENV_PREFIXES),
          "is reserved: the operator sets RANK, WORLD_SIZE, MASTER_ADDR and torchrun's other variables, "
          "PYTHONUNBUFFERED, RFT_*, and the S3 client's endpoint, region and credentials (AWS_ENDPOINT_URL*, "
          "AWS_REGION, AWS_ACCESS_KEY_ID, ...): use checkpoint.endpoint, checkpoint.region and "
          "checkpoint.credentialsSecret"),
    max_length=128)
LabelValue = checked(str, LABEL_VALUE, max_length=63)
ExitCode = Annotated[int, Field(ge=1, le=255)]  # 0 is success: neither fatal nor retryable
