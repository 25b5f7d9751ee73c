"""The node list's live part: each node's last heartbeat, online flag, disk figures and last sample.

At 128 nodes these change about 150 times a second, so GET /api/nodes/ keeps its rows (names, GPUs,
deployments) in plumbing.apicache and reads this part fresh for every request, from Redis in one script
call: by Django in its thread, and by the fast lane on the event loop, with the same code (NODES_LIVE).

Each heartbeat writes its figures to the database (the truth, which the rest of the panel reads) and to a
small Redis hash per node, the mirror. A mirror entry counts only while the cache's versions of EVERYTHING and
of the node table are what they were when it was written:

- any other write to the node table (a registration, an edited node, a cleared heartbeat) voids every entry;
- a process that could not reach Redis owes every other one a bump of EVERYTHING (apicache's debt), which it
  pays once Redis is back, so an entry that might have missed a heartbeat stops counting.

A node without a valid entry is read from the database by Django, which writes the entry back; the lane
leaves such a request to Django. A write never replaces a newer heartbeat.
"""
import logging
import time

import orjson
import redis
from django.utils import timezone
from rest_framework.fields import DateTimeField

from deployments import history
from plumbing import apicache, redisconn

log = logging.getLogger(__name__)
_TABLE = "deployments_node"  # its version voids every entry: the node table changed other than by a heartbeat
_stamp = DateTimeField().to_representation  # the serializer's format: both paths show the same text

# KEYS: the mirror entry, the versions hash. ARGV: heartbeat time (Unix s), the fields as JSON, and the
# versions the figures were read under (EVERYTHING, the node table), or nothing: the current ones.
_WRITE = """
local now = redis.call('HMGET', KEYS[2], '*', 'deployments_node')
local every, table = tonumber(ARGV[3] or now[1] or '0'), tonumber(ARGV[4] or now[2] or '0')
local old = redis.call('HMGET', KEYS[1], 't', 'e', 'n')
if old[1] and tonumber(old[2]) >= tonumber(now[1] or '0') and tonumber(old[3]) >= tonumber(now[2] or '0')
   and tonumber(old[1]) >= tonumber(ARGV[1]) then return 0 end
redis.call('HSET', KEYS[1], 't', ARGV[1], 'f', ARGV[2], 'e', every, 'n', table)
return 1
"""
# KEYS: the versions hash, then per node its history list and its mirror entry. Per node: the last
# sample, then the heartbeat time and fields, or false twice when the mirror does not count.
_READ = """
local now = redis.call('HMGET', KEYS[1], '*', 'deployments_node')
local every, table = tonumber(now[1] or '0'), tonumber(now[2] or '0')
local found = {}
for i = 2, #KEYS, 2 do
  found[#found + 1] = redis.call('LINDEX', KEYS[i], -1)
  local beat = redis.call('HMGET', KEYS[i + 1], 't', 'e', 'n', 'f')
  if beat[1] and tonumber(beat[2]) >= every and tonumber(beat[3]) >= table then
    found[#found + 1] = beat[1]
    found[#found + 1] = beat[4]
  else
    found[#found + 1] = false
    found[#found + 1] = false
  end
end
return found
"""


def _key(node_id: int) -> str:
    return redisconn.key("nodebeat", node_id)


def _fields(last_heartbeat, disk_total, disk_free) -> dict:
    return {"last_heartbeat": _stamp(last_heartbeat) if last_heartbeat else None, "disk_total": disk_total,
            "disk_free": disk_free}


def mirror(node_id: int, last_heartbeat, disk_total, disk_free, versions: dict | None = None, client=None) -> None:
    """Record a heartbeat in the node's mirror entry (skipped when the entry holds a newer valid one). `versions`:
    apicache's versions as found before the figures were read; by default the current ones."""
    stamps = [versions[apicache.EVERYTHING], versions[_TABLE]] if versions else []
    t = repr(last_heartbeat.timestamp()) if last_heartbeat else "0"  # never: offline
    (client or redisconn.client()).eval(_WRITE, 2, _key(node_id), apicache._vkey(), t,
                                        orjson.dumps(_fields(last_heartbeat, disk_total, disk_free)), *stamps)


def record(node_id: int, last_heartbeat=None, disk_total=None, disk_free=None) -> None:
    """After a heartbeat reached the database: mirror it; without a time or disk figures (a disk measured
    outside a heartbeat, say), drop the entry, and the database answers until a list writes it back. A heartbeat
    must not depend on Redis: when it is away, this process owes a bump of EVERYTHING, which voids every entry."""
    try:
        if last_heartbeat is not None and disk_total is not None:
            mirror(node_id, last_heartbeat, disk_total, disk_free)
        else:
            redisconn.client().delete(_key(node_id))
    except (redis.RedisError, OSError) as exc:
        apicache.debt.incur()
        log.warning("node %s: heartbeat not mirrored in Redis (%s); the node list reads the database", node_id, exc)


class NodesLive(apicache.LivePart):
    script = _READ

    def keys(self, answer: dict) -> list[str]:
        keys = [apicache._vkey()]
        for node in answer["results"]:
            keys += [history._key(node["id"]), _key(node["id"])]
        return keys

    def merge(self, answer: dict, found: list | None) -> dict | None:
        """The answer with each node's live fields; None when a node's heartbeat is not in Redis."""
        return self._merged(answer, found, None)

    def fill(self, answer: dict, found: list | None) -> dict:
        """merge(), reading from the database (and writing back to Redis) what Redis did not hold."""
        return self._merged(answer, found, self._from_database)

    @staticmethod
    def _merged(answer: dict, found: list | None, missing) -> dict | None:
        now = time.time()
        results, absent = [], []
        for k, node in enumerate(answer["results"]):
            sample, beat, fields = found[3 * k:3 * k + 3] if found is not None else (None, None, None)
            if beat is None:
                if missing is None:
                    return None
                absent.append(k)
                fields = {"live": orjson.loads(sample) if sample else None}
            else:
                fields = orjson.loads(fields)
                fields["online"] = now - float(beat) < 3 * node["heartbeat_seconds"]
                fields["live"] = orjson.loads(sample) if sample else None
            results.append({**node, **fields})
        if absent:
            missing([results[k] for k in absent])
        return {**answer, "results": results}

    @staticmethod
    def _from_database(nodes: list[dict]) -> None:
        from deployments.models import Node

        try:
            versions = apicache.versions()  # before the rows: figures read under them are at least this new
        except (redis.RedisError, OSError):
            versions = None
        by_id = {node["id"]: node for node in nodes}
        now = timezone.now()
        rows = Node.objects.filter(pk__in=by_id).values_list("id", "last_heartbeat", "heartbeat_seconds", "disk_total",
                                                              "disk_free")
        pipe = redisconn.client().pipeline(transaction=False)
        for pk, beat, every, total, free in rows:
            by_id[pk].update(_fields(beat, total, free), online=Node.is_online(beat, every, now))
            if versions is not None:
                mirror(pk, beat, total, free, versions, client=pipe)
        try:
            pipe.execute()
        except (redis.RedisError, OSError):
            pass  # Redis is away: a later list writes them


NODES_LIVE = NodesLive()
