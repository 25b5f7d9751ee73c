"""CSV exports open in a spreadsheet as data, never as formulas (OWASP's CSV injection rule)."""
import csv
import io

import pytest
from rest_framework.test import APIClient

from benchmarks.models import StudyTrial
from plumbing import csvsafe
from tests.factories import BenchmarkPointFactory, BenchmarkRunFactory, StudyFactory

pytestmark = pytest.mark.django_db
FORMULAS = ["=cmd|' /C calc'!A0", "+1+1", "-2+3", "@SUM(A1)", "\t=1", "\r=1"]


def _cells(text: str) -> list[list[str]]:
    return list(csv.reader(io.StringIO(text)))


def test_text_that_starts_like_a_formula_is_quoted_and_numbers_stay_numbers():
    assert [csvsafe.cell(f) for f in FORMULAS] == ["'" + f for f in FORMULAS]
    assert [csvsafe.cell(v) for v in (-1.5, -3, 0, None, True, "plain", "a=b", "")] == [-1.5, -3, 0, None, True, "plain", "a=b", ""]


def test_the_run_export_quotes_a_formula_name_on_the_page_and_the_api(viewer, viewer_client):
    runs = [BenchmarkRunFactory(name=name) for name in FORMULAS]
    for run in runs:
        BenchmarkPointFactory(run=run, concurrency=1, output_throughput=-0.5)  # a negative number stays a number
    ids = ",".join(str(r.pk) for r in runs)
    api = APIClient()
    api.force_authenticate(viewer)
    for text in (viewer_client.get(f"/benchmarks/export.csv?ids={ids}").content.decode(),
                 api.get(f"/api/runs/export/?ids={ids}&as=csv").content.decode()):
        rows = _cells(text)[1:]
        assert [row[1] for row in rows] == ["'" + f for f in FORMULAS]
        assert {row[8] for row in rows} == {"-0.5"}


def test_the_study_export_quotes_a_variant_name_and_an_error_from_the_engine(viewer_client):
    study = StudyFactory()
    study.variants.filter(is_baseline=False).update(name="=HYPERLINK(\"http://evil\")")
    StudyTrial.objects.filter(study=study).update(status=StudyTrial.Status.FAILED, error="-1+cmd|' /C calc'!A0",
                                                  overhead_s=-2.5)
    rows = _cells(viewer_client.get(f"/benchmarks/studies/{study.pk}/export.csv").content.decode())[1:]
    assert {row[1] for row in rows} == {"baseline", "'=HYPERLINK(\"http://evil\")"}
    assert {row[5] for row in rows} == {"'-1+cmd|' /C calc'!A0"} and {row[7] for row in rows} == {"-2.5"}
