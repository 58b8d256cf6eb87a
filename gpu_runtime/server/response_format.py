"""`response_format` of a completion or chat completion request (OpenAI's shape, which vLLM also
takes on both routes) and the structured-output params it asks for.

`{"type": "text"}` (or no field) leaves the output free; `{"type": "json_object"}` constrains it
to a JSON object; `{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}` to
JSON matching `schema` (`description`, a hint to the model, is refused: nothing would read
it). The output is constrained by a grammar whatever `strict` says (`strict: false` asks for no
less than `true`). A schema the grammar compiler
cannot serve is answered 400 with param `response_format` (`Inference.run_one`).

vLLM's own structured-output fields (`structured_outputs`, its older `guided_*`) are not
declared: the strict request bodies refuse them by name (`protocol.py`).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from gpu_runtime.structured import StructuredOutputParams


class JsonSchemaSpec(BaseModel):
    """`response_format.json_schema`."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    schema_: dict[str, Any] | bool = Field(default=True, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """`response_format`: `text`, `json_object`, or `json_schema` with its `json_schema`."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type 'json_schema' needs a json_schema object")
        if self.type != "json_schema" and self.json_schema is not None:
            raise ValueError(
                f"json_schema is only taken with type 'json_schema', not {self.type!r}"
            )
        return self

    def structured_output(self) -> StructuredOutputParams | None:
        """The constraint asked for (None for `text`)."""
        if self.type == "text":
            return None
        if self.type == "json_object":
            return StructuredOutputParams("json_object")
        assert self.json_schema is not None
        return StructuredOutputParams("json_schema", json.dumps(self.json_schema.schema_))
