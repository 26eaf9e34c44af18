"""Moved to :mod:`zeal.dist.quiet_torchrun`; ``python -m zeal.cli.quiet_torchrun`` still runs it."""

import sys

from zeal.dist.quiet_torchrun import main

if __name__ == "__main__":
    sys.exit(main())
