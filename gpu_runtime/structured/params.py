"""What a request asks its output to match: `StructuredOutputParams` (no torch, no grammar
library: `SamplingParams` holds one).

Kinds and what `spec` holds:

| kind | spec |
| --- | --- |
| `json_object` | empty: any JSON object |
| `json_schema` | a JSON Schema, as JSON text (an object or `true`) |
| `regex` | a regular expression the whole output matches |
| `grammar` | an EBNF (GBNF) grammar whose start rule is `root` |
| `structural_tag` | an xgrammar structural tag, as JSON text |

A structural tag mixes free text and constrained parts, e.g. text up to a trigger such as
`<tool_call>`, then JSON matching a schema (what constrained tool calls use).

The spec's own syntax (a schema xgrammar cannot convert, a bad regex, an undefined rule) is
checked when it is compiled (`StructuredCompiler.compile`), which raises
`StructuredOutputError`; here only what needs no compile is checked.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal, get_args

StructuredKind = Literal["json_object", "json_schema", "regex", "grammar", "structural_tag"]
STRUCTURED_KINDS: tuple[str, ...] = get_args(StructuredKind)


class StructuredOutputError(ValueError):
    """A structured-output spec that cannot be served: malformed, or refused by the grammar
    compiler; the message says which kind and why. The servers answer it as a 400."""


@dataclass(frozen=True)
class StructuredOutputParams:
    """One request's output constraint; equal params compile to the same grammar (the
    compiler caches by `(kind, spec)`)."""

    kind: StructuredKind
    """Which language `spec` is written in (the table in the module doc)."""
    spec: str = ""
    """The constraint's text; empty for `json_object`, required for every other kind."""

    def __post_init__(self) -> None:
        if self.kind not in STRUCTURED_KINDS:
            raise StructuredOutputError(
                f"structured output kind={self.kind!r} must be one of {', '.join(STRUCTURED_KINDS)}"
            )
        if not isinstance(self.spec, str):
            raise StructuredOutputError(
                f"structured output spec must be a string, got {type(self.spec).__name__}"
            )
        if self.kind == "json_object":
            if self.spec:
                raise StructuredOutputError("structured output kind 'json_object' takes no spec")
            return
        if not self.spec:
            raise StructuredOutputError(f"structured output kind {self.kind!r} needs a spec")
        if self.kind in ("json_schema", "structural_tag"):
            try:
                parsed = json.loads(self.spec)
            except json.JSONDecodeError as exc:
                raise StructuredOutputError(
                    f"structured output {self.kind} is not valid JSON: {exc}"
                ) from None
            if self.kind == "json_schema" and not (isinstance(parsed, dict) or parsed is True):
                raise StructuredOutputError(
                    f"a JSON schema must be an object (or true), got {type(parsed).__name__}"
                )
            if self.kind == "structural_tag" and not isinstance(parsed, dict):
                raise StructuredOutputError(
                    f"a structural tag must be a JSON object, got {type(parsed).__name__}"
                )

    @classmethod
    def json_schema(cls, schema: object) -> StructuredOutputParams:
        """Params for a schema given as a Python value (dict, or True)."""
        return cls("json_schema", json.dumps(schema))
