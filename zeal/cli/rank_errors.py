"""Moved to :mod:`zeal.dist.rank_errors` (the launcher's module); kept so old imports work."""

from zeal.dist.rank_errors import (  # noqa: F401
    USER_ERRORS,
    clear_rank_errors,
    exit_status,
    failure_line,
    first_rank_error,
    one_line,
    record_rank_error,
)
