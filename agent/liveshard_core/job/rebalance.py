"""`RebalanceSettings`: whether and how a job rebalances its pipeline live from measured costs.

One value everywhere: `spec.rebalance: {enabled, threshold, windowSteps, pack}` in the CRD,
`--rebalance`, `--rebalance-threshold`, `--rebalance-window` and `--pack` of `liveshard-local`,
`rebalance` in the agent's JSON (the members measure over `window_steps`). What the settings
mean is `policy.rebalance`'s.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from ..errors import InvalidInput

_CRD = {"enabled": "enabled", "threshold": "threshold", "window_steps": "windowSteps",
        "pack": "pack"}  # fmt: skip


@dataclass(frozen=True)
class RebalanceSettings:
    enabled: bool = False
    threshold: float = 0.1  # switch when the predicted step time drops by more than this share
    window_steps: int = 10  # steps of measured costs a decision reads (their median)
    pack: bool = False  # use fewer pipeline stages when the work fits, releasing members

    def __post_init__(self) -> None:
        if type(self.enabled) is not bool or type(self.pack) is not bool:
            raise InvalidInput(f"rebalance: enabled={self.enabled!r}, pack={self.pack!r} must "
                               "be true or false")  # fmt: skip
        if not (isinstance(self.threshold, (int, float)) and math.isfinite(self.threshold)
                and 0 < self.threshold < 1):  # fmt: skip
            raise InvalidInput(f"rebalance: threshold={self.threshold!r} must be in (0, 1)")
        if type(self.window_steps) is not int or self.window_steps < 1:
            raise InvalidInput(
                f"rebalance: window_steps={self.window_steps!r} must be an integer >= 1"
            )

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Any, where: str = "rebalance", crd: bool = False) -> RebalanceSettings:
        """From a mapping keyed by field name (or, with `crd`, as `spec.rebalance` spells them);
        errors name `where.key`."""
        keys = {(_CRD[name] if crd else name): name for name in _CRD}
        if not isinstance(data, dict):
            raise InvalidInput(f"{where} must be an object, got {type(data).__name__}")
        unknown = sorted(set(data) - set(keys))
        if unknown:
            raise InvalidInput(f"{where}: unknown field(s) {unknown}; valid: {sorted(keys)}")
        values = {keys[k]: v for k, v in data.items()}
        if type(values.get("threshold")) is int:
            values["threshold"] = float(values["threshold"])
        try:
            return cls(**values)
        except InvalidInput as err:
            message = str(err).removeprefix("rebalance: ")
            for key, name in keys.items():
                message = message.replace(f"{name}=", f"{where}.{key}=")
            raise InvalidInput(message) from None
