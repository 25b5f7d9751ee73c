from rest_framework.routers import SimpleRouter

from benchmarks.api import views

router = SimpleRouter()
router.register("runs", views.BenchmarkRunViewSet, basename="api-run")
urlpatterns = router.urls
