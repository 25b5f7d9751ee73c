"""Loaded by pytest (`-p controlpanel.pytest_env` in pyproject) before Django reads its settings.

It keeps the tests' Redis keys and Channels groups apart from a panel running on the same Redis.
No Django import here: tests/gpu runs where Django is absent.
"""
import os
import secrets
import tempfile

os.environ.setdefault("CHANNELS_PREFIX", "paneltest")
# Database connections close after each request, so none is left open in a web thread when
# pytest drops the test database (PostgreSQL refuses to drop a database in use).
os.environ.setdefault("DB_CONN_MAX_AGE", "0")
# The settings refuse to start without a real key; each test session gets its own.
os.environ.setdefault("SECRET_KEY", secrets.token_urlsafe(50))
# One hashing round for the users the tests create (children inherit it, so they check the same hashes).
os.environ.setdefault("PANEL_TEST_PASSWORD_HASHER", "md5")
# What agents keep between starts (the engine's flags) goes to this session's own folder: shared by the
# session's agents, never by the next session or the user's panel.
os.environ.setdefault("PANEL_CACHE_DIR", tempfile.mkdtemp(prefix="panel-test-cache-"))
# The key the tests' Hugging Face tokens are sealed with: this session's own, never the user's var/hf-token.key.
os.environ.setdefault("HF_TOKEN_KEY_FILE", os.path.join(tempfile.mkdtemp(prefix="panel-test-key-"), "hf-token.key"))


def _worker_apart() -> None:
    """Under pytest-xdist (`./panel test` runs the suite on two workers), each worker gets a Redis database and
    key prefix of its own: its Celery queues (the control queue included), Channels groups, cached answers and
    live state are never another worker's; and default engine ports of its own. The database is pytest-django's
    per-worker test database."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if not worker.startswith("gw"):
        return
    n = int(worker[2:])
    os.environ["CHANNELS_PREFIX"] = f"{os.environ['CHANNELS_PREFIX']}{n}"
    # Engines deployed with the default port: each worker's database knows only its own deployments, so two
    # workers both chose 8100 and one engine's health check answered for the other's (CI: a CLI deploy "ready"
    # in seconds, its smoke test refused). Each worker starts from ports of its own.
    os.environ["ENGINE_PORT_FIRST"] = str(int(os.environ.get("ENGINE_PORT_FIRST", "8100")) + 100 * n)
    url = os.environ.get("REDIS_URL")
    if url:
        base, _, db = url.rpartition("/")
        if not db.isdigit():  # no database named: the URL ends at the host
            base, db = url.rstrip("/"), "0"
        os.environ["REDIS_URL"] = f"{base}/{(int(db) + 1 + n) % 16}"


_worker_apart()
