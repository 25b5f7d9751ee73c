"""What the code sent to the task queue, recorded where every task leaves the process (`plumbing.queue.deliver`),
so nothing reaches the broker. Tests take the `sent_tasks` fixture (tests/conftest.py) instead of stubbing
`apply_async`, `enqueue` or `node_enqueue` each their own way.

`enqueue` sends once the transaction commits; inside a test's transaction nothing commits, so a test that
looks at what a service enqueued calls `sent_tasks.commit()` first: it runs the on-commit callbacks
registered so far, as the transaction committing there would. `send_now` is recorded at once."""
from contextlib import contextmanager
from dataclasses import dataclass
from unittest import mock

from celery import current_app
from django.db import connection


@dataclass(frozen=True)
class Sent:
    """One task handed to the broker: its registered name, its args and the options it went with."""
    name: str
    args: list
    options: dict

    @property
    def queue(self) -> str | None:
        return self.options.get("queue")


class SentTasks(list):
    """The tasks sent since the recording began, in order."""

    def __init__(self):
        super().__init__()
        self._ran = len(connection.run_on_commit)  # callbacks from before the recording are not ours to run

    def record(self, name: str, args: list, options: dict) -> None:
        assert name in current_app.tasks, f"{name!r} is not a registered task"
        self.append(Sent(name, list(args), dict(options)))

    def names(self) -> list[str]:
        return [s.name for s in self]

    def of(self, name: str) -> list[Sent]:
        return [s for s in self if s.name == name]

    def one(self, name: str) -> Sent:
        """The one task `name` sent (fails if it went out none or several times)."""
        found = self.of(name)
        assert len(found) == 1, f"{name} sent {len(found)} times; sent: {self.names()}"
        return found[0]

    def commit(self) -> "SentTasks":
        """Run the on-commit callbacks registered so far (what `enqueue` waits for), as a commit here would;
        those they register run too. Returns the tasks sent."""
        callbacks = connection.run_on_commit
        self._ran = min(self._ran, len(callbacks))  # a test may have dropped what piled up
        while self._ran < len(callbacks):
            callback = callbacks[self._ran][1]
            self._ran += 1
            callback()
        return self


@contextmanager
def recording():
    """Record every task delivered inside the block; nothing goes to the broker."""
    sent = SentTasks()
    with mock.patch("plumbing.queue.deliver", side_effect=sent.record):
        yield sent
