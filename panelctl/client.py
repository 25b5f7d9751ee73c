"""panelctl's client, beneath every command module: the HTTP client, the error with its exit code, finding a
deployment by name, printing. Command modules import this one; cli.py imports them all."""
import json
import sys

import httpx

EXIT = {400: 2, 409: 3, 401: 4, 403: 4, 404: 5}
FAILED, BAD_INPUT, NOT_FOUND, UNREACHABLE, TIMED_OUT = 1, 2, 5, 6, 7
NOT_FOUND_CODES = {"not_found", "revision_not_found"}


class CliError(Exception):
    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


def exit_code(response) -> int:
    """The exit code of a refusal: by HTTP status, except that a refusal naming something that does not
    exist (a repo or revision the hub does not know, answered 400) is "not found" (5)."""
    try:
        code = response.json()["error"]["code"]
    except (ValueError, KeyError, TypeError):
        code = ""
    return NOT_FOUND if code in NOT_FOUND_CODES else EXIT.get(response.status_code, UNREACHABLE)


class Panel:
    """A thin client: one method per HTTP verb, errors turned into CliError with an exit code."""

    def __init__(self, url: str, token: str, timeout: float = 60.0):
        if not url:
            raise CliError("No panel URL: set PANEL_URL or run `panelctl login --url URL` (it asks for the token).", BAD_INPUT)
        headers = {"Authorization": f"Token {token}"} if token else {}
        self.http = httpx.Client(base_url=url.rstrip("/") + "/api/", headers=headers, timeout=timeout)

    def call(self, method: str, path: str, **kwargs):
        try:
            response = self.http.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise CliError(f"Cannot reach the panel: {exc}", UNREACHABLE) from exc
        if response.status_code >= 400:
            try:
                error = response.json()["error"]
                fields = "; ".join(f"{k}: {' '.join(v)}" for k, v in error.get("fields", {}).items())
                message = error["message"] + (f" ({fields})" if fields and fields not in error["message"] else "")
            except (ValueError, KeyError, TypeError):
                message = response.text[:300]
            raise CliError(f"{method} {path}: {response.status_code} {message}", exit_code(response))
        return response.json() if "json" in response.headers.get("content-type", "") else response.text

    def get(self, path, **params):
        return self.call("GET", path, params=params)

    def post(self, path, body=None, key: str | None = None):
        headers = {"Idempotency-Key": key} if key else {}
        return self.call("POST", path, json=body or {}, headers=headers)


def say(*parts) -> None:
    print(*parts, file=sys.stderr, flush=True)


def number(value: str):
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            continue
    return {"true": True, "false": False}.get(value.lower(), value)


def find_deployment(panel: Panel, ref: str) -> dict:
    if ref.isdigit():
        return panel.get(f"deployments/{ref}/")
    found = panel.get("deployments/", name=ref)["results"]
    if not found:
        raise CliError(f"No deployment named {ref!r}.", NOT_FOUND)
    return panel.get(f"deployments/{found[0]['id']}/")


def emit(data, as_json: bool, lines) -> None:
    if as_json:
        print(json.dumps(data, indent=2, default=str))
    else:
        for line in lines:
            print(line)


def done(data, args):
    emit(data, args.json, [])
    return 0


def with_common(sub, common):
    """Subcommands of `sub` get the `common` options (--json, --idempotency-key) after their name."""
    add = sub.add_parser

    def add_parser(name, **kwargs):
        return add(name, parents=[common], **kwargs)

    sub.add_parser = add_parser
    return sub
