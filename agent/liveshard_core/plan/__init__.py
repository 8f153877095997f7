"""Transfer plans between layouts and the round schedules that execute them.

- `classes`: tensors placed alike under both layouts, planned once;
- `union`: the slots of a change's members and the geometry of its placements;
- `matching`: the pieces of one class, whole or one member's;
- `plan`: the whole plan and its digest; `view`: one member's part, computed alone; `bounds`:
  the lower bound;
- `schedule`: rounds under a memory budget, whole or one member's; `predict`: the dry run.
"""
