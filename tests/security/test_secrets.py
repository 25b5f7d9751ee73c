"""Secrets in a deployment's settings are write-only: masked for everyone in every place they surface."""
from unittest import mock

import pytest
from rest_framework.test import APIClient

from benchmarks import services as bench
from deployments import secrets
from deployments.host import systemd
from deployments.services import deploys
from tests.factories import DeploymentFactory, ModelCopyFactory, UserFactory

pytestmark = pytest.mark.django_db
TOKEN, KEY = "hf_abcdefghijklmnop", "sk-verysecretkey"


@pytest.fixture
def deployment():
    copy = ModelCopyFactory(path="/models/org/m")
    return DeploymentFactory(node=copy.node, model=copy.model, status="ready",
                             env={"HF_TOKEN": TOKEN, "NCCL_PROTO": "LL", "TOKENIZERS_PARALLELISM": "false"},
                             engine_args={"hf-token": KEY, "max-num-seqs": 8},  # --api-key is the panel's
                             log_tail=f"INFO non-default args: {{'hf_token': '{KEY}'}}\nHF_TOKEN={TOKEN}")


def test_secret_names_are_recognised_and_look_alikes_are_not():
    assert all(map(secrets.is_secret_name, ["HF_TOKEN", "VLLM_API_KEY", "api-key", "AWS_SECRET_ACCESS_KEY", "DB_PASSWORD",
                                            "HUGGING_FACE_HUB_TOKEN", "S3_ACCESSTOKEN"]))
    assert not any(map(secrets.is_secret_name, ["TOKENIZERS_PARALLELISM", "NCCL_PROTO", "max-num-seqs", "KEYS_MAX"][:3]))


def test_the_api_shows_secrets_masked_to_viewers_and_operators(deployment, viewer, operator):
    for user in (viewer, operator):
        client = APIClient()
        client.force_authenticate(user)
        for url in (f"/api/deployments/{deployment.pk}/", "/api/deployments/", f"/api/deployments/{deployment.pk}/logs/",
                    f"/api/deployments/{deployment.pk}/unit/"):
            text = client.get(url).content.decode()
            assert TOKEN not in text and KEY not in text, url
        body = client.get(f"/api/deployments/{deployment.pk}/").json()
        assert body["env"] == {"HF_TOKEN": secrets.MASK, "NCCL_PROTO": "LL", "TOKENIZERS_PARALLELISM": "false"}
        assert body["engine_args"]["hf-token"] == secrets.MASK and body["engine_args"]["max-num-seqs"] == 8


def test_pages_and_the_unit_download_never_show_a_secret(deployment, viewer_client):
    for url in (f"/deployments/{deployment.pk}/", f"/deployments/{deployment.pk}/unit/"):
        response = viewer_client.get(url)
        text = response.content.decode()
        assert response.status_code == 200 and TOKEN not in text and KEY not in text, url
    unit = viewer_client.get(f"/deployments/{deployment.pk}/unit/").content.decode()
    assert "EnvironmentFile=" in unit and "NCCL_PROTO=LL" in unit and "HF_TOKEN" not in unit


def test_the_edit_form_shows_masks_and_a_mask_sent_back_keeps_the_stored_secret(deployment, operator_client, sent_tasks):
    page = operator_client.get(f"/deployments/{deployment.pk}/edit/").content.decode()
    assert TOKEN not in page and KEY not in page and secrets.MASK in page
    deploys.deployment_redeploy(deployment, env={"HF_TOKEN": secrets.MASK, "NCCL_PROTO": "Simple"},
                                 engine_args={"hf-token": secrets.MASK, "max-num-seqs": 8},
                                 user=UserFactory(role="admin"))  # --hf-token is an admin's to set
    deployment.refresh_from_db()
    assert deployment.env == {"HF_TOKEN": TOKEN, "NCCL_PROTO": "Simple"} and deployment.engine_args["hf-token"] == KEY


def test_a_benchmark_environment_snapshot_and_its_exports_hold_no_secret(deployment, viewer_client, sent_tasks):
    run = bench.run_create(params={}, deployment=deployment)
    assert run.environment["env"]["HF_TOKEN"] == secrets.MASK and run.environment["engine_args"]["hf-token"] == secrets.MASK
    for url in (f"/benchmarks/{run.pk}/", f"/benchmarks/{run.pk}/export.json", f"/benchmarks/{run.pk}/export.csv"):
        text = viewer_client.get(url).content.decode()
        assert TOKEN not in text and KEY not in text, url


def test_an_installed_unit_and_its_secret_file_are_readable_by_root_only(tmp_path):
    text = systemd.render_unit(description="d", argv=["vllm", "serve"], env={"A": "1"}, log_path="/l",
                               secret_env_file=str(systemd.env_file_path("vllm-x.service", tmp_path)))
    with mock.patch.object(systemd, "available", return_value=True), \
            mock.patch.object(systemd, "systemctl", return_value="42\n"):
        systemd.install("vllm-x.service", text, unit_dir=tmp_path, secret_env={"HF_TOKEN": 'a"b$c'})
    unit, env_file = tmp_path / "vllm-x.service", tmp_path / "vllm-x.service.env"
    assert unit.stat().st_mode & 0o777 == 0o600 and env_file.stat().st_mode & 0o777 == 0o600
    assert env_file.read_text() == 'HF_TOKEN="a\\"b$c"\n' and "HF_TOKEN" not in unit.read_text()


def test_the_admin_site_shows_secrets_masked(deployment, client):
    from tests.factories import UserFactory

    client.force_login(UserFactory(is_superuser=True, is_staff=True))
    page = client.get(f"/admin/deployments/deployment/{deployment.pk}/change/").content.decode()
    assert "NCCL_PROTO" in page and TOKEN not in page and KEY not in page
