"""The engine's and the runtime's CUDA branches on one GPU: state, checksums, a switch over NCCL
with the device memory it really takes in each memory mode, and a member training in bf16 with
its layer clock on CUDA events.

Needs a CUDA device; skips cleanly without one (CI has none). NCCL wants one GPU per rank, so on
a one-GPU machine the switch is a one-member transaction: it exercises NCCL group construction
from the store, device buffers and the vote on the device, not transfers between GPUs.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="the transfer engine needs torch (the agent extra)")

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

import math  # noqa: E402
from datetime import timedelta  # noqa: E402

from torch.distributed import HashStore, TCPStore  # noqa: E402

from liveshard_agent.engine.checksum import Checksums  # noqa: E402
from liveshard_agent.engine.state import ShardedState  # noqa: E402
from liveshard_agent.engine.switch import MemoryMode, Reconfiguration  # noqa: E402
from liveshard_agent.local.launcher import HOST, local_config  # noqa: E402
from liveshard_agent.runtime.member import Member  # noqa: E402
from liveshard_core.job import Deadlines, TrainingSettings  # noqa: E402
from liveshard_core.layout.layout import Layout, parse_degrees  # noqa: E402
from liveshard_core.vps.presets import preset  # noqa: E402

CUDA = torch.device("cuda", 0)
CPU = torch.device("cpu")
TINY = preset("tiny")


def test_checksums_on_the_device_equal_those_on_the_host() -> None:
    layout = Layout.create(TINY, ["m0", "m1"], tp=2)
    for rank in range(2):
        on_device = Checksums.of_state(ShardedState.seeded(TINY, layout, rank, 3, CUDA))
        on_host = Checksums.of_state(ShardedState.seeded(TINY, layout, rank, 3, CPU))
        assert torch.equal(on_device.reduced().cpu(), on_host.reduced())


def test_a_switch_commits_over_nccl() -> None:
    old = Layout.create(TINY, ["m0"])
    new = Layout.create(TINY, ["m0"], zero=1)
    reconfig = Reconfiguration(
        spec=TINY, old=old, new=new, member="m0", store=HashStore(), epoch=1, device=CUDA,
        budget=1 << 20, deadlines=Deadlines(30, 60, 90),
    )  # fmt: skip
    reconfig.prepare()
    result = reconfig.switch(ShardedState.seeded(TINY, old, 0, 3, CUDA))
    assert result.committed, result.reason
    assert result.state is not None and result.state.device.type == "cuda"
    assert result.state.matches_seed(3) == []


# Whatever the allocator adds beyond the bytes a switch accounts for: rounding of each block to
# 512 bytes and the checksums' scratch.
SLACK = 1 << 20


@pytest.mark.parametrize("mode", list(MemoryMode), ids=lambda m: m.value)
def test_a_switch_takes_the_device_memory_it_accounts_for(mode: MemoryMode) -> None:
    old = Layout.create(TINY, ["m0"])
    new = parse_degrees("dp=1,zero=3").layout(TINY, ["m0"])
    budget = 1 << 16
    reconfig = Reconfiguration(
        spec=TINY, old=old, new=new, member="m0", store=HashStore(), epoch=1, device=CUDA,
        budget=budget, deadlines=Deadlines(30, 60, 90), memory=mode,
    )  # fmt: skip
    state = ShardedState.seeded(TINY, old, 0, 3, CUDA)
    nbytes = state.nbytes
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    reconfig.prepare()  # the resident mode allocates its shadow here
    result = reconfig.switch(state)
    torch.cuda.synchronize()
    real_extra = torch.cuda.max_memory_allocated() - before
    assert result.committed, result.reason
    assert result.state is not None and result.state.matches_seed(3) == []
    record = result.record
    # The allocator's own peak above the old state is what the switch accounts for: the whole
    # shadow in the resident mode, nothing but the buffers in the bounded mode, where a member
    # that holds every box under both layouts passes them on as they are.
    assert record.peak_extra_bytes <= real_extra + SLACK
    assert real_extra <= record.peak_extra_bytes + SLACK
    if mode is MemoryMode.BOUNDED:
        assert record.kept_bytes == nbytes and real_extra <= budget + SLACK
        assert record.host_bytes == nbytes
    else:
        assert real_extra >= nbytes


def test_a_member_trains_in_bf16_and_times_its_layers_with_cuda_events() -> None:
    store = TCPStore(HOST, 0, None, True, timedelta(seconds=60), wait_for_workers=False)
    config = local_config("qwen3-tiny", TrainingSettings(steps=1 << 20), device="cuda")
    spec = config.model_spec("cuda")
    member = Member(name="m0", spec=spec, settings=config.training, store=store, device=CUDA)
    member.start(parse_degrees("dp=1").layout(spec, ["m0"]))
    assert member.trainer is not None
    params = [t for _, _, t in member.trainer.state.items() if t.dtype == torch.bfloat16]
    assert params, "the model's own dtype on a GPU is bf16 (with an fp32 master copy)"
    records = [member.train_step() for _ in range(12)]
    losses = [r.loss for r in records]
    assert all(math.isfinite(loss) for loss in losses) and losses[-1] < losses[0], losses
    for r in records[1:]:
        costs = r.costs
        assert len(costs.layers) == spec.config.layers
        assert all(s > 0 for s in costs.layers) and costs.first > 0 and costs.last > 0, costs
        # Compute timed on the stream is inside the step, which also waits for the optimizer.
        assert sum(costs.vector()) < r.seconds, (costs, r.seconds)
