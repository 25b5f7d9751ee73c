"""Real Chromium against the real ASGI app: a gateway key made on the account page is shown once with a Copy
button, is gone from the page after a reload (only its prefix stays), and Revoke marks it revoked; the gateway's
own loader accepts the secret before and refuses it after."""
import pytest
from playwright.sync_api import expect

from deployments.gateway import config, keyset
from tests.conftest import in_thread

pytestmark = pytest.mark.e2e


def _check(secret: str):
    """What a gateway answers for the secret after its next reload: the key, or Refused."""
    try:
        return keyset.authenticate(config.Snapshot(keys=config.load_keys()), f"Bearer {secret}")
    except keyset.Refused as exc:
        return exc


def test_a_key_is_created_seen_once_copied_and_revoked(logged_in_page):
    page = logged_in_page
    page.goto(f"{page.base_url}/account/")
    expect(page.locator("#no-keys")).to_be_visible()
    page.fill("#id_name", "notebook")
    page.fill("#id_model_names", "kimi")
    page.fill("#id_rps_limit", "3")
    page.click("#key-form button[type=submit]")
    secret_box = page.locator("#new-key-secret")
    expect(secret_box).to_be_visible()
    secret = secret_box.text_content()
    assert secret.startswith("vcp-") and len(secret) == 47
    page.click("button[data-copy=new-key-secret]")
    expect(page.locator("button[data-copy=new-key-secret]")).to_have_text("Copied")
    row = page.locator(f'#key-table tr[data-key="{secret[:12]}"]')
    expect(row).to_contain_text("kimi")
    expect(row).to_contain_text("3/s")
    assert in_thread(_check, secret).rps == 3.0

    page.goto(f"{page.base_url}/account/")  # the page again: the secret is not on it any more
    expect(page.locator("#new-key-secret")).to_have_count(0)
    assert secret not in page.content() and secret[:12] in page.content()

    row.locator("button", has_text="Revoke").click()
    expect(page.locator(".messages")).to_contain_text("revoked: every gateway refuses it within a second")
    expect(page.locator(f'#key-table tr[data-key="{secret[:12]}"] .badge')).to_have_text("revoked")
    refused = in_thread(_check, secret)
    assert isinstance(refused, keyset.Refused) and refused.status == 401 and "revoked" in refused.message
