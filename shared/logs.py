"""Log set-up shared by every process: one line per record, level and logger name first."""

from __future__ import annotations

import logging
import sys


def setup_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        stream=sys.stderr,
        format="%(asctime)s.%(msecs)03d %(levelname)-7s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        force=True,
    )
    # nats-py and aiohttp are chatty at INFO about things our own logs already say.
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
