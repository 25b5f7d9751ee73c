"""The Hub double (tests/hfserver.py) held to what `huggingface_hub`'s own client expects of the Hub.

The real Hub cannot be reached from these machines, so the reference is the client's own parsing: its HfApi and
hf_hub_download, pointed at the double, must read the answers and raise the errors they raise against the Hub
(a gated repo listed to anyone and its files refused with GatedRepoError, a missing repo, revision or file with
RepositoryNotFoundError, RevisionNotFoundError, EntryNotFoundError). A double that answers otherwise fails here."""
from __future__ import annotations

import hashlib
import json
import os
import urllib.request
from pathlib import Path

import pytest
from huggingface_hub import HfApi, hf_hub_download
from huggingface_hub.errors import EntryNotFoundError, GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

from tests.hfserver import serve

TOKEN = "hf_conformance_token_0123456789"
WEIGHTS = os.urandom(300_000)  # a .safetensors file: an LFS file, served through the CDN redirect
CONFIG = json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]})


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    root = tmp_path_factory.mktemp("hub-repos")
    for repo_id, token in (("org/open", None), ("org/gated", TOKEN)):
        repo = root / repo_id
        (repo / "sub").mkdir(parents=True)
        (repo / "model.safetensors").write_bytes(WEIGHTS)
        (repo / "config.json").write_text(CONFIG)
        (repo / "sub" / "notes.txt").write_text("nested\n")
        if token:
            (repo / ".gated").write_text(token)
    with serve(root) as url:
        yield url


@pytest.fixture
def api(hub):
    return HfApi(endpoint=hub, token=False)


def test_model_info_with_files_metadata_gives_sizes_and_lfs_hashes(api):
    info = api.model_info("org/open", files_metadata=True)
    files = {s.rfilename: s for s in info.siblings}
    assert set(files) == {"model.safetensors", "config.json", "sub/notes.txt"}
    assert files["model.safetensors"].size == len(WEIGHTS)
    assert files["model.safetensors"].lfs.sha256 == hashlib.sha256(WEIGHTS).hexdigest()
    assert files["config.json"].size == len(CONFIG) and files["config.json"].lfs is None
    assert info.sha and len(info.sha) == 40 and not info.gated


def test_list_repo_tree_lists_files_and_folders_recursively(api):
    tree = {entry.path: entry for entry in api.list_repo_tree("org/open", recursive=True)}
    assert set(tree) == {"model.safetensors", "config.json", "sub", "sub/notes.txt"}
    assert type(tree["sub"]).__name__ == "RepoFolder" and tree["model.safetensors"].size == len(WEIGHTS)
    assert tree["model.safetensors"].lfs.sha256 == hashlib.sha256(WEIGHTS).hexdigest()
    assert {e.path for e in api.list_repo_tree("org/open", path_in_repo="sub")} == {"sub/notes.txt"}


def test_hf_hub_download_fetches_a_file_and_an_lfs_file_through_the_cdn(hub, tmp_path):
    weights = hf_hub_download("org/open", "model.safetensors", endpoint=hub, cache_dir=tmp_path, token=False)
    assert Path(weights).read_bytes() == WEIGHTS
    nested = hf_hub_download("org/open", "sub/notes.txt", endpoint=hub, cache_dir=tmp_path, token=False)
    assert Path(nested).read_text() == "nested\n"


def test_a_gated_repo_is_listed_without_a_token_and_its_files_are_refused(api, hub, tmp_path):
    info = api.model_info("org/gated")
    assert info.gated and {s.rfilename for s in info.siblings} >= {"config.json"}
    with pytest.raises(GatedRepoError):
        hf_hub_download("org/gated", "config.json", endpoint=hub, cache_dir=tmp_path, token=False)
    with pytest.raises(GatedRepoError):
        hf_hub_download("org/gated", "config.json", endpoint=hub, cache_dir=tmp_path, token="hf_someone_else")
    got = hf_hub_download("org/gated", "config.json", endpoint=hub, cache_dir=tmp_path, token=TOKEN)
    assert Path(got).read_text() == CONFIG


def test_missing_repo_revision_and_file_raise_the_clients_own_errors(api, hub, tmp_path):
    with pytest.raises(RepositoryNotFoundError):
        api.model_info("org/absent")
    with pytest.raises(RepositoryNotFoundError):
        hf_hub_download("org/absent", "config.json", endpoint=hub, cache_dir=tmp_path, token=False)
    with pytest.raises(RevisionNotFoundError):
        api.model_info("org/open", revision="no-such-branch")
    with pytest.raises(RevisionNotFoundError):
        hf_hub_download("org/open", "config.json", revision="no-such-branch", endpoint=hub, cache_dir=tmp_path,
                        token=False)
    with pytest.raises(EntryNotFoundError):
        hf_hub_download("org/open", "absent.json", endpoint=hub, cache_dir=tmp_path, token=False)


def test_a_range_request_gets_206_and_content_range(hub):
    request = urllib.request.Request(f"{hub}/org/open/resolve/main/config.json", headers={"Range": "bytes=2-9"})
    with urllib.request.urlopen(request, timeout=10) as resp:
        assert resp.status == 206
        assert resp.headers["Content-Range"] == f"bytes 2-9/{len(CONFIG)}"
        assert resp.read() == CONFIG.encode()[2:10]
