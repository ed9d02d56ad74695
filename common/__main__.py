"""`python -m common <demo>`: the command every README names, handed over to the runner.

The runner is measurement, not ground floor, so it lives in measure/cli.py
(`python -m measure <demo>` is the same command).
"""

import sys

from measure.cli import main

if __name__ == "__main__":
    sys.exit(main())
