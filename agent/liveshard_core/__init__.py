"""liveshard's pure core: the state model, layouts, member changes, transfer plans and schedules.

Imports neither torch, grpc, kubernetes nor kopf, nor the agent or operator packages (an
import-linter contract keeps it so): the agent and the operator both build on it.
- `vps`: logical tensors, boxes and model specs (the Virtual Parameter Space);
- `layout`: layouts over dp, tp, pp, ep and ZeRO, and the region each rank holds;
- `plan`: transfer plans between layouts, one member's view of them, and round schedules;
- `assign`: which survivor takes which new rank, to move the fewest bytes (exact), with a bound;
- `members`: member changes (drop, replace, lost, add) and their assignment (best or in order);
- `policy`: the layout policy (member count -> layout), memory and step-time estimates, and
  pipeline rebalancing and packing;
- `cli`: the `liveshard` command (`plan`, `layout`, `rebalance`).
"""
