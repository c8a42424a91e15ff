"""Structured logging: one JSON object per line on stderr."""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

# attributes every LogRecord has; anything else was passed with ``extra=`` and is logged as a field
_STANDARD_ATTRS = frozenset(
    logging.LogRecord("", 0, "", 0, "", (), None).__dict__.keys() | {"message", "asctime"}
)


class JsonFormatter(logging.Formatter):
    """Formats a record as ``{"ts", "level", "logger", "msg", ...extra fields}``."""

    def format(self, record: logging.LogRecord) -> str:
        """One JSON line; ``extra`` fields are kept, exceptions go to ``exc``."""
        line: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in record.__dict__.items():
            if key not in _STANDARD_ATTRS and key != "color_message" and not key.startswith("_"):
                line[key] = value
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


def configure_logging(level: str) -> None:
    """Send the service's and uvicorn's logs to stderr as JSON lines at ``level``.

    pyhf's own INFO lines (one per modifier of every pyhf model built) show at ``debug`` only.
    """
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logger = logging.getLogger(name)
        logger.handlers[:] = []
        logger.propagate = True
    pyhf_level = logging.DEBUG if level.lower() == "debug" else logging.WARNING
    logging.getLogger("pyhf").setLevel(max(pyhf_level, root.level))
