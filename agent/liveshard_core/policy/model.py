"""What a layout costs a device: memory (state and activations) and time per training step.

Both are estimates from the model spec and stated formulas, for choosing among layouts; they are
not measurements. Symbols: `P_s` parameters a device of stage `s` holds (its tp share of every
tensor the stage holds, experts divided by ep too), `G` its dp group (dp, or dp/ep for experts),
`b` micro-batch (sequences), `q` sequence length, `h` hidden, `V` vocab, `m = B / (dp b)`
micro-batches per replica for a global batch of `B` sequences.

Memory of a device of stage `s`, in bytes (mixed-precision Adam, bf16 or fp16 parameters):

    params     = 2 P_s                  (/ G under ZeRO-3)
    grads      = 2 P_s                  (/ G under ZeRO-3)
    optimizer  = 12 P_s (8 for fp32 parameters: no master copy)   (/ G under ZeRO-1 and 3)
    activation = L_s * 34 q b h / tp * min(pp - s, m)       (+ 4 q b V / tp on the last stage)

The activation term is Korthikanti et al. (2022) with sequence parallelism and selective
recomputation (34 bytes per token and hidden unit per layer, split by tp); under 1F1B stage `s`
keeps up to `pp - s` micro-batches in flight; the last stage also holds fp32 logits.

Step time, in seconds (nothing overlapped, a conservative bound):

    compute = max_s 6 A_s (B q / dp) / (tp F e)        (A_s: parameters of stage s that a token
                                                          uses; experts count top_k / E)
    bubble  = compute * (pp - 1) / m
    tp      = max_s L_s * m * 4 * 2 (tp-1)/tp * 2 q b h / bw_tp
    pp      = 2 m * 2 q b h / tp / bw_net                          (when pp > 1)
    dp      = max_s 2 (G-1)/G * 2 P_s / bw_net                      (gradient reduction)
    ep      = max_s E_s * m * 4 * (ep-1)/ep * 2 q b h top_k / bw_net  (E_s: MoE layers of s)

where `F` is the device's peak FLOP/s, `e` the fraction of it reached, `bw_tp` the tp link
(NVLink) and `bw_net` the network per device. Attention's quadratic FLOPs are left out.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

from ..layout.layout import Layout
from ..vps.spec import DType, ModelSpec, Placement


@dataclass(frozen=True)
class Workload:
    """The training job's batch shape."""

    global_batch: int  # sequences per step
    micro_batch: int = 1  # sequences per micro-batch
    seq_len: int = 4096


@dataclass(frozen=True)
class Hardware:
    """One device and its links."""

    memory: int = 80 << 30  # bytes
    flops: float = 989e12  # peak dense bf16 FLOP/s (an H100 SXM)
    efficiency: float = 0.5  # fraction of the peak that training reaches
    tp_bandwidth: float = 450e9  # bytes/s per device inside a node (NVLink)
    network_bandwidth: float = 25e9  # bytes/s per device across nodes
    latency: float = 10e-6  # seconds a collective or message costs whatever its size


@dataclass(frozen=True)
class StageLoad:
    """What one pipeline stage holds per device."""

    params: int  # P_s: parameters per device
    expert_params: int  # the part of P_s in experts (sharded over dp/ep, not dp)
    active_params: float  # A_s: parameters a token uses on this stage, per device
    layers: int
    moe_layers: int


@dataclass(frozen=True)
class Estimate:
    """Memory per device (the largest stage) and step time of a layout."""

    memory: int
    memory_parts: dict[str, int]
    step_seconds: float
    step_parts: dict[str, float]


@dataclass(frozen=True)
class _Sums:
    """Parameter counts of a spec, split by how tp and ep divide them."""

    per_layer: tuple[tuple[int, int, int, int], ...]  # (split, whole, expert split, expert whole)
    ends: tuple[
        tuple[Placement, int, int], ...
    ]  # embedding, final norm, head: (where, split, whole)


_SUMS: dict[str, _Sums] = {}


def _sums(spec: ModelSpec) -> _Sums:
    if spec.digest not in _SUMS:
        layers = [[0, 0, 0, 0] for _ in range(spec.config.layers)]
        ends = []
        for p in spec.params:
            n = prod(p.shape)
            split = p.split_dim is not None
            if p.layer is None:
                ends.append((p.placement, n if split else 0, 0 if split else n))
            else:
                layers[p.layer][(2 if p.expert is not None else 0) + (0 if split else 1)] += n
        _SUMS[spec.digest] = _Sums(tuple(tuple(x) for x in layers), tuple(ends))  # type: ignore[misc]
    return _SUMS[spec.digest]


