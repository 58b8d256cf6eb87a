"""The one-pass Triton penalties (`penalty_kernels`) against the torch form, run by Triton's
interpreter on CPU tensors in a subprocess (the interpreter is chosen when a kernel module is
imported). The same kernel runs compiled on CUDA in `test_gpu_sampling.py`."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]

SCRIPT = """
import torch
from gpu_runtime.engine.logits_processing import apply_penalties
from gpu_runtime.engine.penalty_kernels import apply_penalties_in_place

gen = torch.Generator().manual_seed(0)
rows, count_rows, vocab = 5, 7, 2048 + 300  # a partial last block
logits = torch.randn(rows, vocab, generator=gen) * 3
logits[0, :10] = 0.0  # zero logits: multiplied (unchanged), as in vLLM
logits[1, 5] = float("-inf")
counts = torch.randint(0, 4, (count_rows, vocab), generator=gen, dtype=torch.int32)
counts *= torch.rand(count_rows, vocab, generator=gen) < 0.2
prompt = torch.rand(count_rows, vocab, generator=gen) < 0.1
batch_rows = torch.tensor([3, 0, 1])  # rows 2 and 4 not penalised
which = torch.tensor([6, 2, 0])
presence = torch.tensor([0.5, -1.0, 2.0])
frequency = torch.tensor([0.3, 0.0, -0.7])
repetition = torch.tensor([1.3, 0.5, 1.0])
want = logits.clone()
want[batch_rows] = apply_penalties(
    logits[batch_rows], counts[which], prompt[which], presence, frequency, repetition
)
got = logits.clone()
apply_penalties_in_place(got, batch_rows, which, counts, prompt, presence, frequency, repetition)
assert torch.equal(got[[2, 4]], logits[[2, 4]]), "rows without penalties were written"
assert torch.allclose(got, want, rtol=1e-6, atol=1e-6, equal_nan=False), (got - want).abs().max()
assert torch.isinf(got[1, 5]) and got[1, 5] < 0
print("ok")
"""


def test_triton_penalties_match_the_torch_form_under_the_interpreter() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert result.stdout.strip().endswith("ok")
