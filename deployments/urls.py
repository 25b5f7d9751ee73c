from django.urls import path

from deployments import views

urlpatterns = [
    path("", views.dashboard, name="dashboard"),
    path("nodes/", views.node_list, name="node-list"),
    path("nodes/<int:pk>/", views.node_detail, name="node-detail"),
    path("nodes/<int:pk>/history.json", views.node_history, name="node-history"),
    path("models/", views.model_list, name="model-list"),
    path("models/add/", views.model_add, name="model-add"),
    path("models/add-local/", views.model_add_local, name="model-add-local"),
    path("models/<int:pk>/", views.model_detail, name="model-detail"),
    path("models/<int:pk>/download/", views.model_download, name="model-download"),
    path("copies/<int:pk>/<slug:action>/", views.copy_action, name="copy-action"),
    path("settings/", views.panel_settings, name="settings"),
    path("deployments/", views.deployment_list, name="deployment-list"),
    path("deployments/<int:pk>/", views.deployment_detail, name="deployment-detail"),
    path("account/", views.account, name="account"),
    path("account/token/", views.account_token, name="account-token"),
]
