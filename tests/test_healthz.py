import pytest


@pytest.mark.django_db
def test_the_health_check_answers_without_login_and_says_nothing_else(client):
    response = client.get("/healthz")
    assert response.status_code == 200
    assert response.json() == {"ok": True}
