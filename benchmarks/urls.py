from django.urls import path

from benchmarks import views

urlpatterns = [
    path("", views.run_list, name="run-list"),
    path("compare/", views.compare, name="run-compare"),
    path("export.<str:fmt>", views.export, name="run-export"),
    path("<id:pk>/", views.run_detail, name="run-detail"),
    path("<id:pk>/cancel/", views.run_cancel, name="run-cancel"),
    path("<id:pk>/export.<str:fmt>", views.export, name="run-export-one"),
]
