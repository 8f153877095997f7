"""The engine's CUDA branches: state, checksums and a switch over NCCL, on one GPU.

Needs a CUDA device; skips cleanly without one (CI has none). NCCL wants one GPU per rank, so on
a one-GPU machine the switch is a one-member transaction: it exercises NCCL group construction
from the store, device buffers and the vote on the device, not transfers between GPUs.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="the transfer engine needs torch (the agent extra)")

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from torch.distributed import HashStore  # noqa: E402

from liveshard_agent.engine.checksum import Checksums  # noqa: E402
from liveshard_agent.engine.state import ShardedState  # noqa: E402
from liveshard_agent.engine.switch import Reconfiguration  # noqa: E402
from liveshard_core.job import Deadlines  # noqa: E402
from liveshard_core.layout.layout import Layout  # noqa: E402
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
