"""Model metadata from the Hugging Face Hub (or a mirror): a revision pinned to a commit, its files
with sizes and hashes, its config.json. The files themselves: host/downloads.py."""

from __future__ import annotations

import importlib
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

from huggingface_hub import HfApi, hf_hub_download
from huggingface_hub.errors import (
    GatedRepoError,
    HfHubHTTPError,
    HFValidationError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

from deployments.host.errors import HostError

DEFAULT_ENDPOINT = "https://huggingface.co"
METADATA_TIMEOUT_S = 30.0
CHECK_TIMEOUT_S = 10.0  # the existence check a model add waits for; the Hub answers it in well under a second
MAX_CONFIG_BYTES = 16 << 20
USER_AGENT = "vllm-controlpanel"


def _importable(module: str, name: str) -> list[type[BaseException]]:
    try:
        return [getattr(importlib.import_module(module), name)]
    except (ImportError, AttributeError):
        return []


# huggingface_hub 2.x raises httpx2 errors, 1.x httpx errors, older releases requests errors.
TRANSPORT_ERRORS: tuple[type[BaseException], ...] = (
    OSError, *_importable("httpx2", "TransportError"), *_importable("httpx", "TransportError"),
    *_importable("requests", "RequestException"))


class HubError(HostError):
    """A Hub failure with a user-facing message and a code the pages and the API show."""

    def __init__(self, message: str, permanent: bool, code: str, retry_after: float | None = None):
        super().__init__(message, permanent)
        self.code, self.retry_after = code, retry_after  # retry_after: the server's Retry-After, in seconds

    def __reduce__(self):  # so it survives pickling (Celery results, multiprocessing)
        return HubError, (self.message, self.permanent, self.code, self.retry_after)


@dataclass(frozen=True)
class RepoFile:
    """One file of a repo: sha256 is set for LFS files, blob_id is the git object id."""

    path: str
    size: int
    sha256: str | None
    blob_id: str | None


@dataclass(frozen=True)
class RepoInfo:
    """A repo pinned to one commit, with its files and parsed config.json."""

    repo_id: str
    revision: str
    commit: str
    files: list[RepoFile]
    config: dict | None
    total_size: int


def endpoint_url(endpoint: str | None) -> str:
    return (endpoint or os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")


def file_url(endpoint: str, repo_id: str, commit: str, path: str) -> str:
    """The resolve URL of one file at one commit."""
    return f"{endpoint.rstrip('/')}/{repo_id}/resolve/{commit}/{quote(path)}"


def _gated_message(repo_id: str, token: str | None) -> str:
    if token:
        return f"The token given has no access to '{repo_id}'. Request access on its model page, then retry."
    return f"'{repo_id}' is gated or private: a Hugging Face token with access to it is needed."


def status_error(status: int, repo_id: str, token: str | None, endpoint: str, what: str = "") -> HubError:
    if status in (401, 403):
        return HubError(_gated_message(repo_id, token), True, "gated")
    if status == 404:
        return HubError(f"{what or repo_id} was not found on {endpoint}.", True, "not_found")
    if status >= 500 or status in (408, 429):
        return HubError(f"{endpoint} is unavailable (HTTP {status}); retry later.", False, "unavailable")
    return HubError(f"{endpoint} refused {what or repo_id} (HTTP {status}).", True, "http_error")


def _metadata_error(e: Exception, repo_id: str, revision: str, endpoint: str, token: str | None) -> HubError:
    if isinstance(e, GatedRepoError):  # a subclass of RepositoryNotFoundError: test it first
        return HubError(_gated_message(repo_id, token), True, "gated")
    if isinstance(e, RepositoryNotFoundError):
        hint = "" if token else " If it is private, a token with access is needed."
        return HubError(f"Model '{repo_id}' was not found on {endpoint}.{hint}", True, "not_found")
    if isinstance(e, RevisionNotFoundError):
        return HubError(f"Revision '{revision}' does not exist in '{repo_id}'.", True, "revision_not_found")
    if isinstance(e, HFValidationError):
        return HubError(f"'{repo_id}' is not a valid model id (expected 'org/name').", True, "not_found")
    if isinstance(e, HfHubHTTPError):
        return status_error(e.response.status_code if e.response is not None else 0, repo_id, token, endpoint)
    if isinstance(e, TRANSPORT_ERRORS):
        return HubError(f"{endpoint} could not be reached ({type(e).__name__}: {e}).", False, "unavailable")
    raise e


def repo_info(repo_id: str, revision: str = "main", token: str | None = None,
              endpoint: str | None = None) -> RepoInfo:
    """Resolve a revision to a commit and list its files with sizes, hashes and config.json."""
    endpoint = endpoint_url(endpoint)
    api = HfApi(endpoint=endpoint, token=token or False)  # False: never a token found on disk
    try:
        info = api.model_info(repo_id, revision=revision, files_metadata=True, timeout=METADATA_TIMEOUT_S)
        siblings = info.siblings or []
        if any(s.size is None for s in siblings):
            # Some mirrors omit sizes in model_info; the tree listing always has them.
            siblings = [f for f in api.list_repo_tree(repo_id, revision=info.sha, recursive=True)
                        if hasattr(f, "blob_id")]
        files = [RepoFile(getattr(s, "rfilename", None) or s.path, int(s.size),
                          s.lfs.sha256 if s.lfs else None, s.blob_id) for s in siblings]
        config = _fetch_config(api, repo_id, info.sha) if any(f.path == "config.json" for f in files) else None
    except Exception as e:
        raise _metadata_error(e, repo_id, revision, endpoint, token) from e
    return RepoInfo(repo_id, revision, info.sha, files, config, sum(f.size for f in files))


def repo_check(repo_id: str, revision: str = "main", token: str | None = None, endpoint: str | None = None,
               timeout: float = CHECK_TIMEOUT_S) -> str:
    """The commit `revision` of `repo_id` is at, in one small request (no file list): HubError when the hub
    does not know the repo or the revision (permanent) or cannot be asked now (not permanent)."""
    endpoint = endpoint_url(endpoint)
    api = HfApi(endpoint=endpoint, token=token or False)  # False: never a token found on disk
    try:
        return api.model_info(repo_id, revision=revision, timeout=timeout).sha
    except Exception as e:
        raise _metadata_error(e, repo_id, revision, endpoint, token) from e


def _fetch_config(api: HfApi, repo_id: str, commit: str) -> dict | None:
    with tempfile.TemporaryDirectory(prefix="hub-config-") as tmp:
        path = hf_hub_download(repo_id, "config.json", revision=commit, endpoint=api.endpoint,
                               token=api.token, local_dir=tmp)
        try:
            config = json.loads(Path(path).read_bytes()[:MAX_CONFIG_BYTES])
        except ValueError:
            return None  # a repo with a broken config.json is still downloadable
    return config if isinstance(config, dict) else None
