"""deployments.host.pagecache against real files and the real page cache of this host."""
import os

import pytest

from deployments.host import pagecache


@pytest.fixture
def shards(tmp_path):
    """Three 4 MiB 'shards' plus a config, written and synced so the kernel may drop them."""
    folder = tmp_path / "model"
    folder.mkdir()
    for i, size in enumerate((4 << 20, 3 << 20, 2 << 20)):
        path = folder / f"model-{i:05d}-of-00003.safetensors"
        path.write_bytes(os.urandom(size))
    (folder / "config.json").write_text("{}")
    os.sync()
    return folder


def _dropped(paths):
    for p in paths:
        pagecache.drop(p)
    if any(pagecache.resident_bytes(p) for p in paths):
        pytest.skip("this filesystem keeps the files cached (tmpfs/overlay): residency cannot be shown cold")


def test_weight_files_are_the_shards_largest_first(shards):
    files = pagecache.weight_files(shards)
    assert [p.name for p in files] == [f"model-0000{i}-of-00003.safetensors" for i in range(3)]


def test_prewarm_brings_every_shard_into_the_page_cache(shards):
    files = pagecache.weight_files(shards)
    _dropped(files)
    assert pagecache.residency(files).percent == 0
    seen = []
    rate = pagecache.prewarm(files, workers=3, on_bytes=seen.append)
    after = pagecache.residency(files)
    assert after.resident == after.total == rate.bytes == sum(seen)
    assert after.percent == 100


def test_measuring_the_read_rate_leaves_no_file_cached_that_was_not_and_keeps_an_engines_files(shards):
    files = pagecache.weight_files(shards)
    _dropped(files)
    engine_file = files[0]
    pagecache.prewarm([engine_file])
    rate = pagecache.measure_read_rate(files, max_bytes=4 << 20, keep=frozenset({engine_file}))
    assert rate.bytes == 4 << 20 and rate.cold and rate.bps > 0
    assert pagecache.resident_bytes(engine_file) == engine_file.stat().st_size  # not evicted
    assert pagecache.resident_bytes(files[1]) == 0  # dropped again after the measurement
    with pytest.raises(pagecache.PageCacheError):
        pagecache.measure_read_rate([engine_file], keep=frozenset({engine_file}))


def test_a_process_that_reads_a_cold_file_shows_its_size_in_read_bytes(shards):
    files = pagecache.weight_files(shards)
    _dropped(files)
    before = pagecache.process_read_bytes(os.getpid())
    pagecache.prewarm(files[:1], workers=1)
    assert pagecache.process_read_bytes(os.getpid()) - before >= files[0].stat().st_size
    assert pagecache.process_read_bytes(2 ** 22 + 12345) == 0  # no such process
