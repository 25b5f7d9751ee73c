from django.urls import path

from deployments.views import account, deployments, models, nodes

urlpatterns = [
    path("", nodes.dashboard, name="dashboard"),
    path("nodes/", nodes.node_list, name="node-list"),
    path("nodes/<id:pk>/", nodes.node_detail, name="node-detail"),
    path("nodes/<id:pk>/history.json", nodes.node_history, name="node-history"),
    path("models/", models.model_list, name="model-list"),
    path("models/add/", models.model_add, name="model-add"),
    path("models/add-local/", models.model_add_local, name="model-add-local"),
    path("models/<id:pk>/", models.model_detail, name="model-detail"),
    path("models/<id:pk>/download/", models.model_download, name="model-download"),
    path("models/<id:pk>/remove/", models.model_remove, name="model-remove"),
    path("copies/<id:pk>/<slug:action>/", models.copy_action, name="copy-action"),
    path("settings/", account.panel_settings, name="settings"),
    path("deployments/", deployments.deployment_list, name="deployment-list"),
    path("models/<id:pk>/deploy/", deployments.deploy, name="model-deploy"),
    path("deployments/<id:pk>/", deployments.deployment_detail, name="deployment-detail"),
    path("deployments/<id:pk>/edit/", deployments.deployment_edit, name="deployment-edit"),
    path("deployments/<id:pk>/unit/", deployments.deployment_unit, name="deployment-unit"),
    path("deployments/<id:pk>/export.json", deployments.deployment_export, name="deployment-export"),
    path("deployments/<id:pk>/<slug:action>/", deployments.deployment_action, name="deployment-action"),
    path("account/", account.account, name="account"),
    path("account/token/", account.account_token, name="account-token"),
]
