"""Input names of both APIs: a body field, or a list's query parameter, that the route does not
take is refused (400 naming it, `unknown_parameter`), never ignored, as OpenAI's API answers an
unrecognized request argument. A typo such as `"hyperparamters"` would otherwise train with
defaults, and `?stauts=failed` list everything, as if the caller had asked for that.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from rest_framework import serializers

from api.errors import HarliError


def body_fields_check(body: Any, *, allowed: Iterable[str]) -> None:
    """Raise a 400 for the first (in sorted order) field of `body` not in `allowed`.

    `body` is a parsed JSON object or a form's fields (`request.data`, `request.POST`); one that
    is not a mapping is left to the caller's own check.
    """
    if not hasattr(body, "keys"):
        return
    names = sorted(allowed)
    unknown = sorted(set(body.keys()) - set(names))
    if unknown:
        raise HarliError(
            f"Unknown parameter: {unknown[0]!r}. This route takes {', '.join(names)}.",
            param=unknown[0],
            code="unknown_parameter",
        )


def serializer_fields(serializer_class: type[serializers.Serializer]) -> frozenset[str]:
    """The body fields a request serializer declares."""
    return frozenset(serializer_class().fields)


# DRF reads `format` on the operator API (the browsable renderer's `?format=json`).
FORMAT_PARAMETER = "format"


def query_params_check(request: Any, *, allowed: Iterable[str] = ()) -> None:
    """Raise a 400 for the first (in sorted order) query parameter not in `allowed`."""
    names = sorted({*allowed, FORMAT_PARAMETER})
    unknown = sorted(set(request.query_params) - set(names))
    if unknown:
        takes = ", ".join(n for n in names if n != FORMAT_PARAMETER) or "no query parameters"
        raise HarliError(
            f"Unknown query parameter: {unknown[0]!r}. This list takes {takes}.",
            param=unknown[0],
            code="unknown_parameter",
        )
