"""`python -m bench.decode.kernel_registers`'s arithmetic: signatures from a kernel's parameters,
programs an SM holds, and the resource line of `cuobjdump -res-usage` (compiling needs Triton, which
the CPU suite does not install; the device runs the script whole)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from bench.decode.kernel_registers import programs_per_sm, resources, signature


def test_signature_types_pointers_scalars_and_constexprs() -> None:
    params = [
        SimpleNamespace(name=name, is_constexpr=constexpr)
        for name, constexpr in (
            ("q_ptr", False),
            ("part_out_ptr", False),
            ("block_tables_ptr", False),
            ("scale", False),
            ("stride_qb", False),
            ("BLOCK_N", True),
        )
    ]
    assert signature(SimpleNamespace(params=params)) == {
        "q_ptr": "*bf16",
        "part_out_ptr": "*fp32",
        "block_tables_ptr": "*i32",
        "scale": "fp32",
        "stride_qb": "i32",
        "BLOCK_N": "constexpr",
    }


@pytest.mark.parametrize(
    ("registers", "shared", "warps", "programs"),
    [
        (254, 13312, 4, 2),  # the paged decode kernel's split tile: registers bound it
        (112, 8704, 4, 4),
        (136, 8704, 2, 7),
        (32, 40960, 4, 5),  # shared memory bounds it
        (31, 0, 4, 16),  # warps bound it
    ],
)
def test_programs_an_sm_holds(registers: int, shared: int, warps: int, programs: int) -> None:
    assert programs_per_sm(registers, shared, warps) == programs


def test_resources_read_from_cuobjdump(tmp_path: Path) -> None:
    tool = tmp_path / "cuobjdump"
    tool.write_text(
        "#!/bin/sh\necho 'Resource usage:'\n"
        "echo ' Function _k: REG:150 STACK:8 SHARED:16384 LOCAL:0 CONSTANT[0]:540'\n"
    )
    tool.chmod(0o755)
    assert resources(b"\x7fELF", str(tool)) == (150, 8)
    silent = tmp_path / "silent"
    silent.write_text("#!/bin/sh\necho nothing\n")
    silent.chmod(0o755)
    with pytest.raises(RuntimeError, match="no resource usage"):
        resources(b"\x7fELF", str(silent))
