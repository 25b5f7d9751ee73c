"""A size-bounded LRU for the web process's caches (plumbing.apicache, plumbing.fastlane)."""
import threading
from collections import OrderedDict


class SizedLRU:
    """A small thread-safe LRU bounded by size (bytes, or entries when each counts 1)."""

    def __init__(self, max_size: int):
        self.max_size, self.size = max_size, 0
        self.entries: OrderedDict = OrderedDict()
        self.lock = threading.Lock()

    def get(self, key):
        with self.lock:
            found = self.entries.get(key)
            if found is None:
                return None
            self.entries.move_to_end(key)
            return found[0]

    def put(self, key, value, size: int) -> None:
        with self.lock:
            old = self.entries.pop(key, None)
            if old is not None:
                self.size -= old[1]
            self.entries[key] = (value, size)
            self.size += size
            while self.size > self.max_size and self.entries:
                _, (_, dropped) = self.entries.popitem(last=False)
                self.size -= dropped

    def clear(self) -> None:
        with self.lock:
            self.entries.clear()
            self.size = 0
