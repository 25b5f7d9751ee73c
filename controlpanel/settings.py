"""Settings, read from environment variables (see .env.example).

Defaults run the embedded setup: SQLite in ./var, the embedded Redis that `manage.py panel`
starts when REDIS_URL is unset, and this machine as a node.
"""
import ipaddress
import os
from pathlib import Path

import dj_database_url

BASE_DIR = Path(__file__).resolve().parent.parent


def env_str(name, default=""):
    return os.environ.get(name, default)


def env_bool(name, default=False):
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    return value.strip().lower() in {"1", "true", "yes", "on"}


def env_int(name, default):
    value = os.environ.get(name)
    return int(value) if value not in (None, "") else default


def env_float(name, default):
    value = os.environ.get(name)
    return float(value) if value not in (None, "") else default


def env_list(name, default=""):
    return [item.strip() for item in os.environ.get(name, default).split(",") if item.strip()]


def env_secret(name, default=""):
    """A secret from NAME, or from the file named by NAME_FILE (Docker/systemd secrets)."""
    path = os.environ.get(f"{name}_FILE")
    if path:
        return Path(path).read_text().strip()
    return os.environ.get(name, default)


VAR_DIR = Path(env_str("PANEL_VAR_DIR", str(BASE_DIR / "var")))

DEBUG = env_bool("DEBUG", False)
# Keys anyone can read (in this repo's history, .env.example, docs): sessions signed with them can be forged.
PUBLISHED_SECRET_KEYS = {"change-me", "changeme", "insecure-dev-key-set-SECRET_KEY-in-production", "secret", ""}


def _secret_key() -> str:
    """SECRET_KEY (or SECRET_KEY_FILE), else the key `./panel start` generated in the var folder."""
    key = env_secret("SECRET_KEY")
    if not key and (VAR_DIR / "secret_key").is_file():
        key = (VAR_DIR / "secret_key").read_text().strip()
    if key in PUBLISHED_SECRET_KEYS or key.startswith("django-insecure") or len(key) < 32:
        if DEBUG:  # a development shell: a throwaway key, sessions last as long as the process
            import secrets
            return secrets.token_urlsafe(50)
        from django.core.exceptions import ImproperlyConfigured
        raise ImproperlyConfigured(
            "SECRET_KEY is missing, too short or a published value: set a long random one, e.g. "
            "python -c 'import secrets; print(secrets.token_urlsafe(50))' (./panel start makes one in var/).")
    return key


SECRET_KEY = _secret_key()
ALLOWED_HOSTS = env_list("ALLOWED_HOSTS", "localhost,127.0.0.1,[::1]")
CSRF_TRUSTED_ORIGINS = env_list("CSRF_TRUSTED_ORIGINS")
# Behind HTTPS (docs/security.md, "What to set in production"): cookies sent over HTTPS only, HSTS, and
# the proxy's header that says a request came in over HTTPS (e.g. HTTP_X_FORWARDED_PROTO,https; set it
# only when a proxy always sets or strips that header: a client could send it itself). Off by default:
# `./panel start` serves plain HTTP.
SESSION_COOKIE_SECURE = env_bool("SESSION_COOKIE_SECURE", False)
CSRF_COOKIE_SECURE = env_bool("CSRF_COOKIE_SECURE", False)
SECURE_HSTS_SECONDS = env_int("SECURE_HSTS_SECONDS", 0)
SECURE_HSTS_INCLUDE_SUBDOMAINS = env_bool("SECURE_HSTS_INCLUDE_SUBDOMAINS", False)


def _proxy_ssl_header(value: str):
    if not value:
        return None
    header, _, expected = value.partition(",")
    if not header.strip().startswith("HTTP_") or not expected.strip():
        from django.core.exceptions import ImproperlyConfigured
        raise ImproperlyConfigured("SECURE_PROXY_SSL_HEADER is HEADER,VALUE with Django's name of the header, "
                                   "e.g. HTTP_X_FORWARDED_PROTO,https")
    return header.strip(), expected.strip()


