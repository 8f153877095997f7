"""Policies: which layout to use, and how to cut the pipeline.

- `model`: memory per device and step time of a layout (stated formulas);
- `layout`: the layout policy, member count -> layout, spares and why (`choose_layout`);
- `pipeline`: exact minimax pipeline partitions under a memory cap, and packing.
"""
