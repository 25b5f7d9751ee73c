from django.urls import path
from rest_framework.routers import DefaultRouter

from deployments.api import prometheus, recipes, views

router = DefaultRouter()
router.register("nodes", views.NodeViewSet, basename="api-node")
router.register("models", views.ModelRepoViewSet, basename="api-model")
router.register("copies", views.ModelCopyViewSet, basename="api-copy")
router.register("deployments", views.DeploymentViewSet, basename="api-deployment")
router.register("recipes", recipes.RecipeViewSet, basename="api-recipe")
urlpatterns = router.urls + [
    path("prometheus/targets/", prometheus.EngineTargetsView.as_view(), name="api-prometheus-targets"),
]
