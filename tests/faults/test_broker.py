"""The broker transport (plumbing/broker.py) on a real redis-server stopped while a consumer holds an unacked
message and has a BRPOP in flight, torn down in the order Celery's consumer does on that connection error
(celery/worker/consumer/consumer.py on_connection_error_after_connected: Connection.collect() closes the channel,
ignoring connection errors, and clears the transport's client; Connection.close() closes the channel again,
ignoring only connection and channel errors). With kombu 5.7's own transport the second close raised
AttributeError ("'NoneType' object has no attribute 'hostname'"), which ended the worker."""
import socket
from contextlib import suppress

import pytest
from kombu import Connection, Queue

from tests.faults.conftest import PrivateRedis

pytestmark = pytest.mark.faults


def test_a_channel_whose_redis_stopped_mid_brpop_closes_as_celery_closes_it():
    server = PrivateRedis()
    server.start()
    try:
        conn = Connection(server.url, transport="plumbing.broker:Transport")
        queue = Queue("broker-fault")
        conn.Producer().publish({"n": 1}, routing_key=queue.name, declare=[queue])
        received = []
        consumer = conn.Consumer([queue], callbacks=[lambda body, message: received.append(message)])
        consumer.qos(prefetch_count=2)  # a slot left free: the next drain leaves a BRPOP in flight
        consumer.consume()
        conn.drain_events(timeout=2)
        with pytest.raises(socket.timeout):
            conn.drain_events(timeout=0.2)
        channel = conn.default_channel
        assert received and not received[0].acknowledged and channel._in_poll
    finally:
        server.stop()
    with suppress(*conn.connection_errors):
        channel.close()  # in collect()
    conn.transport.client = None  # collect()'s Connection._do_close_transport()
    with suppress(*conn.connection_errors, *conn.channel_errors):
        channel.close()  # in close(), through kombu.common.ignore_errors
    assert channel.closed
