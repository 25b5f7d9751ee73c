"""Who may read /metrics and the Prometheus service discovery: any viewer (session or API token,
through the API's own authentication classes) or a scraper holding METRICS_TOKEN, a read-only
secret that opens these two endpoints and nothing else."""
import hmac

from django.conf import settings
from django.contrib.auth.models import AnonymousUser
from rest_framework.authentication import BaseAuthentication, get_authorization_header
from rest_framework.exceptions import AuthenticationFailed
from rest_framework.permissions import BasePermission
from rest_framework.settings import api_settings

from plumbing.roles import is_viewer

SCRAPER = "metrics-token"  # request.auth for a caller that showed METRICS_TOKEN


class MetricsTokenAuthentication(BaseAuthentication):
    """`Authorization: Bearer <METRICS_TOKEN>` (what Prometheus sends with `authorization.credentials`)."""

    def authenticate(self, request):
        parts = get_authorization_header(request).split()
        if len(parts) != 2 or parts[0].lower() != b"bearer":
            return None
        expected = settings.METRICS_TOKEN.encode()
        if not expected or not hmac.compare_digest(parts[1], expected):
            raise AuthenticationFailed("Invalid scrape token.")
        return AnonymousUser(), SCRAPER

    def authenticate_header(self, request):
        return 'Bearer realm="metrics"'


class CanScrape(BasePermission):
    message = "Reading metrics needs a viewer's login, an API token or the scrape token."

    def has_permission(self, request, view):
        return request.auth == SCRAPER or is_viewer(request.user)


class ScrapeAccess:
    """Mixin for the two read-only Prometheus endpoints: the API's own token and session checks
    (whatever they become), then the scrape token."""

    authentication_classes = [*api_settings.DEFAULT_AUTHENTICATION_CLASSES, MetricsTokenAuthentication]
    permission_classes = [CanScrape]
