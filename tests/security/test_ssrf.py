"""A benchmark can only reach deployments or URLs an admin allowed, and never echoes a foreign answer."""
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from benchmarks import services
from benchmarks.models import BenchmarkRun
from tests.taskqueue import recording

pytestmark = pytest.mark.django_db
SECRET = "internal-secret-3f9a"


class _Server:
    """A local HTTP server answering each path from a table: (status, headers, body)."""

    def __init__(self, routes):
        self.hits = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self):
                server.hits.append(self.path)
                status, headers, body = routes.get(self.path.split("?")[0], (404, {}, f"not found {SECRET}"))
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body.encode())

            do_GET = do_POST = _answer

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def secret_server():
    server = _Server({"/": (200, {}, json.dumps({"secret": SECRET})), "/v1/models": (200, {}, json.dumps({"secret": SECRET}))})
    yield server
    server.close()


@pytest.mark.parametrize("url", ["http://169.254.169.254/latest/meta-data/", "http://metadata.google.internal/",
                                 "http://127.0.0.1:6379", "http://localhost:5432", "http://[::1]:8000", "http://10.0.0.5:8000"])
def test_without_an_allowlist_no_url_can_be_benchmarked(api, url, sent_tasks):
    response = api.post("/api/runs/", {"base_url": url, "levels": [1]}, format="json")
    assert response.status_code == 403 and "allowlist" in response.json()["error"]["message"]
    assert not sent_tasks and not BenchmarkRun.objects.exists()


@pytest.mark.parametrize("trick", ["{u}/?x=", "{u}/v1?x=", "{u}#", "http://user@{h}", "http://{h}.evil.example",
                                   "http://evil.example/{h}", "{u}/team-a/../admin", "{u}/team-ab", "ftp://{h}",
                                   "https://{h}", "{u}:99999"])
def test_tricks_around_an_allowed_prefix_are_refused(api, settings, trick, sent_tasks):
    settings.BENCHMARK_URL_ALLOWLIST = ["http://127.0.0.1:8123/team-a"]
    url = trick.format(u="http://127.0.0.1:8123", h="127.0.0.1:8123")
    response = api.post("/api/runs/", {"base_url": url, "levels": [1]}, format="json")
    assert response.status_code in (400, 403), url
    assert not BenchmarkRun.objects.exists()
    ok = api.post("/api/runs/", {"base_url": "http://127.0.0.1:8123/team-a/", "levels": [1]}, format="json")
    assert ok.status_code == 202


def _execute(url, settings, served_model=""):
    settings.BENCHMARK_URL_ALLOWLIST = [url]
    with recording():
        run = services.run_create(base_url=url, served_model=served_model, params={"levels": [1], "min_requests": 1,
                                                                                    "requests_per_user": 1, "warmup_per_user": 0})
    return services.run_execute(run.pk)


def test_an_answer_that_is_not_openai_shaped_is_never_echoed(secret_server, settings, viewer_client):
    run = _execute(secret_server.url, settings)
    assert run.status == "failed" and "not an OpenAI API answer" in run.error and SECRET not in run.error
    assert SECRET not in viewer_client.get(f"/benchmarks/{run.pk}/").content.decode()


def test_a_foreign_error_body_during_the_load_is_not_echoed(secret_server, settings):
    run = _execute(secret_server.url, settings, served_model="m")
    text = json.dumps([p.errors for p in run.points.all()]) + run.error
    assert SECRET not in text


def test_a_redirect_to_another_server_is_not_followed(secret_server, settings):
    redirector = _Server({"/v1/models": (302, {"Location": f"{secret_server.url}/v1/models"}, "")})
    try:
        run = _execute(redirector.url, settings)
    finally:
        redirector.close()
    assert run.status == "failed" and SECRET not in run.error and secret_server.hits == []
