"""The `liveshard` command line: plans between layouts, the layout policy, pipeline rebalancing.

- `liveshard plan`: the transfer plan of a change, the member assignment, and a dry run;
- `liveshard layout`: the layout to use for a number of members, its spares and why;
- `liveshard rebalance`: a pipeline partition from measured layer costs, and packing;
- `liveshard timeline`: a job's story as a PNG, from `liveshard-local --json` lines or from a
  job's status on a cluster (read with kubectl).

Bad arguments exit with status 2 and a one-line reason on stderr.
"""

from __future__ import annotations

import argparse
import json
import sys

from . import layout as layout
from . import plan as plan
from . import rebalance as rebalance
from . import timeline as timeline
from .common import parse_bytes, print_human

__all__ = ["main", "parse_bytes"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="liveshard", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for module in (plan, layout, rebalance, timeline):
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    commands = {"plan": plan, "layout": layout, "rebalance": rebalance, "timeline": timeline}
    run = commands[args.command].run
    try:
        summary = run(args)
    except ValueError as err:
        print(f"liveshard: error: {err}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(summary))
    else:
        print_human(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