def stage_loads(spec: ModelSpec, layout: Layout) -> list[StageLoad]:
    """Parameters per device on each stage of `layout`."""
    cfg = spec.config
    sums = _sums(spec)
    tp, ep = layout.tp, layout.ep
    params = [0] * layout.pp
    experts = [0] * layout.pp
    active = [0.0] * layout.pp
    for layer, (split, whole, e_split, e_whole) in enumerate(sums.per_layer):
        s = layout.stage_of_layer[layer]
        dense = split // tp + whole
        expert = (e_split // tp + e_whole) // ep
        params[s] += dense + expert
        experts[s] += expert
        active[s] += dense + (expert * ep * cfg.top_k / cfg.experts if cfg.experts else 0)
    for placement, split, whole in sums.ends:
        n = split // tp + whole
        stages = {Placement.FIRST: (0,), Placement.LAST: (layout.pp - 1,)}.get(
            placement, tuple({0, layout.pp - 1})
        )
        for s in stages:
            params[s] += n
            active[s] += n
    moe = cfg.experts > 0
    return [
        StageLoad(params[s], experts[s], active[s], layout.pp_layers[s],
                  layout.pp_layers[s] if moe else 0)
        for s in range(layout.pp)
    ]  # fmt: skip


def estimate(
    spec: ModelSpec,
    layout: Layout,
    work: Workload,
    hw: Hardware,
    loads: list[StageLoad] | None = None,
) -> Estimate:
    """Memory per device and step time of `layout` (module docstring); `loads` are its
    `stage_loads`, when the caller has them (they depend on tp, pp, ep and pp_layers only)."""
    cfg = spec.config
    tp, pp, dp, ep = layout.tp, layout.pp, layout.dp, layout.ep
    m = work.global_batch / (dp * work.micro_batch)
    param_bytes = cfg.param_dtype.itemsize
    optimizer_bytes = 8 if cfg.param_dtype is DType.FP32 else 12
    token_layer = 34 * work.seq_len * work.micro_batch * cfg.hidden / tp
    memory, memory_parts = -1, {}
    compute = tp_time = dp_time = ep_time = 0.0
    msg = 2 * work.seq_len * work.micro_batch * cfg.hidden  # one activation tensor, bf16
    for s, load in enumerate(loads or stage_loads(spec, layout)):
        dense = load.params - load.expert_params
        shard3 = dense / dp + load.expert_params / (dp // ep) if layout.zero >= 3 else load.params
        shard1 = dense / dp + load.expert_params / (dp // ep) if layout.zero >= 1 else load.params
        # A mirrored layout holds its predecessor's ZeRO shards too, and without replicas
        # (dp = 1) its peer's boxes (experts of ep = dp are left out: a small part).
        mirror = 2 if layout.mirror else 1
        once = dp == 1
        parts = {
            "params": int(param_bytes * shard3 * (mirror if layout.zero >= 3 or once else 1)),
            "grads": int(param_bytes * shard3),
            "optimizer": int(optimizer_bytes * shard1 * (mirror if layout.zero or once else 1)),
            "activations": int(
                load.layers * token_layer * min(pp - s, max(m, 1))
                + (4 * work.seq_len * work.micro_batch * cfg.vocab / tp if s == pp - 1 else 0)
            ),
        }
        total = sum(parts.values())
        if total > memory:
            memory, memory_parts = total, parts
        tokens = work.global_batch * work.seq_len / dp
        compute = max(compute, 6 * load.active_params * tokens / (hw.flops * hw.efficiency))
        if tp > 1:  # 4 all-reduces per layer and micro-batch: 2 forward, 2 backward
            per_step = load.layers * m * 4
            tp_bytes = per_step * 2 * (tp - 1) / tp * msg / hw.tp_bandwidth
            tp_time = max(tp_time, tp_bytes + per_step * hw.latency)
        group = dp
        if dp > 1:
            reduce = dense * 2 * (dp - 1) / dp
            if load.expert_params and dp // ep > 1:
                group = dp // ep
                reduce += load.expert_params * 2 * (group - 1) / group
            dp_time = max(dp_time, param_bytes * reduce / hw.network_bandwidth + hw.latency)
        if ep > 1:
            ep_bytes = load.moe_layers * m * 4 * (ep - 1) / ep * msg * cfg.top_k
            ep_time = max(
                ep_time, ep_bytes / hw.network_bandwidth + load.moe_layers * m * 4 * hw.latency
            )
    step = {
        "compute": compute,
        "bubble": compute * (pp - 1) / m,
        "tp": tp_time,
        "pp": 2 * m * (msg / tp / hw.network_bandwidth + hw.latency) if pp > 1 else 0.0,
        "dp": dp_time,
        "ep": ep_time,
    }
    return Estimate(memory, memory_parts, sum(step.values()), step)


def state_bytes_per_layer(spec: ModelSpec, layout: Layout) -> tuple[tuple[int, ...], int, int]:
    """Training state per device of each layer, of the embedding and of the head under
    `layout`: parameters, gradients and optimizer state, ZeRO-sharded (and mirrored) as in
    `estimate`."""
    cfg = spec.config
    param_bytes = cfg.param_dtype.itemsize
    optimizer_bytes = 8 if cfg.param_dtype is DType.FP32 else 12
    layers = [0.0] * cfg.layers
    first = last = 0.0
    for p in spec.params:
        n = prod(p.shape) / (layout.tp if p.split_dim is not None else 1)
        group = layout.dp
        if p.expert is not None:
            n /= layout.ep
            group = layout.dp // layout.ep
        # A mirrored shard is held twice, and so is a box no replica holds: its peer holds a
        # copy (along dp or pp; along tp only a split tensor's, `region.place`).
        tied = p.placement is Placement.FIRST_AND_LAST and layout.pp > 1  # two stages hold it
        peered = layout.dp > 1 or layout.pp > 1 or p.split_dim is not None
        once = group == 1 and peered and not tied
        copies = 2 if layout.mirror and (group > 1 or once) else 1
        params = param_bytes * (copies / group if layout.zero >= 3 or once else 1)
        grads = param_bytes / (group if layout.zero >= 3 else 1)
        optimizer = optimizer_bytes * (copies / group if layout.zero >= 1 or once else 1)
        b = n * (params + grads + optimizer)
        if p.layer is not None:
            layers[p.layer] += b
        elif p.name == "embed":
            first += b
            if p.aliases:
                last += b
        else:
            last += b
    return tuple(int(x) for x in layers), int(first), int(last)