SECURE_PROXY_SSL_HEADER = _proxy_ssl_header(env_str("SECURE_PROXY_SSL_HEADER"))

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "django.contrib.humanize",
    "channels",
    "rest_framework",
    "rest_framework.authtoken",
    "drf_spectacular",
    "django_htmx",
    "axes",
    "plumbing",  # label "controlpanel" (plumbing/apps.py)
    "deployments",
    "deployments.gateway",
    "deployments.notify",
    "benchmarks",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "django_htmx.middleware.HtmxMiddleware",
    "controlpanel.middleware.LoginRequiredMiddleware",
    "axes.middleware.AxesMiddleware",  # last: it turns a lockout into its 429 answer
]
# Login throttling (django-axes): after AXES_FAILURE_LIMIT failed logins for one user name from one
# address, that pair is locked out for AXES_COOLOFF_MINUTES; a success resets the count.
AUTHENTICATION_BACKENDS = ["axes.backends.AxesStandaloneBackend", "django.contrib.auth.backends.ModelBackend"]
AXES_FAILURE_LIMIT = env_int("AXES_FAILURE_LIMIT", 5)
AXES_COOLOFF_TIME = env_float("AXES_COOLOFF_MINUTES", 15.0) / 60  # hours
AXES_LOCKOUT_PARAMETERS = [["username", "ip_address"]]
AXES_RESET_ON_SUCCESS = True
AXES_VERBOSE = False
# Reverse proxies in front of the panel (addresses or networks, comma-separated): only from these is
# X-Forwarded-For believed, for login lockouts and API token throttles (plumbing/clientip.py). Empty: the
# connecting address counts, whatever the header says.
TRUSTED_PROXIES = env_list("TRUSTED_PROXIES", "")
for _proxy in TRUSTED_PROXIES:
    try:
        ipaddress.ip_network(_proxy, strict=False)
    except ValueError:
        from django.core.exceptions import ImproperlyConfigured
        raise ImproperlyConfigured(f"TRUSTED_PROXIES: {_proxy!r} is not an address or a network (e.g. 10.0.0.5, "
                                   "10.0.0.0/24)") from None
AXES_CLIENT_IP_CALLABLE = "plumbing.clientip.client_address"
# Failed API token attempts per client address and minute before 429 (plumbing/apicache.py).
TOKEN_FAILURES_PER_MINUTE = env_int("TOKEN_FAILURES_PER_MINUTE", 20)

ROOT_URLCONF = "controlpanel.urls"
ASGI_APPLICATION = "controlpanel.asgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "builtins": ["controlpanel.templatetags.display"],
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
                "controlpanel.context.roles",
            ],
        },
    },
]

DATABASES = {
    "default": dj_database_url.parse(
        env_str("DATABASE_URL", f"sqlite:///{VAR_DIR / 'panel.sqlite3'}"),
        conn_max_age=env_int("DB_CONN_MAX_AGE", 60), conn_health_checks=True,
    )
}
if DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":
    # Several processes (web, workers, agent) share the file: wait on locks instead of failing.
    DATABASES["default"]["OPTIONS"] = {"timeout": 20, "transaction_mode": "IMMEDIATE"}
    # A file, not memory, so agent and worker processes started by the tests share it (they are
    # given its path); one per test session, so two sessions never flush each other's data.
    DATABASES["default"]["TEST"] = {"NAME": str(VAR_DIR / f"test-panel-{os.getpid()}.sqlite3")}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

# The launcher exports REDIS_URL for the embedded Redis it starts; a bare import falls back to
# the conventional local port.
REDIS_URL = env_str("REDIS_URL", "redis://127.0.0.1:6379/0")

