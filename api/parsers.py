"""Request body parsers for both APIs: a body either parses to values the database can hold or
is refused with a 400 (`ParseError`), never a 500.

JSON: nesting deeper than the interpreter can walk is refused, and so are `NaN` and `Infinity`
(a number too large for a float, such as `1e309`, reads as infinity: the validation of the field
that holds it refuses it, naming the field). JSON, form and multipart: no string
(key or value; uploaded file contents are bytes and are not checked) may hold a NUL character,
which PostgreSQL text cannot store.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from rest_framework import parsers
from rest_framework.exceptions import ParseError

NUL = "\x00"


def refuse_nul(value: Any) -> None:
    """Raise `ParseError` if a string anywhere in `value` (keys included) holds a NUL."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if NUL in item:
                raise ParseError("Request body strings cannot contain the NUL character (\\u0000).")
        elif isinstance(item, Mapping):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)


def _refuse_constant(name: str) -> float:
    raise ParseError(f"JSON value {name} is not a number this API accepts.")


class JsonParser(parsers.JSONParser):
    """DRF's JSON parser, refusing too-deep nesting, non-finite numbers and NUL in strings."""

    def parse(self, stream: Any, media_type: str | None = None, parser_context: Any = None) -> Any:
        parser_context = parser_context or {}
        encoding = parser_context.get("encoding", "utf-8")
        try:
            text = stream.read().decode(encoding)
            data = json.loads(text, parse_constant=_refuse_constant)
        except RecursionError:
            raise ParseError("JSON parse error - the body is nested too deeply.") from None
        except ValueError as exc:
            raise ParseError(f"JSON parse error - {exc}") from None
        refuse_nul(data)
        return data


class FormParser(parsers.FormParser):
    """DRF's form parser, refusing NUL in field names and values."""

    def parse(self, stream: Any, media_type: str | None = None, parser_context: Any = None) -> Any:
        data = super().parse(stream, media_type, parser_context)
        refuse_nul(dict(data.lists()))
        return data


class MultiPartParser(parsers.MultiPartParser):
    """DRF's multipart parser, refusing NUL in field names, values and file names."""

    def parse(self, stream: Any, media_type: str | None = None, parser_context: Any = None) -> Any:
        result = super().parse(stream, media_type, parser_context)
        refuse_nul(dict(result.data.lists()))
        refuse_nul(list(result.files.keys()))
        refuse_nul([upload.name for _, uploads in result.files.lists() for upload in uploads])
        return result
