from django.urls import path

from deployments.notify import views

urlpatterns = [
    path("", views.page, name="notify-page"),
    path("<slug:what>/", views.action, name="notify-action"),
]
