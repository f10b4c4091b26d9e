"""`python -m tandem`: the `tandem` command without its installed script."""

import sys

from tandem.cli import main

if __name__ == "__main__":
    sys.exit(main())
