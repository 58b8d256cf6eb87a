"""Structured output: requests whose tokens must match a JSON schema, a regex, an EBNF grammar or
a structural tag, by grammar matchers (xgrammar) masking their logits rows before sampling.

Only the parameter types are imported here (`SamplingParams` holds one, and it must stay light);
the engine's matchers are `gpu_runtime.structured.outputs.StructuredOutputs` and the compiler
`gpu_runtime.structured.compiler.StructuredCompiler`.
"""

from gpu_runtime.structured.params import (
    STRUCTURED_KINDS,
    StructuredKind,
    StructuredOutputError,
    StructuredOutputParams,
)

__all__ = [
    "STRUCTURED_KINDS",
    "StructuredKind",
    "StructuredOutputError",
    "StructuredOutputParams",
]
