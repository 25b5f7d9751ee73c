from django.urls import path

from deployments import deploy_views, views

urlpatterns = [
    path("", views.dashboard, name="dashboard"),
    path("nodes/", views.node_list, name="node-list"),
    path("nodes/<id:pk>/", views.node_detail, name="node-detail"),
    path("nodes/<id:pk>/history.json", views.node_history, name="node-history"),
    path("models/", views.model_list, name="model-list"),
    path("models/add/", views.model_add, name="model-add"),
    path("models/add-local/", views.model_add_local, name="model-add-local"),
    path("models/<id:pk>/", views.model_detail, name="model-detail"),
    path("models/<id:pk>/download/", views.model_download, name="model-download"),
    path("copies/<id:pk>/<slug:action>/", views.copy_action, name="copy-action"),
    path("settings/", views.panel_settings, name="settings"),
    path("deployments/", views.deployment_list, name="deployment-list"),
    path("models/<id:pk>/deploy/", deploy_views.deploy, name="model-deploy"),
    path("deployments/<id:pk>/", deploy_views.deployment_detail, name="deployment-detail"),
    path("deployments/<id:pk>/edit/", deploy_views.deployment_edit, name="deployment-edit"),
    path("deployments/<id:pk>/unit/", deploy_views.deployment_unit, name="deployment-unit"),
    path("deployments/<id:pk>/<slug:action>/", deploy_views.deployment_action, name="deployment-action"),
    path("account/", views.account, name="account"),
    path("account/token/", views.account_token, name="account-token"),
]
