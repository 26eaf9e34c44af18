"""Moved to :mod:`zeal.dist.rank_main`; ``python -m zeal.cli.rank_main`` still runs it."""

import sys

from zeal.dist.rank_main import main

if __name__ == "__main__":
    sys.exit(main())
