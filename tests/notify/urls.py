"""controlpanel.urls with the notify app's pages and API, unless it has them already."""
from django.urls import include, path

from controlpanel.urls import urlpatterns as panel_urls

urlpatterns = list(panel_urls)
if not any(getattr(p, "urlconf_name", None) == "deployments.notify.urls" for p in panel_urls):
    urlpatterns[:0] = [path("notifications/", include("deployments.notify.urls")),
                       path("api/", include("deployments.notify.api_urls"))]
