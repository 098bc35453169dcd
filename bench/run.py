"""Run the schedc benchmark: the same as `schedc bench` (schedc/bench/compare.py).

    python bench/run.py --quick -o bench/results
"""

import sys

from schedc.cli.bench import main

if __name__ == "__main__":
    sys.exit(main())
