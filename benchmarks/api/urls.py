from rest_framework.routers import SimpleRouter

from benchmarks.api import studies, views

router = SimpleRouter()
router.register("runs", views.BenchmarkRunViewSet, basename="api-run")
router.register("studies", studies.StudyViewSet, basename="api-study")
urlpatterns = router.urls
