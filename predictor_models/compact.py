"""The trained ``LatencyModel`` folded into a short chain of wide ops, for export.

The runtime scores 64 candidates per call on a shared host CPU within tens of microseconds; at that
size an ONNX Runtime call costs per node, not per FLOP. ``LatencyModel`` computes its derived
features with slices, concatenations and small elementwise ops (about 50 nodes once exported).
``CompactLatencyModel`` computes the same function with every linear step folded into the next
matrix product (in float64 while folding), so the exported graph is, for ``x`` ``[N, 11]``
(12 to 14 nodes after onnxruntime's fusions for the nets chosen so far)::

    z = x @ Az + cz            [N, 14]  13 logged roofline/feature columns, share sum
    lg = log(z)
    q = lg @ Aq + cq           [N, 5]   arguments of max(), the batch bucket, two steps, a 1
    r = relu(q);  c = ceil(r)           c: bucket + 20 | finetune present | shares SMs | 1
    f = [lg, x, r, c]          [N, 35]  every stage-1 and stage-2 feature is linear in f
    h = silu(f @ W1 + b1) ...           stage-1 hidden layers (normalisation folded in)
    y = [f, h] @ Wy + by       [N, 5]   log alone-latency in Q_ONE, stage-2 log slowdown in
                                        Q_FT_PRESENT, 0 elsewhere
    decode_ms = exp((y * c) @ Wo)  [N, 2]  (alone, colocated)

``max(a, b) = b + relu(a - b)``; a step ``v > 0`` is ``ceil(relu(v'))`` with ``v'`` a positive
rescaling of ``v`` that stays at most 1; the stage-2 gate (``colocated == alone`` without a
finetune quantum) is the product ``y * c``. A stage-2 network with hidden layers keeps them (its
first layer also reads ``[f, h]``).

Where the torch model tests ``ft_tokens > 0`` and ``share_sum > 1 + 1e-6``, this tests
``log(1 + ft_tokens) > 0`` and ``log(share_sum) > log(1 + 1e-6)``: the same except within a few
float32 ulps of the thresholds (token counts are integers; shares are 1 or at least 1 + 1/132).
Valid for ``ft_tokens < e**64`` and ``share_sum < e`` (shares are at most 1 each).
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn

from predictor_models.model import BLOCK, N_LOG, LatencyModel

LN2 = math.log(2.0)
N_RAW = 11  # input columns (STAGE2_FEATURES)
Z_SHARE_SUM = N_LOG  # z = the N_LOG logged BLOCK columns, then the share sum
N_Z = N_LOG + 1
Q_MAX, Q_BUCKET, Q_FT_PRESENT, Q_SHARES_SMS, Q_ONE = range(5)
N_Q = 5
BUCKET_SHIFT = 20.0  # keeps log2(batch + 1e-6) - 1e-4 positive under relu; ceil is shift-exact
FT_TOKENS_SCALE = 1.0 / 64.0  # log(1 + ft_tokens) / 64 <= 1
SHARES_SMS_LOG_THRESHOLD = float(np.log(np.float64(np.float32(1.0 + 1e-6))))
# f = [lg (N_Z), x (N_RAW), relu(q) (N_Q), ceil(relu(q)) (N_Q)]
F_LG, F_X, F_RELU, F_CEIL = 0, N_Z, N_Z + N_RAW, N_Z + N_RAW + N_Q
N_F = F_CEIL + N_Q
# Columns of x holding the torch model's raw BLOCK columns.
X_SHARE, X_BACKWARD, X_FT_SHARE = 5, 9, 10


def _linear_layers(net: nn.Sequential) -> list[nn.Linear]:
    layers = [m for m in net if isinstance(m, nn.Linear)]
    others = [m for m in net if not isinstance(m, nn.Linear | nn.SiLU)]
    if others:
        raise TypeError(f"cannot fold {others}: only Linear and SiLU layers")
    return layers


def _folded(model: LatencyModel) -> tuple[list[nn.Linear], list[nn.Linear]]:
    """Each net's linear layers in float64, with its normaliser folded into the first."""
    nets = []
    for norm, net in ((model.norm1, model.net1), (model.norm2, model.net2)):
        layers = []
        for i, layer in enumerate(_linear_layers(net)):
            w, b = layer.weight.detach().double(), layer.bias.detach().double()
            if i == 0 and not norm.folded:
                w = w / norm.std.double()
                b = b - w @ norm.mean.double()
            copy = nn.Linear(w.shape[1], w.shape[0], dtype=torch.float64)
            with torch.no_grad():
                copy.weight.copy_(w)
                copy.bias.copy_(b)
            layers.append(copy)
        nets.append(layers)
    return nets[0], nets[1]


