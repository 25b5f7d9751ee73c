"""Drop counting: messages the Channels layer dropped, counted instead of lost without a trace.

channels-redis's group_send skips every socket whose queue is full (LIVE_CHANNEL_CAPACITY) and only
says so in an INFO log record ("%s of %s channels over capacity in group %s"); nothing reaches the
caller. This filter on its logger counts those records' first argument in Redis (every process adds
to one total, exported by /metrics as panel_live_dropped_messages_total) and logs a warning instead.
"""
import logging

import redis

from plumbing import redisconn

VENDOR_LOGGER = "channels_redis.core"
OVER_CAPACITY = "%s of %s channels over capacity in group %s"
log = logging.getLogger(__name__)


def _key() -> str:
    return redisconn.key("live", "dropped")


class CountDrops(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg != OVER_CAPACITY or not record.args:
            return True
        dropped, members, group = record.args
        try:
            redisconn.client().incrby(_key(), int(dropped))  # rare, and one round trip: fine in the loop
        except (redis.RedisError, OSError):
            pass
        log.warning("live: %s of %s sockets in %s missed a message (their queue is full)", dropped, members, group)
        return False


def count_drops() -> None:
    """Called once per process (AppConfig.ready)."""
    vendor = logging.getLogger(VENDOR_LOGGER)
    if not any(isinstance(f, CountDrops) for f in vendor.filters):
        vendor.addFilter(CountDrops())
    if vendor.getEffectiveLevel() > logging.INFO:
        vendor.setLevel(logging.INFO)  # the record is INFO: a quieter LOG_LEVEL must not hide the drop


def dropped() -> int:
    """Messages dropped so far, all processes together."""
    return int(redisconn.client().get(_key()) or 0)
