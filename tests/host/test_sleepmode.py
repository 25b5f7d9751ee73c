"""Sleep mode through deployments.host.vllm against the fake engine (tests/faults/fakevllm/vllm), which serves
vLLM 0.32's routes and answers and holds its "weights" in host RAM in its EngineCore child."""
import json
import os
import signal
import subprocess
import sys
import threading
import urllib.request

import psutil
import pytest

from deployments.host import vllm
from tests.conftest import free_port, wait_until
from tests.truestate import FAKE_VLLM

WEIGHTS_MB = 64


@pytest.fixture
def start_engine(tmp_path):
    """Start the fake engine with the given flags (and VLLM_SERVER_DEV_MODE=1 unless dev_mode=False)."""
    procs = []
    model = tmp_path / "model"
    model.mkdir()
    (model / "fake_engine.json").write_text(json.dumps({"load_s": 0.1, "weights_mb": WEIGHTS_MB,
                                                        "sleep_s": 0.05, "wake_s": 0.05}))

    def start(*flags, dev_mode=True):
        port = free_port()
        env = dict(os.environ, VLLM_SERVER_DEV_MODE="1" if dev_mode else "0")
        log = open(tmp_path / f"engine-{len(procs)}.log", "wb")
        proc = subprocess.Popen([sys.executable, str(FAKE_VLLM), "serve", str(model), "--host", "127.0.0.1",
                                 "--port", str(port), *flags], env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        procs.append(proc)
        url = f"http://127.0.0.1:{port}"
        wait_until(lambda: vllm.health(url), message="the fake engine answers /health")
        proc.log_path = log.name
        return url, proc

    yield start
    for proc in procs:
        proc.send_signal(signal.SIGTERM)  # the fake's API server stops its core and unlinks its /dev/shm file
        proc.wait(10)


def weights_rss(proc) -> int:
    """Resident bytes of the engine's EngineCore child, where the fake keeps its weights."""
    (core,) = psutil.Process(proc.pid).children()
    return core.memory_info().rss


def test_level_1_sleep_keeps_the_weights_and_a_wake_serves_chat_again(start_engine):
    url, proc = start_engine("--enable-sleep-mode")
    held = weights_rss(proc)
    assert not vllm.is_sleeping(url)
    vllm.sleep(url, 1)
    assert vllm.is_sleeping(url)
    assert weights_rss(proc) >= held - (4 << 20)  # no GPU to move them from: they stay in host RAM
    assert vllm.wake_up(url) is True
    assert not vllm.is_sleeping(url)
    assert vllm.smoke_test(url, str(proc.args[3])).reply == "Paris."
    log = open(proc.log_path).read()
    assert "seconds to fall asleep." in log and "seconds to wake up tags" in log


def test_level_2_frees_the_weights_and_the_tags_wake_them_in_parts(start_engine):
    url, proc = start_engine("--enable-sleep-mode")
    held = weights_rss(proc)
    vllm.sleep(url, 2)
    assert held - weights_rss(proc) >= (WEIGHTS_MB - 4) << 20
    assert 'sleep_state="discard_all"} 1.0' in urllib.request.urlopen(vllm.metrics_url(url)).read().decode()
    assert vllm.wake_up(url, tags=("weights",)) is False  # the KV cache still sleeps
    assert vllm.is_sleeping(url)
    assert weights_rss(proc) >= held - (4 << 20)
    assert vllm.wake_up(url, tags=("kv_cache",)) is True
    assert not vllm.is_sleeping(url)


def test_a_chat_sent_while_the_engine_sleeps_is_answered_after_the_wake(start_engine):
    url, proc = start_engine("--enable-sleep-mode")
    vllm.sleep(url, 1)
    replies = []
    asking = threading.Thread(target=lambda: replies.append(vllm.smoke_test(url, str(proc.args[3])).reply))
    asking.start()
    asking.join(0.5)
    assert asking.is_alive() and not replies  # queued, as vLLM queues it: not refused
    vllm.wake_up(url)
    asking.join(10)
    assert replies == ["Paris."]


def test_without_dev_mode_the_client_says_the_engine_has_no_sleep_endpoints(start_engine):
    url, _ = start_engine("--enable-sleep-mode", dev_mode=False)
    for call in (lambda: vllm.sleep(url, 1), lambda: vllm.wake_up(url), lambda: vllm.is_sleeping(url)):
        with pytest.raises(vllm.VllmError) as err:
            call()
        assert err.value.permanent and err.value.message == vllm.NO_SLEEP_ROUTES


def test_without_enable_sleep_mode_vllm_takes_the_sleep_and_frees_nothing(start_engine):
    url, proc = start_engine()
    held = weights_rss(proc)
    vllm.sleep(url, 2)
    assert vllm.is_sleeping(url)
    assert weights_rss(proc) >= held - (4 << 20)
    assert vllm.wake_up(url) is True


def test_a_level_vllm_does_not_take_is_a_permanent_error(start_engine):
    url, _ = start_engine("--enable-sleep-mode")
    with pytest.raises(vllm.VllmError) as err:
        vllm.sleep(url, 3)
    assert err.value.permanent and "validation error" in err.value.message
    assert not vllm.is_sleeping(url)
