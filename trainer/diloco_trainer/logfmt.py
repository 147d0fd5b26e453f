"""One log format for the operator, the syncer and the learner: `text` or `json`.

`json` writes one object per line with the fields Cloud Logging reads from a container's stdout or
stderr (`severity`, `message`, `time`), so a GKE log line is filed at its real level instead of
as an error because it came on stderr. Chosen by a `--log-format` flag, else the
DILOCO_LOG_FORMAT environment variable (the operator sets it to json on the pods it creates),
else text. Stdlib only: the operator image imports it.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

LOG_FORMAT_ENV = "DILOCO_LOG_FORMAT"
FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s level=%(levelname)s logger=%(name)s %(message)s"

# Python level names -> Cloud Logging LogSeverity names (the same but for these).
_SEVERITY = {"WARN": "WARNING", "FATAL": "CRITICAL"}


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time (RFC 3339, UTC), severity, message, logger."""

    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        if record.exc_info:
            message = f"{message}\n{self.formatException(record.exc_info)}"
        if record.stack_info:
            message = f"{message}\n{self.formatStack(record.stack_info)}"
        entry: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(),
            "severity": _SEVERITY.get(record.levelname, record.levelname),
            "message": message,
            "logger": record.name,
        }
        return json.dumps(entry, ensure_ascii=False, default=str)


def resolve_log_format(flag: str | None, env: Mapping[str, str]) -> str:
    """The flag, else DILOCO_LOG_FORMAT, else text; ValueError naming the source if unknown."""
    if flag:
        source, value = "--log-format", flag
    elif env.get(LOG_FORMAT_ENV):
        source, value = LOG_FORMAT_ENV, env[LOG_FORMAT_ENV]
    else:
        return "text"
    value = value.strip().lower()
    if value not in FORMATS:
        raise ValueError(f"{source}: must be one of {', '.join(FORMATS)}, got {value!r}")
    return value


def configure_logging(level: int | str, log_format: str) -> None:
    """Send the root logger's records to stderr in `log_format`. Like logging.basicConfig, it
    does nothing when the root logger already has handlers (e.g. a test harness's)."""
    handler = logging.StreamHandler(sys.stderr)
    if log_format == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter(TEXT_FORMAT))
    logging.basicConfig(level=level, handlers=[handler])
