"""JSON schema modes and the check of finished outputs against the full schema.

    spec = with_mode(schema_text, "validate")     # the schema as llguidance should compile it
    SchemaCheck().valid(schema_text, output, finish_reason) -> bool
    strict_refusal(engine_error)                  # a strict-mode refusal in jobrunner's terms

strict (the default) compiles the schema as it is: what llguidance cannot enforce (a `oneOf` it
cannot prove disjoint, `dependencies`, `uniqueItems`, an unknown `format`, ...) makes the
constraint fail to compile. validate compiles what it can (llguidance's `coerce_one_of`: oneOf as
anyOf; `lenient`: unsupported keywords ignored) and relies on the check after generation. The check
runs in both modes: an output is schema_valid only if it stopped (a cut one is never valid), parses
as JSON and validates with jsonschema (the schema's own `$schema` draft, else 2020-12, with the
format checker).
"""
from __future__ import annotations

import json
import re

SCHEMA_MODES = ("strict", "validate")
# what validate asks of llguidance, in the schema's own "x-guidance" options
LENIENT = {"coerce_one_of": True, "lenient": True}
_MAX_VALIDATORS = 256              # compiled validators kept, by schema text


def with_mode(spec: str, mode: str) -> str:
    """The schema text llguidance compiles under `mode`; unchanged in strict mode, and whenever it is not
    a JSON object (the engine then reports what is wrong with it)."""
    if mode == "strict":
        return spec
    try:
        schema = json.loads(spec)
    except ValueError:
        return spec
    if not isinstance(schema, dict):
        return spec
    options = schema.get("x-guidance")
    schema["x-guidance"] = {**(options if isinstance(options, dict) else {}), **LENIENT}
    return json.dumps(schema)


class SchemaCheck:
    """jsonschema validators by schema text (compiled once each, the most recent kept)."""

    def __init__(self):
        self._validators: dict[str, object] = {}

    def valid(self, spec: str, output: str | None, finish_reason: str | None) -> bool:
        if finish_reason != "stop":         # cut by max_tokens, or no output at all
            return False
        try:
            instance = json.loads(output)
        except (TypeError, ValueError):     # no answer (None), or not JSON
            return False
        validator = self._validator(spec)
        if validator is None:
            return False
        try:
            return validator.is_valid(instance)
        except Exception:       # noqa: BLE001 - a ref that can't be resolved, a keyword of the wrong type
            return False

    def _validator(self, spec: str):
        if spec not in self._validators:
            if len(self._validators) >= _MAX_VALIDATORS:
                self._validators.pop(next(iter(self._validators)))
            self._validators[spec] = _build(spec)
        return self._validators[spec]


def _build(spec: str):
    """A validator of the schema under its own draft (2020-12 when it names none), checking formats;
    None when the schema is not a JSON object jsonschema can use."""
    import jsonschema           # a dependency: never a silent False for want of it
    try:
        schema = json.loads(spec)
        cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
        return cls(schema, format_checker=cls.FORMAT_CHECKER)
    except Exception:           # noqa: BLE001 - not JSON, not an object, an unknown $schema
        return None


# llguidance's advice in a refusal, naming an option of its own that users cannot set
_COERCE_ADVICE = re.compile(r"\s*Enable 'coerce_one_of' option to approximate oneOf with anyOf\.?")


def strict_refusal(error: str, subject: str = "JSON schema") -> str:
    """An engine error of a schema the grammar refused under strict mode ("json_schema constraint: ..."),
    said in jobrunner's terms (`subject`: what held the schema); any other error as it is."""
    kind, sep, reason = error.partition(" constraint: ")
    _, inside, schema_reason = reason.partition("failed to compile JSON schema: ")    # a %json in a grammar
    if not sep or not (kind == "json_schema" or kind == "grammar" and inside):
        return error
    reason = _COERCE_ADVICE.sub("", schema_reason or reason).strip().split("\n", 1)[0].rstrip(". ")
    return (f"{subject} refused in strict mode: {reason}; --json-schema-mode validate enforces what the grammar "
            "can and checks each output against the whole schema afterwards")
