from rest_framework.routers import SimpleRouter

from benchmarks.api import studies, views, workloads

router = SimpleRouter()
router.register("runs", views.BenchmarkRunViewSet, basename="api-run")
router.register("studies", studies.StudyViewSet, basename="api-study")
router.register("workloads", workloads.WorkloadViewSet, basename="api-workload")
urlpatterns = router.urls
