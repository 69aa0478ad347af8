"""`python -m bench`: see bench/run.py.

The import stays under the guard: the load generator's spawned child imports this module as well, and
must not pay for numpy, tritonclient or matplotlib.
"""

import sys

if __name__ == "__main__":
    from bench.run import main

    sys.exit(main())
