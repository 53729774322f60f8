"""Peak memory per rank, side by side: zerograph stage 3, FSDP2 eager, FSDP2 + torch.compile, and the plan.

    python examples/memory_side_by_side.py --world-size 64 --json memory.json

The same as ``zerograph memory`` (its flags and definitions: ``zerograph/bench/side_by_side_cli.py``).
"""
from __future__ import annotations

import argparse
import sys

from zerograph.bench.side_by_side_cli import __doc__ as DESCRIPTION
from zerograph.bench.side_by_side_cli import add_arguments, run


def main() -> int:
    parser = argparse.ArgumentParser(description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(), command=" ".join(["python", *sys.argv]))


if __name__ == "__main__":
    sys.exit(main())
