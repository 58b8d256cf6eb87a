"""The trained ``LatencyModel`` folded into a short chain of wide ops, for export.

The runtime scores 64 candidates per call on a shared host CPU within tens of microseconds; at that
size an ONNX Runtime call costs per node, not per FLOP. ``LatencyModel`` computes its derived
features with slices, concatenations and small elementwise ops (about 50 nodes once exported).
``CompactLatencyModel`` computes the same function with every linear step folded into the next
matrix product (in float64 while folding), so the exported graph is, for ``x`` ``[N, 11]``
(12 to 14 nodes after onnxruntime's fusions when the stage-1 networks have equal depth)::

    z = x @ Az + cz            [N, 15]  14 logged roofline/feature columns, share sum
    lg = log(z)
    q = lg @ Aq + cq           [N, Q]   arguments of max(), gates and bucket boundaries, a 1
    r = relu(q);  c = ceil(r)           c: finetune present | shares SMs | 1 | chunk step |
                                        decode step | batch > b_i ... | tokens > t_i ... |
                                        decode share > s_i ...
    f = [lg, x, r, c]          [N, F]   every derived feature is linear in f (bucket logs are
                                        sums of boundary steps)
    h = silu(f @ W1 + b1) ...           stage-1 hidden layers of both networks (decode and
                                        chunk steps) side by side (normalisation folded in)
    y = [f, h] @ Wy + by       [N, Q]   log roofline in Q_ONE, the decode network in
                                        Q_DECODE, the chunk network in Q_CHUNK, the stage-2
                                        log slowdown in Q_FT_PRESENT, 0 elsewhere
    decode_ms = exp((y * c) @ Wo)  [N, 2]  (alone, colocated)

``max(a, b) = b + relu(a - b)``; a step ``v > 0`` is ``ceil(relu(v'))`` with ``v'`` a positive
rescaling of ``v`` that stays at most 1; the gates (``colocated == alone`` without a finetune
quantum; one stage-1 network per kind of step) are the product ``y * c``. Networks with hidden
layers keep them (stage 2's first layer also reads ``[f, h]``; stage-1 networks of different
depths get a chain each).

Where the torch model tests ``ft_tokens > 0``, ``share_sum > 1 + 1e-6`` and ``prefill > 0.5``,
this tests ``log(1 + ft_tokens) > 0``, ``log(share_sum) > log(1 + 1e-6)`` and
``log(1 + prefill) > log 1.5``: the same except within a few float32 ulps of the thresholds
(token counts are integers; shares are 1 or at least 1 + 1/132). Bucket boundaries sit at
``b + 0.5``. Valid for ``ft_tokens < e**64``, ``share_sum < e`` and counts below 1e6.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn

from predictor_models.model import BLOCK, N_LOG, STEP_SCALE, LatencyModel

N_RAW = 11  # input columns (STAGE2_FEATURES)
Z_SHARE_SUM = N_LOG  # z = the N_LOG logged BLOCK columns, then the share sum
N_Z = N_LOG + 1
Q_MAX, Q_FT_PRESENT, Q_SHARES_SMS, Q_ONE, Q_CHUNK, Q_DECODE = range(6)
N_Q_FIXED = 6  # then one column per batch-bucket boundary, per token-bucket boundary, then
# per boundary between the profiled decode SM splits
FT_TOKENS_SCALE = 1.0 / 64.0  # log(1 + ft_tokens) / 64 <= 1
SHARES_SMS_LOG_THRESHOLD = float(np.log(np.float64(np.float32(1.0 + 1e-6))))
CHUNK_LOG_THRESHOLD = math.log(1.5)  # prefill > 0.5
# Columns of x holding the torch model's raw BLOCK columns.
X_SHARE, X_BACKWARD, X_FT_SHARE = 5, 9, 10
LG_BATCH, LG_TOKENS, LG_PREFILL = BLOCK.index("batch+eps"), BLOCK.index("tokens+eps"), 4
LG_SHARE = BLOCK.index("decode_sm_share")

Layers = list[tuple[torch.Tensor, torch.Tensor]]
"""(weight [in, out], bias [out]) per hidden layer, float64."""


def _linear_layers(net: nn.Sequential) -> list[nn.Linear]:
    layers = [m for m in net if isinstance(m, nn.Linear)]
    others = [m for m in net if not isinstance(m, nn.Linear | nn.SiLU)]
    if others:
        raise TypeError(f"cannot fold {others}: only Linear and SiLU layers")
    return layers


def _folded(model: LatencyModel) -> list[list[nn.Linear]]:
    """Each net's (stage 1 decode, chunk, stage 2) linear layers in float64, with its
    normaliser folded into the first."""
    nets = []
    pairs = ((model.norm1, model.net1), (model.normc, model.netc), (model.norm2, model.net2))
    for norm, net in pairs:
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
    return nets


class Layout:
    """Column positions of q and f for one model's bucket lists."""

    def __init__(self, model: LatencyModel) -> None:
        self.batch_steps = model.batch_steps
        self.token_steps = model.token_steps
        self.share_steps = model.share_steps
        self.q_batch = N_Q_FIXED
        self.q_tokens = self.q_batch + len(self.batch_steps[0])
        self.q_share = self.q_tokens + len(self.token_steps[0])
        self.n_q = self.q_share + len(self.share_steps)
        self.f_lg, self.f_x = 0, N_Z
        self.f_relu = N_Z + N_RAW
        self.f_ceil = self.f_relu + self.n_q
        self.n_f = self.f_ceil + self.n_q
        self.first_batch, self.first_token = model.batch_buckets[0], model.token_buckets[0]

    def q_map(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(Aq [N_Z, n_q], cq [n_q]) with ``q = lg @ Aq + cq`` (see the module docstring)."""
        f64 = torch.float64
        aq = torch.zeros(N_Z, self.n_q, dtype=f64)
        cq = torch.zeros(self.n_q, dtype=f64)
        log_mem, log_comp_share, log_share = BLOCK.index("t_mem_ms"), 7, 5
        aq[log_mem, Q_MAX], aq[log_comp_share, Q_MAX], aq[log_share, Q_MAX] = 1.0, -1.0, 1.0
        aq[BLOCK.index("1+ft_tokens"), Q_FT_PRESENT] = FT_TOKENS_SCALE
        aq[Z_SHARE_SUM, Q_SHARES_SMS] = 1.0
        cq[Q_SHARES_SMS] = -SHARES_SMS_LOG_THRESHOLD
        cq[Q_ONE] = 0.5
        aq[LG_PREFILL, Q_CHUNK] = STEP_SCALE
        cq[Q_CHUNK] = -CHUNK_LOG_THRESHOLD * STEP_SCALE
        aq[LG_PREFILL, Q_DECODE] = -1.0
        cq[Q_DECODE] = CHUNK_LOG_THRESHOLD
        for start, row, thresholds in (
            (self.q_batch, LG_BATCH, self.batch_steps[0]),
            (self.q_tokens, LG_TOKENS, self.token_steps[0]),
            (self.q_share, LG_SHARE, self.share_steps),
        ):
            for i, threshold in enumerate(thresholds):
                aq[row, start + i] = STEP_SCALE
                cq[start + i] = -threshold * STEP_SCALE
        return aq, cq

    def log_bucket(
        self, start: int, steps: tuple[list[float], list[float]], first: int
    ) -> tuple[torch.Tensor, float]:
        """(weights on f, constant) of the log bucket from its boundary steps."""
        w = torch.zeros(self.n_f, dtype=torch.float64)
        for i, increment in enumerate(steps[1]):
            w[self.f_ceil + start + i] = increment
        return w, math.log(first)

    def stage1_map(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(M [n_f, 11], m [11]) with decode-step features ``f1 = f @ M + m``."""
        m = torch.zeros(self.n_f, 11, dtype=torch.float64)
        c = torch.zeros(11, dtype=torch.float64)
        for j in range(8):  # log_1p_* (5), log_decode_sm_share, log_t_mem, log_t_comp_x_share
            m[self.f_lg + j, j] = 1.0
        m[:, 8], c[8] = self.log_bucket(self.q_batch, self.batch_steps, self.first_batch)
        # log_t_roof = max(log_t_mem, log_t_comp) = log_t_comp + relu(log_t_mem - log_t_comp)
        m[self.f_lg + 7, 9], m[self.f_lg + 5, 9], m[self.f_relu + Q_MAX, 9] = 1.0, -1.0, 1.0
        m[self.f_x + X_SHARE, 10] = 1.0  # decode_sm_share
        return m, c

    def chunk_map(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(M [n_f, 12 + share steps], m) with chunk-step features ``fc = f @ M + m``."""
        m1, c1 = self.stage1_map()
        n_share = len(self.share_steps)
        m = torch.zeros(self.n_f, 12 + n_share, dtype=torch.float64)
        c = torch.zeros(12 + n_share, dtype=torch.float64)
        m[:, :8], c[:8] = m1[:, :8], c1[:8]
        m[:, 8], c[8] = self.log_bucket(self.q_tokens, self.token_steps, self.first_token)
        m[self.f_lg + LG_TOKENS, 9] = 1.0
        m[:, 10:12], c[10:12] = m1[:, 9:11], c1[9:11]
        for i in range(n_share):
            m[self.f_ceil + self.q_share + i, 12 + i] = 1.0
        return m, c

    def stage2_map(self) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(M [n_f, 11], m [11], column of log_alone): ``f2 = f @ M + m + log_alone * e_col``."""
        m1, c1 = self.stage1_map()
        m = torch.zeros(self.n_f, 11, dtype=torch.float64)
        m[self.f_lg + 0, 0] = 1.0  # log_1p_batch
        m[self.f_x + X_SHARE, 1] = 1.0  # decode_sm_share
        for j, block_col in enumerate(range(8, 12)):  # log ft tokens, seq, rank, sm share
            m[self.f_lg + block_col, 2 + j] = 1.0
        m[self.f_x + X_BACKWARD, 6] = 1.0
        m[self.f_x + X_FT_SHARE, 7] = 1.0
        m[self.f_ceil + Q_SHARES_SMS, 8] = 1.0
        m[self.f_lg + 6, 10] = 1.0  # log_mem_over_roof = log_t_mem - log_t_roof
        m[:, 10] -= m1[:, 9]
        c = torch.zeros(11, dtype=torch.float64)
        c[10] = -c1[9]
        return m, c, 9


def _hidden(net: list[nn.Linear], m: torch.Tensor, c: torch.Tensor) -> Layers:
    """Hidden layers of a net whose inputs are ``f @ m + c``, the first reading f."""
    if len(net) == 1:
        return []
    first = net[0]
    layers = [(m @ first.weight.T, c @ first.weight.T + first.bias)]
    return layers + [(layer.weight.T, layer.bias) for layer in net[1:-1]]


def _side_by_side(a: Layers, b: Layers) -> Layers:
    """Two chains of equal depth as one: first layers concatenated, later ones block-diagonal."""
    out = [(torch.cat([a[0][0], b[0][0]], 1), torch.cat([a[0][1], b[0][1]]))]
    for (wa, ba), (wb, bb) in zip(a[1:], b[1:], strict=True):
        out.append((torch.block_diag(wa, wb), torch.cat([ba, bb])))
    return out


def _output(
    net: list[nn.Linear], m: torch.Tensor, c: torch.Tensor, n_k: int, offset: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights on k [n_k], bias) of a net's scalar output, its last hidden layer at
    ``k[offset:]`` (a linear net reads ``f @ m + c`` directly)."""
    last = net[-1]
    w = torch.zeros(n_k, dtype=torch.float64)
    if len(net) == 1:
        w[: m.shape[0]] = m @ last.weight[0]
        return w, c @ last.weight[0] + last.bias[0]
    w[offset : offset + last.weight.shape[1]] = last.weight[0]
    return w, last.bias[0]


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
        layout = Layout(model)
        n_f, n_q = layout.n_f, layout.n_q
        block_a, block_c = model.block_a.double(), model.block_c.double()
        az = torch.zeros(N_RAW, N_Z, dtype=f64)
        cz = torch.zeros(N_Z, dtype=f64)
        az[:, :N_LOG], cz[:N_LOG] = block_a[:, :N_LOG], block_c[:N_LOG]
        share_sum = BLOCK.index("share_sum")
        az[:, Z_SHARE_SUM], cz[Z_SHARE_SUM] = block_a[:, share_sum], block_c[share_sum]
        aq, cq = layout.q_map()

        net1, netc, net2 = _folded(model)
        m1, c1 = layout.stage1_map()
        mc, cc = layout.chunk_map()
        m2, c2, la_col = layout.stage2_map()
        # stage-1 hidden layers: one chain when both networks have the same depth
        hidden_d, hidden_c = _hidden(net1, m1, c1), _hidden(netc, mc, cc)
        if hidden_d and hidden_c and len(hidden_d) == len(hidden_c):
            chains = [_side_by_side(hidden_d, hidden_c)]
        else:
            chains = [chain for chain in (hidden_d, hidden_c) if chain]
        width_d = hidden_d[-1][0].shape[1] if hidden_d else 0
        width_c = hidden_c[-1][0].shape[1] if hidden_c else 0
        n_k = n_f + width_d + width_c
        w_dec, b_dec = _output(net1, m1, c1, n_k, n_f)
        w_chunk, b_chunk = _output(netc, mc, cc, n_k, n_f + width_d)
        w_one = torch.zeros(n_k, dtype=f64)
        w_one[:n_f], b_one = m1[:, 9], c1[9]  # log_t_roof
        # Stage 2 reads the decode network's log alone, linear in k = [f, hidden outputs].
        la_w, la_b = w_one + w_dec, b_one + b_dec
        w2 = net2[0].weight.T  # [11, out]
        pre2_w = torch.zeros(n_k, w2.shape[1], dtype=f64)
        pre2_w[:n_f] = m2 @ w2
        pre2_w += la_w[:, None] * w2[la_col][None, :]
        pre2_b = c2 @ w2 + la_b * w2[la_col] + net2[0].bias
        wy = torch.zeros(n_k, n_q, dtype=f64)
        by = torch.zeros(n_q, dtype=f64)
        wy[:, Q_ONE], by[Q_ONE] = w_one, b_one
        wy[:, Q_DECODE], by[Q_DECODE] = w_dec, b_dec
        wy[:, Q_CHUNK], by[Q_CHUNK] = w_chunk, b_chunk
        hidden2: Layers = []
        last2_w = torch.zeros(net2[-1].weight.shape[1] if len(net2) > 1 else 0, n_q, dtype=f64)
        if len(net2) == 1:
            wy[:, Q_FT_PRESENT], by[Q_FT_PRESENT] = pre2_w[:, 0], pre2_b[0]
        else:
            hidden2.append((pre2_w, pre2_b))
            hidden2 += [(layer.weight.T, layer.bias) for layer in net2[1:-1]]
            last2_w[:, Q_FT_PRESENT] = net2[-1].weight[0]
            by[Q_FT_PRESENT] = net2[-1].bias[0]
        wo = torch.zeros(n_q, 2, dtype=f64)
        for col in (Q_ONE, Q_DECODE, Q_CHUNK):
            wo[col, 0] = wo[col, 1] = 1.0
        wo[Q_FT_PRESENT, 1] = 1.0

        def buf(name: str, value: torch.Tensor) -> None:
            self.register_buffer(name, value.detach().float().contiguous())

        # nn.functional.linear takes [out, in] weights: stored transposed.
        for name, value in (("az", az.T), ("cz", cz), ("aq", aq.T), ("cq", cq)):
            buf(name, value)
        for name, value in (("wy", wy.T), ("by", by), ("l2w", last2_w.T), ("wo", wo.T)):
            buf(name, value)
        self.chain_depths = [len(chain) for chain in chains]
        self.n_hidden2 = len(hidden2)
        for i, chain in enumerate(chains):
            for j, (w, b) in enumerate(chain):
                buf(f"h1c{i}w{j}", w.T)
                buf(f"h1c{i}b{j}", b)
        for j, (w, b) in enumerate(hidden2):
            buf(f"h2w{j}", w.T)
            buf(f"h2b{j}", b)

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
        hidden = [self._mlp(f"h1c{i}", depth, f) for i, depth in enumerate(self.chain_depths)]
        k = torch.cat([f, *hidden], dim=1) if hidden else f
        y = linear(k, self.wy, self.by)
        if self.n_hidden2:
            y = y + linear(self._mlp("h2", self.n_hidden2, k), self.l2w)
        return torch.exp(linear(y * c, self.wo))
