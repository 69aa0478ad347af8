"""`python -m bench` and its modes (docs/benchmarks.md).

The imports stay inside main(): the load generator's spawned child imports this module too, and must not pay
for numpy, tritonclient or matplotlib.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    given = list(sys.argv[1:] if argv is None else argv)
    if "--memory" in given:
        from bench import memory

        return memory.main(memory.parse_args(given))
    if "--clients" in given:
        from bench import clients

        return clients.main(clients.parse_args(given))
    if "--ab" in given:
        from bench import ab

        return ab.main(ab.parse_args(given))
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
