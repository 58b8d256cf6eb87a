"""Fused Triton kernels of the CUDA decode step (imported only on CUDA).

Each replaces a chain of small torch kernels, which dominate a decode step's launch count:
- `rms_norm`: optional residual add, then RMSNorm (HF rounding order), one pass.
- `rope_and_cache_write`: RoPE on q and k straight from the fused qkv output, q written out,
  k and v written into the paged cache.
- `silu_and_mul`: SwiGLU activation on the fused gate/up output.

The last two optionally add each row's LoRA expand term first (`LoraRows`: the row's slot, its
shrink values and the slots' stacked B), so a small decode batch with adapters needs no
separate expand kernel for q|k|v and gate|up. Rows with slot -1 take exactly the base path.

`pdl=True` launches a kernel as a programmatic dependent of the one before it in the stream
(Hopper's programmatic dependent launch; `launch_pdl` in Triton): it may be scheduled while its
predecessor's last programs still run. Each such kernel waits for its predecessor
(`gdc_wait`) before it touches anything a kernel may have written (only weights are read
before), and lets its own dependents be scheduled once its inputs are loaded
(`gdc_launch_dependents`), so a dependent's pre-wait part never overlaps two kernels back.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl


class LoraRows(NamedTuple):
    """Per-row LoRA expand inputs of one projection group (see `gpu_runtime.lora.groups`)."""

    shrink: torch.Tensor
    """`[T, G*S*R]` x @ A.T for every slot (unit column stride)."""
    b: torch.Tensor
    """`[S*R, out_total]` the group's stacked `scaling * B.T`."""
    slots: torch.Tensor
    """`[T]` int slot per row, -1: base row."""
    rank: int
    """Rows per slot (R)."""


