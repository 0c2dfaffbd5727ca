"""How every service process logs: litestar's default set-up (root at INFO through a
queue handler) plus two things every service needs.

- Every handler redacts (``redact.RedactFilter``): a session token or API key in a
  message, an exception or a stack never reaches a log file.
- HTTP clients log quietly: httpx writes one INFO line per request, which for a
  periodic job (the pool's engine ``/metrics`` poll, every 0.5 s) is hundreds of lines
  of noise; their warnings still come through.
"""

from __future__ import annotations

from litestar.logging.config import LoggingConfig

QUIET_LOGGERS = ("httpx", "httpcore")


def service_logging() -> LoggingConfig:
    config = LoggingConfig(
        filters={"redact": {"()": "services.common.redact.RedactFilter"}},
        loggers={name: {"level": "WARNING"} for name in QUIET_LOGGERS},
    )
    # copies: litestar hands out its module-level defaults
    config.handlers = {k: {**h, "filters": ["redact"]} for k, h in config.handlers.items()}
    return config