CHANNEL_LAYERS = {
    "default": {
        "BACKEND": "channels_redis.core.RedisChannelLayer",
        # channels-redis waits up to 5 s in each BZPOPMIN and redis-py's asyncio socket timeout is 5 s too: an
        # idle socket's wait raced its own timeout (redis TimeoutError, the live socket dropped). The read may
        # take the blocking wait plus a slow (embedded, busy) Redis's answer time; a lost connection is retried.
        "CONFIG": {"hosts": [{"address": REDIS_URL, "socket_timeout": env_int("REDIS_SOCKET_TIMEOUT", 30),
                              "socket_connect_timeout": 5, "socket_keepalive": True, "retry_on_timeout": True,
                              "health_check_interval": 30}],
                   "prefix": env_str("CHANNELS_PREFIX", "panel"),
                   # Messages queued per socket before channels-redis drops new ones (its default, 100, dropped
                   # 3 % of node samples with 32 nodes x 50 browsers); drops are counted (plumbing/live/drops.py)
                   # and exported as panel_live_dropped_messages_total. The fleet page's samples bypass the layer.
                   "capacity": env_int("LIVE_CHANNEL_CAPACITY", 1000)},
    }
}
# The fleet page gets at most one message per socket each LIVE_TICK_S, with every node that changed
# (plumbing/live/fleetfeed.py): the added latency is at most this, the messages per browser at most 1 / this.
LIVE_TICK_S = env_float("LIVE_TICK_S", 0.05)
# perf/fleet_scale.py times each stage of the fleet feed: with LIVE_TRACE on, a node's fleet state carries when
# it was published ("pub") and when a web process heard it ("heard"), and each message when it was flushed.
LIVE_TRACE = env_bool("LIVE_TRACE", False)
# perf/api_latency.py splits a request's time with SERVER_TIMING on: each answer carries a Server-Timing header
# (W3C) with the wait for a request thread, the time in middleware and view, and whether the API cache answered.
SERVER_TIMING = env_bool("SERVER_TIMING", False)
# Each WebSocket's heartbeat goes through the Channels layer, to a group only that socket is in, every
# LIVE_HEARTBEAT_S; the browser reconnects (and redraws from a snapshot) when three in a row are missing,
# as after Redis restarted empty and forgot every group (plumbing/live/consumer.py, static/panel/live.js).
LIVE_HEARTBEAT_S = env_float("LIVE_HEARTBEAT_S", 3.0)

# How long the smoke test may wait for a just-loaded engine's first answer (a busy host, a first-request compile).
SMOKE_BOUND_S = env_float("PANEL_SMOKE_BOUND_S", 180.0)
CELERY_BROKER_URL = REDIS_URL
# kombu's Redis transport with the fix that keeps a worker alive when Redis goes away mid-BRPOP (plumbing/broker.py).
CELERY_BROKER_TRANSPORT = "plumbing.broker:Transport"
CELERY_RESULT_BACKEND = REDIS_URL
CELERY_TASK_DEFAULT_QUEUE = "control"
CELERY_TASK_ACKS_LATE = True
CELERY_TASK_REJECT_ON_WORKER_LOST = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
# Late acks: a task whose worker dies is delivered again after the visibility timeout. Above the
# longest task (a big download, a slow load), and every host task is idempotent under redelivery
# (each checks its row's state first; downloads hold a per-folder lock).
CELERY_BROKER_TRANSPORT_OPTIONS = {"visibility_timeout": env_int("CELERY_VISIBILITY_TIMEOUT", 12 * 3600)}
CELERY_RESULT_EXPIRES = 3600
CELERY_TASK_ALWAYS_EAGER = env_bool("CELERY_TASK_ALWAYS_EAGER", False)
# Celery beat (the launcher's control worker runs it with -B; compose runs a `beat` service): the notification
# conditions and due deliveries every NOTIFY_BEAT_S.
from deployments.notify.schedule import BEAT_SCHEDULE as CELERY_BEAT_SCHEDULE  # noqa: E402, F401 - plain data, no Django; a setting

# Outgoing mail for notifications (Django's SMTP backend reads these; all optional).
EMAIL_BACKEND = env_str("EMAIL_BACKEND", "django.core.mail.backends.smtp.EmailBackend")
EMAIL_HOST = env_str("EMAIL_HOST", "localhost")
EMAIL_PORT = env_int("EMAIL_PORT", 25)
EMAIL_HOST_USER = env_str("EMAIL_HOST_USER", "")
EMAIL_HOST_PASSWORD = env_secret("EMAIL_HOST_PASSWORD", "")
EMAIL_USE_TLS = env_bool("EMAIL_USE_TLS", False)
EMAIL_TIMEOUT = 10
DEFAULT_FROM_EMAIL = env_str("DEFAULT_FROM_EMAIL", "vllm-panel@localhost")

