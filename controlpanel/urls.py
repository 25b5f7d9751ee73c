from django.contrib import admin
from django.contrib.auth import views as auth_views
from django.http import JsonResponse
from django.urls import include, path, register_converter
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView

from controlpanel.metricsview import MetricsView
from plumbing import params

# `<id:pk>` in the apps' page routes (registered before their urls modules are included).
register_converter(params.IdConverter, "id")
handler400 = params.bad_request


def healthz(request):
    return JsonResponse({"ok": True})


urlpatterns = [
    path("accounts/login/", auth_views.LoginView.as_view(), name="login"),
    path("accounts/logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("admin/", admin.site.urls),
    path("healthz", healthz, name="healthz"),
    path("metrics", MetricsView.as_view(), name="metrics"),
    path("api/schema/", SpectacularAPIView.as_view(), name="api-schema"),
    path("api/docs/", SpectacularSwaggerView.as_view(url_name="api-schema"), name="api-docs"),
    path("api/", include("deployments.api.urls")),
    path("api/", include("benchmarks.api.urls")),
    path("api/", include("deployments.gateway.api")),
    path("api/", include("deployments.notify.api_urls")),
    path("notifications/", include("deployments.notify.urls")),
    path("", include("deployments.urls")),
    path("", include("deployments.gateway.urls")),
    path("benchmarks/", include("benchmarks.urls")),
]
