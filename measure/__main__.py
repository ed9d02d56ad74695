"""`python -m measure <demo>`: the same runner as `python -m common <demo>` (measure/cli.py)."""

import sys

from measure.cli import main

if __name__ == "__main__":
    sys.exit(main())
