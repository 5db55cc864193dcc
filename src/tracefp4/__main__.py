"""``python -m tracefp4 <command> ...``: the ``tracefp4`` command without the console script."""

import sys

from tracefp4.cli import main

if __name__ == "__main__":
    sys.exit(main())
