"""The Celery broker transport: kombu's Redis transport with one fix, so that a worker survives Redis going away
while its consumer waits on a BRPOP (`CELERY_BROKER_TRANSPORT` in settings names this module's Transport).

The crash it fixes (kombu 5.7.0, celery 5.7.0, the newest releases): on the connection error Celery's consumer
calls `Connection.collect()` and then `Connection.close()`. collect() closes the default channel, whose
`Channel.close()` first reads the reply of the BRPOP in flight (`_brpop_read`); on a connection that is gone that
raises ConnectionError, which collect() swallows, so the channel is left half-closed (`closed` still False), and
collect() then clears the transport's `client`. close() closes the same channel again: this time it gets as far
as restoring the unacked messages, through a new pool built from `transport.client`, now None:
`AttributeError: 'NoneType' object has no attribute 'hostname'` (redis.py `_connparams`), not a connection error,
so it ends the worker ("Unrecoverable error") and with it the node agent. A BRPOP is in flight whenever the
consumer has a free prefetch slot, so a worker with more threads than running tasks met it at every Redis restart
(the node agent's 4 threads did, with a load and a download running).

Here a BRPOP reply that cannot be read during close() is taken as no reply (Empty, which close() expects): close()
then runs to the end in collect(), while the transport still has its client, as it does when no BRPOP is in
flight; restoring the unacked messages fails there with a connection error, which collect() swallows, and the
messages stay in Redis's unacked hash (ack emulation), redelivered after the visibility timeout if still unacked.
"""
from queue import Empty

from kombu.transport import redis


class Channel(redis.Channel):
    def _brpop_read(self, **options):
        try:
            return super()._brpop_read(**options)
        except self.connection_errors:
            if self._closing:  # close() drains the BRPOP in flight: on a lost connection there is nothing to drain
                raise Empty() from None
            raise


class Transport(redis.Transport):
    Channel = Channel
