"""ampkit's log: `logging.getLogger("ampkit")`, for what ampkit decided on the user's behalf (what
`precision="auto"` chose, and why), said once, on rank 0, as Lightning Fabric says its choices.

Where the program has configured logging (a handler on the root logger or on "ampkit"), the records go there at
INFO, filtered by its levels as any library's. Where nobody has, they would be lost (Python shows only warnings
then), so the first one adds a handler that writes `ampkit: <message>` to stderr at INFO; configure logging, or
`logging.getLogger("ampkit").setLevel(logging.WARNING)`, to change that.
"""

from __future__ import annotations

import logging

LOGGER = "ampkit"


def info(message: str) -> None:
    """Log `message` at INFO on ampkit's logger (to stderr where nobody configured logging)."""
    logger = logging.getLogger(LOGGER)
    if not logger.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("ampkit: %(message)s"))
        logger.addHandler(handler)
        if logger.level == logging.NOTSET:
            logger.setLevel(logging.INFO)
    logger.info(message)
