"""Disk space and host load as the node reports them."""

import os
import shutil

from deployments.host import disk


def test_disk_usage_of_a_missing_folder_measures_its_nearest_parent_and_creates_nothing(tmp_path):
    missing = tmp_path / "models" / "org" / "repo"

    usage = disk.disk_usage(missing)

    assert usage.path == str(tmp_path)
    assert not (tmp_path / "models").exists()
    assert usage.total == shutil.disk_usage(tmp_path).total


def test_disk_usage_of_an_existing_folder_adds_up(tmp_path):
    usage = disk.disk_usage(str(tmp_path))

    assert usage.path == str(tmp_path)
    assert 0 < usage.free <= usage.total and 0 <= usage.used <= usage.total


def test_host_stats_report_memory_load_and_cpus():
    stats = disk.host_stats()

    assert 0 < stats.ram_available <= stats.ram_total
    assert min(stats.load1, stats.load5, stats.load15) >= 0
    assert stats.cpu_count == os.cpu_count()
