from django.urls import path

from benchmarks import studyviews, views, workloadviews

urlpatterns = [
    path("", views.run_list, name="run-list"),
    path("compare/", views.compare, name="run-compare"),
    path("export.<str:fmt>", views.export, name="run-export"),
    path("<id:pk>/", views.run_detail, name="run-detail"),
    path("<id:pk>/cancel/", views.run_cancel, name="run-cancel"),
    path("<id:pk>/export.<str:fmt>", views.export, name="run-export-one"),
    path("workloads/", workloadviews.workload_list, name="workload-list"),
    path("workloads/<id:pk>/delete/", workloadviews.workload_delete, name="workload-delete"),
    path("studies/", studyviews.study_list, name="study-list"),
    path("studies/<id:pk>/", studyviews.study_detail, name="study-detail"),
    path("studies/<id:pk>/apply/", studyviews.study_apply, name="study-apply"),
    path("studies/<id:pk>/export.csv", studyviews.study_export, name="study-export"),
    path("studies/<id:pk>/<str:action>/", studyviews.study_control, name="study-control"),
]
