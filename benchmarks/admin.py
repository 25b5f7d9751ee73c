from django.contrib import admin

from benchmarks.models import BenchmarkPoint, BenchmarkRun


class BenchmarkPointInline(admin.TabularInline):
    model = BenchmarkPoint
    extra = 0


@admin.register(BenchmarkRun)
class BenchmarkRunAdmin(admin.ModelAdmin):
    list_display = ["__str__", "deployment", "base_url", "status", "created"]
    list_filter = ["status"]
    inlines = [BenchmarkPointInline]
