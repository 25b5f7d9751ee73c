"""Node pages say once, in words, why a node has no GPU (the fleet card said "no NVIDIA GPU on
this node" twice, the second time inside NVML's raw error), and name the disk chart for what it measures."""
import re

import pytest
from django.urls import reverse

from deployments.templatetags.nodes import no_gpu_reason
from tests.factories import NodeFactory

pytestmark = pytest.mark.django_db
RAW = "no NVIDIA GPU on this node: NVML Shared Library Not Found"  # what the agent stores on a host without a driver


def test_the_reason_drops_the_repeated_words_and_explains_nvmls():
    assert no_gpu_reason(RAW) == "the NVIDIA driver is not installed (no NVML library found)"
    assert no_gpu_reason("no NVIDIA GPU on this node: Driver Not Loaded") == "the NVIDIA driver is installed but not loaded"
    assert no_gpu_reason("no NVIDIA GPU on this node: NVML Error with code 99") == "NVML Error with code 99"


@pytest.mark.parametrize("page", ["dashboard", "node-detail"])
def test_every_page_says_no_gpu_once(operator_client, page):
    node = NodeFactory(name="cpu-01", nvml_error=RAW)
    html = operator_client.get(reverse(page, args=[node.pk] if page == "node-detail" else [])).content.decode()
    html = re.sub(r"<[^>]+>", "", html)  # the words as read
    assert html.lower().count("no nvidia gpu on this node") == 1, page
    assert "No NVIDIA GPU on this node. The NVIDIA driver is not installed (no NVML library found)." in html
    assert "NVML Shared Library Not Found" not in html


def test_the_disk_chart_is_named_for_the_filesystem_it_measures(operator_client):
    node = NodeFactory()
    html = operator_client.get(reverse("node-detail", args=[node.pk])).content.decode()
    assert "Disk used (GiB), the model store's filesystem" in html and "Model store used" not in html
