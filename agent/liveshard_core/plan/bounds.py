"""The lower bound of a change's network bytes, from rank regions alone.

Independent of the matching: it is the figure every plan's network bytes must equal.
"""

from __future__ import annotations

from ..layout.layout import Layout
from ..layout.region import rank_boxes
from ..vps.box import Box, intersect, volume
from ..vps.spec import ModelSpec
from .classes import tensor_classes


def lower_bound_bytes(spec: ModelSpec, old: Layout, new: Layout) -> int:
    """Bytes that new ranks need and did not hold themselves."""
    stage_size = new.dp * new.tp
    total = 0
    for cls in tensor_classes(spec, old, new):
        missing = 0
        for stage in cls.new.stages:
            for rank in range(stage * stage_size, (stage + 1) * stage_size):
                member = new.members[rank]
                needed = rank_boxes(new, cls.new, rank)
                held: list[Box] = []
                if member in old.members:
                    held = rank_boxes(old, cls.old, old.rank_of(member))
                for box in needed:
                    overlap = (intersect(box, h) for h in held)
                    missing += volume(box) - sum(volume(o) for o in overlap if o is not None)
        total += missing * cls.itemsize * len(cls)
    return total
