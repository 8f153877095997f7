"""The job contract: what a job trains and how it switches, one frozen value each, parsed once.

`TrainingSettings` (the training's settings), `Deadlines` (one type for every deadline),
`JobConfig` (what every member of a job shares: the model, its precision and device rule, the
settings, the deadlines, the transfer budget) and the outcomes a reconfiguration ends with
(`Result`, `Cause`). The operator parses them once from the CRD, the agent once from the JSON the
operator sends, the local launcher once from its flags (`flags`): a new setting is one field here,
one schema entry in the CRD and a flag that derives from its name.
"""

from .config import DEFAULT_BUDGET, DEFAULT_METRICS_PORT, DEFAULT_PORT, MEMBER_KEY, JobConfig
from .deadlines import Deadlines
from .outcome import Cause, Result
from .settings import TrainingSettings

__all__ = [
    "DEFAULT_BUDGET",
    "DEFAULT_METRICS_PORT",
    "DEFAULT_PORT",
    "MEMBER_KEY",
    "Cause",
    "Deadlines",
    "JobConfig",
    "Result",
    "TrainingSettings",
]
