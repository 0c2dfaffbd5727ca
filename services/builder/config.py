from __future__ import annotations

from services.common.settings import ServiceSettings


class BuilderConfig(ServiceSettings, frozen=True, kw_only=True):
    port: int = 8130
    concurrency: int = 8  # sessions built at once
    ack_wait_seconds: float = 30.0  # a crashed build is redelivered after this
    max_deliver: int = 10  # then dead-lettered with the reason
    read_batch: int = 256  # completion records fetched per request
    read_timeout_seconds: float = 5.0  # a read of the session's records gives up after this
    # a build waits this long for the records of calls still in flight when the
    # session left RUNNING (then a missing one is reported as a lost call)
    settle_seconds: float = 10.0
    retry_delay_seconds: float = 2.0  # session not yet POSTRUN
