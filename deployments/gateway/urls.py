from django.urls import path

from deployments.gateway import views

urlpatterns = [
    path("account/keys/", views.key_create, name="key-create"),
    path("account/keys/<id:pk>/revoke/", views.key_revoke, name="key-revoke"),
    path("usage/", views.usage, name="usage"),
]