def _lora_args(lora: LoraRows | None, like: torch.Tensor) -> tuple[object, ...]:
    if lora is None:  # unused pointers: any tensor of the right device
        return like, like, like, 0, 0, 0
    return lora.shrink, lora.b, lora.slots, lora.shrink.stride(0), lora.b.stride(0), lora.b.shape[0]


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    residual_out_ptr,
    eps,
    hidden,
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0)  # a weight: no kernel writes it
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + offs, mask=mask, other=0.0)
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    if HAS_RESIDUAL:
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * stride_ro + offs, x, mask=mask)
    xf = x.to(tl.float32)
    variance = tl.sum(xf * xf, 0) / hidden
    normed = (xf * tl.rsqrt(variance + eps)).to(x_ptr.dtype.element_ty)
    y = (normed.to(tl.float32) * w.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_o + offs, y, mask=mask)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    pdl: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x `[T, hidden]`. Returns (norm(x + residual), x + residual); without a residual the
    second item is x itself. `pdl`: launched as a programmatic dependent (module docstring)."""
    rows, hidden = x.shape
    out = torch.empty_like(x)
    residual_out = torch.empty_like(x) if residual is not None else x
    res = residual if residual is not None else x
    _rms_norm_kernel[(rows,)](
        x,
        res,
        weight,
        out,
        residual_out,
        eps,
        hidden,
        x.stride(0),
        res.stride(0),
        out.stride(0),
        residual_out.stride(0),
        HAS_RESIDUAL=residual is not None,
        BLOCK=triton.next_power_of_2(hidden),
        USE_PDL=pdl,
        num_warps=8 if hidden >= 4096 else 4,
        launch_pdl=pdl,
    )
    return out, residual_out


@triton.jit
def _rope_cache_kernel(
    qkv_ptr,
    positions_ptr,
    cos_ptr,
    sin_ptr,
    q_out_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_blocks_ptr,
    slot_offsets_ptr,
    stride_qkv,
    stride_qo_t,
    stride_qo_h,
    stride_cb,
    stride_ch,
    stride_ct,
    num_heads,
    num_kv_heads,
    shrink_ptr,
    lora_b_ptr,
    slots_ptr,
    stride_shrink,
    stride_lb,
    lora_width,
    HALF: tl.constexpr,
    LORA_RANK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    token = tl.program_id(0)
    head = tl.program_id(1)  # 0..H-1: q heads, H..H+Hkv-1: k heads (v copied alongside)
    offs = tl.arange(0, HALF)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    pos = tl.load(positions_ptr + token)
    cos = tl.load(cos_ptr + pos * HALF + offs).to(tl.float32)
    sin = tl.load(sin_ptr + pos * HALF + offs).to(tl.float32)
    base = qkv_ptr + token * stride_qkv + head * (2 * HALF)
    x1 = tl.load(base + offs).to(tl.float32)
    x2 = tl.load(base + HALF + offs).to(tl.float32)
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    slot = -1
    if LORA_RANK > 0:
        slot = tl.load(slots_ptr + token)
        if slot >= 0:  # + shrink[token, module, slot, :] @ B[slot, :, this head's columns]
            module = (head >= num_heads).to(tl.int32)  # q: 0, k: 1
            coef_ptr = shrink_ptr + token * stride_shrink + module * lora_width + slot * LORA_RANK
            b_row = lora_b_ptr + slot * LORA_RANK * stride_lb + head * (2 * HALF)
            for r in tl.static_range(LORA_RANK):  # unrolled: all loads in flight at once
                coef = tl.load(coef_ptr + r).to(tl.float32)
                x1 += coef * tl.load(b_row + r * stride_lb + offs).to(tl.float32)
                x2 += coef * tl.load(b_row + r * stride_lb + HALF + offs).to(tl.float32)
    dtype = qkv_ptr.dtype.element_ty
    y1 = (x1 * cos - x2 * sin).to(dtype)
    y2 = (x2 * cos + x1 * sin).to(dtype)
    if head < num_heads:
        q_base = q_out_ptr + token * stride_qo_t + head * stride_qo_h
        tl.store(q_base + offs, y1)
        tl.store(q_base + HALF + offs, y2)
    else:
        kv_head = head - num_heads
        block = tl.load(slot_blocks_ptr + token)
        offset = tl.load(slot_offsets_ptr + token)
        dest = block * stride_cb + kv_head * stride_ch + offset * stride_ct
        tl.store(k_cache_ptr + dest + offs, y1.to(k_cache_ptr.dtype.element_ty))
        tl.store(k_cache_ptr + dest + HALF + offs, y2.to(k_cache_ptr.dtype.element_ty))
        v_col = (num_heads + num_kv_heads + kv_head) * (2 * HALF)
        v1 = tl.load(qkv_ptr + token * stride_qkv + v_col + offs)
        v2 = tl.load(qkv_ptr + token * stride_qkv + v_col + HALF + offs)
        if LORA_RANK > 0:
            if slot >= 0:
                v1f = v1.to(tl.float32)
                v2f = v2.to(tl.float32)
                coef_ptr = shrink_ptr + token * stride_shrink + 2 * lora_width + slot * LORA_RANK
                b_row = lora_b_ptr + slot * LORA_RANK * stride_lb + v_col
                for r in tl.static_range(LORA_RANK):  # unrolled: all loads in flight at once
                    coef = tl.load(coef_ptr + r).to(tl.float32)
                    v1f += coef * tl.load(b_row + r * stride_lb + offs).to(tl.float32)
                    v2f += coef * tl.load(b_row + r * stride_lb + HALF + offs).to(tl.float32)
                v1 = v1f.to(qkv_ptr.dtype.element_ty)
                v2 = v2f.to(qkv_ptr.dtype.element_ty)
        tl.store(v_cache_ptr + dest + offs, v1.to(v_cache_ptr.dtype.element_ty))
        tl.store(v_cache_ptr + dest + HALF + offs, v2.to(v_cache_ptr.dtype.element_ty))


def rope_and_cache_write(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos_table: torch.Tensor,
    sin_table: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_blocks: torch.Tensor,
    slot_offsets: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    lora: LoraRows | None = None,
    pdl: bool = False,
) -> torch.Tensor:
    """qkv `[T, (H + 2 Hkv) * D]` -> rotated q `[T, H, D]`; rotated k and v go to the cache
    (`[num_blocks, Hkv, block_size, D]` views) at (slot_blocks, slot_offsets).

    cos_table/sin_table: `[max_positions, D / 2]` contiguous (the model's RoPE, in its dtype).
    `lora` (group q|k|v): each adapter row's expand term is added to q, k and v first.
    `pdl`: launched as a programmatic dependent (module docstring).
    """
    tokens = qkv.shape[0]
    q_out = torch.empty(tokens, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    _rope_cache_kernel[(tokens, num_heads + num_kv_heads)](
        qkv,
        positions,
        cos_table,
        sin_table,
        q_out,
        key_cache,
        value_cache,
        slot_blocks,
        slot_offsets,
        qkv.stride(0),
        q_out.stride(0),
        q_out.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        num_heads,
        num_kv_heads,
        *_lora_args(lora, qkv),
        HALF=head_dim // 2,
        LORA_RANK=lora.rank if lora is not None else 0,
        USE_PDL=pdl,
        num_warps=1,
        launch_pdl=pdl,
    )
    return q_out


@triton.jit
def _silu_mul_kernel(
    gu_ptr,
    out_ptr,
    inter,
    stride_gu,
    stride_o,
    shrink_ptr,
    lora_b_ptr,
    slots_ptr,
    stride_shrink,
    stride_lb,
    lora_width,
    BLOCK: tl.constexpr,
    LORA_RANK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    gate = tl.load(gu_ptr + row * stride_gu + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gu_ptr + row * stride_gu + inter + offs, mask=mask, other=0.0)
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    if LORA_RANK > 0:
        slot = tl.load(slots_ptr + row)
        if slot >= 0:  # + the row's slot's expand terms of gate and up
            upf = up.to(tl.float32)
            coef_ptr = shrink_ptr + row * stride_shrink + slot * LORA_RANK
            b_row = lora_b_ptr + slot * LORA_RANK * stride_lb
            for r in tl.static_range(LORA_RANK):  # unrolled: all loads in flight at once
                cg = tl.load(coef_ptr + r).to(tl.float32)
                cu = tl.load(coef_ptr + lora_width + r).to(tl.float32)
                b_gate = tl.load(b_row + r * stride_lb + offs, mask=mask, other=0.0)
                b_up = tl.load(b_row + r * stride_lb + inter + offs, mask=mask, other=0.0)
                gate += cg * b_gate.to(tl.float32)
                upf += cu * b_up.to(tl.float32)
            up = upf.to(gu_ptr.dtype.element_ty)
    act = (gate / (1.0 + tl.exp(-gate))).to(gu_ptr.dtype.element_ty)
    y = (act.to(tl.float32) * up.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_o + offs, y, mask=mask)


def silu_and_mul(
    gate_up: torch.Tensor, lora: LoraRows | None = None, pdl: bool = False
) -> torch.Tensor:
    """`[T, 2 I]` (gate then up) -> silu(gate) * up `[T, I]`; `lora` (group gate|up): each
    adapter row's expand terms are added to gate and up first. `pdl`: launched as a
    programmatic dependent (module docstring)."""
    rows, width = gate_up.shape
    inter = width // 2
    out = torch.empty(rows, inter, dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    _silu_mul_kernel[(rows, triton.cdiv(inter, block))](
        gate_up,
        out,
        inter,
        gate_up.stride(0),
        out.stride(0),
        *_lora_args(lora, gate_up),
        BLOCK=block,
        LORA_RANK=lora.rank if lora is not None else 0,
        USE_PDL=pdl,
        num_warps=4,
        launch_pdl=pdl,
    )
    return out
