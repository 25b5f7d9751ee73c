"""Host errors all carry `permanent` from one base, and keep it across processes (Celery, the runner's workers)."""
import pickle

import pytest

from benchmarks.runner.spec import PromptError, RunnerError
from deployments.host.processes import EngineError
from deployments.host.errors import HostError
from deployments.host.hub import HubError
from deployments.host.pagecache import PageCacheError
from deployments.host.store import StoreError
from deployments.host.systemd import SystemdError
from deployments.host.vllm import VllmError


@pytest.mark.parametrize("cls, usually", [(EngineError, False), (VllmError, False), (RunnerError, False),
                                          (SystemdError, True), (StoreError, True), (PageCacheError, True),
                                          (PromptError, True)])
def test_each_host_error_says_whether_retrying_can_help_and_a_raise_may_say_otherwise(cls, usually):
    assert issubclass(cls, HostError)
    assert cls("it broke").permanent is usually
    assert cls("it broke", permanent=not usually).permanent is not usually


@pytest.mark.parametrize("error", [EngineError("no engine at /x", permanent=True), RunnerError("HTTP 500", permanent=False),
                                   PromptError("line 3: not JSON"), HubError("gated", True, "gated")])
def test_a_host_error_crosses_a_process_boundary_with_its_message_and_permanence(error):
    copy = pickle.loads(pickle.dumps(error))
    assert (type(copy), copy.message, copy.permanent, str(copy)) == (type(error), error.message, error.permanent, str(error))