# Checked wherever a person sets a password (the account page, the admin site, an interactive createsuperuser, the
# launcher's first admin); not by create_user()/set_password() in code.
AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator",
     "OPTIONS": {"min_length": env_int("PASSWORD_MIN_LENGTH", 12)}},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
    {"NAME": "django.contrib.auth.password_validation.NumericPasswordValidator"},
]
# The test suite (controlpanel/pytest_env.py) stores passwords with one MD5 round: PBKDF2's default
# 1,000,000 rounds cost ~0.3 s for every user a test creates or signs in. Checking an existing PBKDF2
# password still works. Never set in production (.env.example does not list it).
if env_str("PANEL_TEST_PASSWORD_HASHER") == "md5":
    PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher",
                        "django.contrib.auth.hashers.PBKDF2PasswordHasher"]
LOGIN_URL = "login"
LOGIN_REDIRECT_URL = "dashboard"
LOGOUT_REDIRECT_URL = "login"

LANGUAGE_CODE = "en-us"
TIME_ZONE = env_str("TIME_ZONE", "UTC")
USE_I18N = False
USE_TZ = True

STATIC_URL = "static/"
STATICFILES_DIRS = [BASE_DIR / "static"]
# Production images run collectstatic into STATIC_ROOT; without it whitenoise serves from the apps.
STATIC_ROOT = env_str("STATIC_ROOT") or None
WHITENOISE_USE_FINDERS = True

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        # Token first: unauthenticated API calls then get 401 + WWW-Authenticate, not 403.
        "plumbing.apicache.CachedTokenAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["plumbing.permissions.IsViewerOrOperator"],
    "DEFAULT_RENDERER_CLASSES": ["plumbing.api.FastJSONRenderer", "rest_framework.renderers.BrowsableAPIRenderer"],
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    "DEFAULT_PAGINATION_CLASS": "plumbing.pagination.Pagination",
    "PAGE_SIZE": 100,
    "EXCEPTION_HANDLER": "plumbing.api.exception_handler",
}
SPECTACULAR_SETTINGS = {
    "TITLE": "vLLM control panel API",
    "DESCRIPTION": "Deploy, watch and benchmark vLLM engines on GPU hosts.",
    "VERSION": "0.1.0",
    "SERVE_INCLUDE_SCHEMA": False,
    "SERVE_PERMISSIONS": ["rest_framework.permissions.IsAuthenticated"],
    "ENUM_NAME_OVERRIDES": {
        "DeploymentStatusEnum": "deployments.models.Deployment.Status",
        "BenchmarkRunStatusEnum": "benchmarks.models.BenchmarkRun.Status",
        "ModelCopyStateEnum": "deployments.models.ModelCopy.State",
    },
}

