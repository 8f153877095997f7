"""Transfer plans between layouts and the round schedules that execute them.

- `classes`: tensors placed alike under both layouts, planned once;
- `union`: the slots of a change's members and partitions numbered by slot;
- `matching`: the pieces of one class;
- `plan`: the whole plan and its digest; `view`: one member's part; `bounds`: the lower bound;
- `schedule`: rounds under a memory budget.
"""