def _stage1_map() -> tuple[torch.Tensor, torch.Tensor]:
    """(M [N_F, 11], m [11]) with stage-1 derived features ``f1 = f @ M + m`` (STAGE1_DERIVED)."""
    m = torch.zeros(N_F, 11, dtype=torch.float64)
    c = torch.zeros(11, dtype=torch.float64)
    for j in range(8):  # log_1p_* (5), log_decode_sm_share, log_t_mem, log_t_comp_x_share
        m[F_LG + j, j] = 1.0
    # log_batch_bucket = ceil(log2(batch) - 1e-4) * ln 2
    m[F_CEIL + Q_BUCKET, 8], c[8] = LN2, -BUCKET_SHIFT * LN2
    # log_t_roof = max(log_t_mem, log_t_comp) = log_t_comp + relu(log_t_mem - log_t_comp)
    m[F_LG + 7, 9], m[F_LG + 5, 9], m[F_RELU + Q_MAX, 9] = 1.0, -1.0, 1.0
    m[F_X + X_SHARE, 10] = 1.0  # decode_sm_share
    return m, c


def _stage2_map(m1: torch.Tensor, c1: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(M [N_F, 11], m [11], column of log_alone): ``f2 = f @ M + m + log_alone * e_col``."""
    m = torch.zeros(N_F, 11, dtype=torch.float64)
    m[F_LG + 0, 0] = 1.0  # log_1p_batch
    m[F_X + X_SHARE, 1] = 1.0  # decode_sm_share
    for j, block_col in enumerate(range(8, 12)):  # log ft tokens, seq, rank, sm share
        m[F_LG + block_col, 2 + j] = 1.0
    m[F_X + X_BACKWARD, 6] = 1.0
    m[F_X + X_FT_SHARE, 7] = 1.0
    m[F_CEIL + Q_SHARES_SMS, 8] = 1.0
    m[F_LG + 6, 10] = 1.0  # log_mem_over_roof = log_t_mem - log_t_roof
    m[:, 10] -= m1[:, 9]
    c = torch.zeros(11, dtype=torch.float64)
    c[10] = -c1[9]
    return m, c, 9


class CompactLatencyModel(nn.Module):
    """Same outputs as a ``LatencyModel`` (stacked ``[N, 2]``), in few, wide ops."""

    az: torch.Tensor
    cz: torch.Tensor
    aq: torch.Tensor
    cq: torch.Tensor
    wy: torch.Tensor
    by: torch.Tensor
    l2w: torch.Tensor
    wo: torch.Tensor

    def __init__(self, model: LatencyModel) -> None:
        super().__init__()
        f64 = torch.float64
        block_a, block_c = model.block_a.double(), model.block_c.double()
        az = torch.zeros(N_RAW, N_Z, dtype=f64)
        cz = torch.zeros(N_Z, dtype=f64)
        az[:, :N_LOG], cz[:N_LOG] = block_a[:, :N_LOG], block_c[:N_LOG]
        share_sum = BLOCK.index("share_sum")
        az[:, Z_SHARE_SUM], cz[Z_SHARE_SUM] = block_a[:, share_sum], block_c[share_sum]
        aq = torch.zeros(N_Z, N_Q, dtype=f64)
        cq = torch.zeros(N_Q, dtype=f64)
        log_mem, log_comp_share, log_share = BLOCK.index("t_mem_ms"), 7, 5
        aq[log_mem, Q_MAX], aq[log_comp_share, Q_MAX], aq[log_share, Q_MAX] = 1.0, -1.0, 1.0
        aq[BLOCK.index("batch+eps"), Q_BUCKET] = 1.0 / LN2
        cq[Q_BUCKET] = BUCKET_SHIFT - 1e-4
        aq[BLOCK.index("1+ft_tokens"), Q_FT_PRESENT] = FT_TOKENS_SCALE
        aq[Z_SHARE_SUM, Q_SHARES_SMS] = 1.0
        cq[Q_SHARES_SMS] = -SHARES_SMS_LOG_THRESHOLD
        cq[Q_ONE] = 0.5

        net1, net2 = _folded(model)
        m1, c1 = _stage1_map()
        m2, c2, la_col = _stage2_map(m1, c1)
        # log_alone = log_t_roof + net1(f1) is linear in k = [f, last stage-1 hidden layer].
        hidden1 = []
        if len(net1) > 1:
            first = net1[0]
            hidden1.append((m1 @ first.weight.T, c1 @ first.weight.T + first.bias))
            hidden1 += [(layer.weight.T, layer.bias) for layer in net1[1:-1]]
        last1 = net1[-1]
        n_k = N_F + (last1.weight.shape[1] if len(net1) > 1 else 0)
        la_w = torch.zeros(n_k, dtype=f64)
        la_w[:N_F] = m1[:, 9]
        la_b = c1[9] + last1.bias[0]
        if len(net1) > 1:
            la_w[N_F:] = last1.weight[0]
        else:
            la_w[:N_F] += m1 @ last1.weight[0]
            la_b = la_b + c1 @ last1.weight[0]
        # Stage 2's first layer reads f2 = f @ m2 + c2 + log_alone * e_la, i.e. k.
        w2 = net2[0].weight.T  # [11, out]
        pre2_w = torch.zeros(n_k, w2.shape[1], dtype=f64)
        pre2_w[:N_F] = m2 @ w2
        pre2_w += la_w[:, None] * w2[la_col][None, :]
        pre2_b = c2 @ w2 + la_b * w2[la_col] + net2[0].bias
        wy = torch.zeros(n_k, N_Q, dtype=f64)
        by = torch.zeros(N_Q, dtype=f64)
        wy[:, Q_ONE], by[Q_ONE] = la_w, la_b
        hidden2: list[tuple[torch.Tensor, torch.Tensor]] = []
        last2_w = torch.zeros(net2[-1].weight.shape[1] if len(net2) > 1 else 0, N_Q, dtype=f64)
        if len(net2) == 1:
            wy[:, Q_FT_PRESENT], by[Q_FT_PRESENT] = pre2_w[:, 0], pre2_b[0]
        else:
            hidden2.append((pre2_w, pre2_b))
            hidden2 += [(layer.weight.T, layer.bias) for layer in net2[1:-1]]
            last2_w[:, Q_FT_PRESENT] = net2[-1].weight[0]
            by[Q_FT_PRESENT] = net2[-1].bias[0]
        wo = torch.zeros(N_Q, 2, dtype=f64)
        wo[Q_ONE, 0] = wo[Q_ONE, 1] = wo[Q_FT_PRESENT, 1] = 1.0

        def buf(name: str, value: torch.Tensor) -> None:
            self.register_buffer(name, value.detach().float().contiguous())

        # nn.functional.linear takes [out, in] weights: stored transposed.
        for name, value in (("az", az.T), ("cz", cz), ("aq", aq.T), ("cq", cq)):
            buf(name, value)
        for name, value in (("wy", wy.T), ("by", by), ("l2w", last2_w.T), ("wo", wo.T)):
            buf(name, value)
        self.n_hidden1, self.n_hidden2 = len(hidden1), len(hidden2)
        for prefix, layers in (("h1", hidden1), ("h2", hidden2)):
            for i, (w, b) in enumerate(layers):
                buf(f"{prefix}w{i}", w.T)
                buf(f"{prefix}b{i}", b)

    def _mlp(self, prefix: str, n: int, h: torch.Tensor) -> torch.Tensor:
        for i in range(n):
            w, b = getattr(self, f"{prefix}w{i}"), getattr(self, f"{prefix}b{i}")
            h = nn.functional.silu(nn.functional.linear(h, w, b))
        return h

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[N, 11]`` raw features -> ``[N, 2]`` (decode alone ms, decode colocated ms)."""
        linear = nn.functional.linear
        lg = torch.log(linear(x, self.az, self.cz))
        r = torch.relu(linear(lg, self.aq, self.cq))
        c = torch.ceil(r)
        f = torch.cat([lg, x, r, c], dim=1)
        k = torch.cat([f, self._mlp("h1", self.n_hidden1, f)], dim=1) if self.n_hidden1 else f
        y = linear(k, self.wy, self.by)
        if self.n_hidden2:
            y = y + linear(self._mlp("h2", self.n_hidden2, k), self.l2w)
        return torch.exp(linear(y * c, self.wo))
