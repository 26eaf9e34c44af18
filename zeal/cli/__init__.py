"""The ``zeal`` command line: one module per subcommand, wired in ``main.py``."""