# --- the panel's own knobs --------------------------------------------------------------
MODEL_STORE = env_str("MODEL_STORE", str(VAR_DIR / "models"))
# Folders an agent reads local models from ("Add a local folder"), beside its model store: set by whoever runs the
# node (an admin), read as the engine user (deployments/host/store.py).
LOCAL_MODEL_ROOTS = env_list("LOCAL_MODEL_ROOTS", "")
NODE_NAME = env_str("NODE_NAME", "")  # default: this machine's hostname
WEB_GC_THRESHOLD = tuple(int(x) for x in env_list("WEB_GC_THRESHOLD", "10000,20,100"))  # see controlpanel/asgi.py
WEB_THREADS = env_int("WEB_THREADS", 16)
# Request bodies past these are refused (413) before they are stored (plumbing/handler.py): with
# credentials (prompt files are up to 20 MB), and without (the login form).
REQUEST_BODY_MAX = env_int("REQUEST_BODY_MAX", 32 << 20)
ANONYMOUS_BODY_MAX = env_int("ANONYMOUS_BODY_MAX", 64 << 10)
# Deployment events long polls one user may hold at once, per web process (the rest answer at once).
LONG_POLLS_PER_USER = env_int("LONG_POLLS_PER_USER", 2)
# Seconds between an open WebSocket's checks that its session and role still hold (logout and role
# changes also close sockets at once; this catches expiry and changes made straight in the database).
WS_RECHECK_SECONDS = env_float("WS_RECHECK_SECONDS", 60.0)
HEARTBEAT_SECONDS = env_float("HEARTBEAT_SECONDS", 5.0)
SAMPLE_SECONDS = env_float("SAMPLE_SECONDS", 1.0)
# On a node without GPUs the whole host is one engine's claim: vLLM engines the panel did not start
# block a deploy there unless it asks to stop them (off for test runs sharing one machine).
CPU_HOST_EXCLUSIVE = env_bool("CPU_HOST_EXCLUSIVE", True)
# Host tasks not started by then are dropped by the worker (a node offline for days must not run
# a deploy when it returns); the agent re-queues downloads and stops it still owes at its start.
HOST_TASK_EXPIRES_S = env_int("HOST_TASK_EXPIRES", 600)
HF_ENDPOINT = env_str("HF_ENDPOINT", "https://huggingface.co")
HF_TOKEN = env_secret("HF_TOKEN")
# A download's transient failures (a reset, a stalled read, 5xx, 429, an expired CDN link) are retried from its
# partial files after this delay, doubled per failure in a row up to a minute; DOWNLOAD_RETRIES failures in a row
# with no new byte between them fail the copy (its partial files kept for Retry).
DOWNLOAD_RETRY_FIRST_S = env_float("DOWNLOAD_RETRY_FIRST_S", 2.0)
DOWNLOAD_RETRIES = env_int("DOWNLOAD_RETRIES", 8)
# The key the Hugging Face token set on the settings page is encrypted with (deployments/sealed.py): made
# 0600 on first use; every host that downloads needs the same file.
HF_TOKEN_KEY_FILE = env_str("HF_TOKEN_KEY_FILE", str(VAR_DIR / "hf-token.key"))
VLLM_BIN = env_str("VLLM_BIN", "vllm")
# The panel's own port (set by `./panel start --port`): never offered to an engine. Engines get the
# first port from ENGINE_PORT_FIRST that no active deployment on the node holds (deployment_free_port).
PANEL_PORT = env_int("PANEL_PORT", 8000)
ENGINE_PORT_FIRST = env_int("ENGINE_PORT_FIRST", 8100)
# Folder of recipe and strategy YAML in vllm-project/recipes' layout (models/<org>/<model>.yaml,
# strategies/*.yaml); empty: the recipes shipped in deployments/recipes/data/.
RECIPES_DIR = env_str("RECIPES_DIR", "")
# Each node's gateway, the one public door to its engines: http://<node address>:GATEWAY_PORT/v1.
GATEWAY_PORT = env_int("GATEWAY_PORT", 4000)
# TLS on every node's gateway, for callers and for the other nodes' gateways (set on every node, or none):
# the node's certificate and key in PEM (its address in the subject alternative names), and the CA the
# gateways check each other's certificates against (the system's store when empty). docs/gateway.md.
GATEWAY_TLS_CERT = env_str("GATEWAY_TLS_CERT", "")
GATEWAY_TLS_KEY = env_str("GATEWAY_TLS_KEY", "")
GATEWAY_TLS_CA = env_str("GATEWAY_TLS_CA", "")
# URL prefixes a benchmark may target besides deployments (benchmarks/allowlist.py); default none.
BENCHMARK_URL_ALLOWLIST = env_list("BENCHMARK_URL_ALLOWLIST")
# What one benchmark may ask for (benchmarks/caps.py, refused with a 400 naming the limit): requests per
# concurrency level, warm-up included, and prompt bytes sent over the whole run; and the memory its load
# generator (a child process of the agent, benchmarks/runner/child.py) may use in all, in MiB
# (0: a quarter of the host's memory, at most 16 GiB). A run that reaches it fails; the engine is untouched.
BENCH_MAX_REQUESTS_PER_LEVEL = env_int("PANEL_BENCH_MAX_REQUESTS_PER_LEVEL", 100_000)
BENCH_MAX_PROMPT_BYTES = env_int("PANEL_BENCH_MAX_PROMPT_BYTES", 8 * 2**30)
BENCH_MEMORY_MB = env_int("PANEL_BENCH_MEMORY_MB", 0)
# Seconds the deployment's GPUs are read with the engine idle before a run's first level, for energy net of idle
# (benchmarks/energy.py); 0: not measured.
BENCH_IDLE_S = env_float("PANEL_BENCH_IDLE_S", 5.0)
# Monitoring (docs/monitoring.md): a read-only secret for /metrics and the service
# discovery (sent as `Authorization: Bearer ...`), and Grafana's URL for links from the pages.
METRICS_TOKEN = env_secret("METRICS_TOKEN")
GRAFANA_URL = env_str("GRAFANA_URL").rstrip("/")

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s: %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "root": {"handlers": ["console"], "level": env_str("LOG_LEVEL", "INFO")},
}
