"""Where two servers' outcomes of `openai_script.run_script` differ.

`differences(ours, theirs)` lists (case, field) pairs: `field` is the path inside the outcome
with list indices left out (`choices.tokens`), so one difference is named once however many
tokens it touches. Floats (logprobs) are equal within `LOGPROB_TOLERANCE`: both servers compute
in fp32, in a different order of operations."""

from __future__ import annotations

import math
from typing import Any

LOGPROB_TOLERANCE = 1e-4


def _diff(a: Any, b: Any, path: str, out: set[str]) -> None:
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            out.add(path or "keys")
            return
        for key in a:
            _diff(a[key], b[key], f"{path}.{key}" if path else str(key), out)
    elif isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            out.add(path)
            return
        for x, y in zip(a, b, strict=True):
            _diff(x, y, path, out)
    elif isinstance(a, float) and isinstance(b, float):
        if not math.isclose(a, b, rel_tol=0.0, abs_tol=LOGPROB_TOLERANCE):
            out.add(path)
    elif a != b:
        out.add(path)


def differences(ours: dict[str, Any], theirs: dict[str, Any]) -> set[tuple[str, str]]:
    """(case, field) for every case whose outcomes differ; a case only one side ran is
    (case, "missing")."""
    found: set[tuple[str, str]] = set()
    for case in sorted(ours.keys() | theirs.keys()):
        if case not in ours or case not in theirs:
            found.add((case, "missing"))
            continue
        fields: set[str] = set()
        _diff(ours[case], theirs[case], "", fields)
        found |= {(case, field) for field in fields}
    return found
