"""liveshard's pure core: the state model, layouts, member changes, transfer plans and schedules.

Imports neither torch, grpc, kubernetes nor kopf, nor the agent or operator packages (an
import-linter contract keeps it so): the agent and the operator both build on it.
- `vps`: logical tensors, boxes and model specs (the Virtual Parameter Space);
- `layout`: layouts over dp, tp, pp, ep and ZeRO, and the region each rank holds;
- `plan`: transfer plans between layouts, one member's view of them, and round schedules;
- `members`: member changes (drop, replace, lost, add);
- `cli`: the `liveshard` command.
"""
