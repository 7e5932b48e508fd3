"""Process logging: the ``plugtrain`` logger's console handler, per rank."""

from __future__ import annotations

import logging
import sys

logger = logging.getLogger("plugtrain")


class _OncePerMessage(logging.Filter):
    """Let each distinct warning (or error) message through once; INFO always passes."""

    def __init__(self) -> None:
        super().__init__()
        self._seen: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        message = record.getMessage()
        if message in self._seen:
            return False
        self._seen.add(message)
        return True


def setup_logging(rank: int, all_ranks: bool = False) -> None:
    """Configure the ``plugtrain`` logger for this rank.

    Rank 0 logs INFO and above to stderr. Other ranks log warnings and errors only (INFO too
    with ``all_ranks``), prefixed ``[rank N]``, so that a problem on any rank is seen. Each
    distinct warning message is shown once per process, however often it fires. A warning that
    every rank would raise alike (a config check) is issued by rank 0 only, by convention: one
    copy reaches the console without a collective in the logging path. (Python's
    ``warnings.warn`` keeps its own rule: once per code location.)
    """
    handler = logging.StreamHandler(sys.stderr)
    prefix = "" if rank == 0 else f"[rank {rank}] "
    handler.setFormatter(
        logging.Formatter(f"{prefix}%(asctime)s %(levelname)s %(message)s", "%H:%M:%S")
    )
    handler.addFilter(_OncePerMessage())
    logger.handlers[:] = [handler]
    logger.setLevel(logging.INFO if rank == 0 or all_ranks else logging.WARNING)
    logger.propagate = False
