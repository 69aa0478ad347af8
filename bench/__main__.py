"""`python -m bench` and its modes (docs/benchmarks.md).

The imports stay inside main(): the load generator's spawned child imports this module too, and must not pay
for numpy, tritonclient or matplotlib.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    given = list(sys.argv[1:] if argv is None else argv)
    for mode in ("memory", "clients", "ab"):  # modes of their own, each with its own arguments
        if f"--{mode}" in given:
            module = importlib.import_module(f"bench.{mode}")
            return int(module.main(module.parse_args(given)))
    from bench import frontend, run

    args = run.parse_args(argv)
    if args.frontend:
        return frontend.main(args, argv)
    status, out, stopper = run.classic(args, argv)
    if args.both:
        print(flush=True)
        status = frontend.main(run.front_args(args), argv, out / "frontend", stopper) or status
    return status


if __name__ == "__main__":
    sys.exit(main())
