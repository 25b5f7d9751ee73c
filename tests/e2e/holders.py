"""What a node agent records as foreign on a host without GPUs, where the whole host is one engine's claim
(CPU_HOST_EXCLUSIVE on), computed by the agent's own code but seeing only one test's engine: the e2e agents
run with the claim off, since other sessions on this shared machine run engines of their own.

The agent writes the record only when its own reading changes, so what is stored here stays until the
agent itself sees something new (with the claim off it sees nothing)."""
from unittest import mock

from django.test import override_settings

from deployments.models import Node
from deployments.node import guards
from tests import truestate


def record_whole_host_holders(node, folder) -> list:
    """Record the node's foreign processes as its agent would with the whole-host claim on, seeing only the
    engine processes started for the model in `folder` (API server, EngineCore, workers); (the processes it
    saw, the stored record). vLLM's titled children are among them: what the redeploy's 409 named."""
    seen = truestate.engines_under(folder)
    with override_settings(CPU_HOST_EXCLUSIVE=True), \
         mock.patch("deployments.host.ownership.engine_processes", return_value=[p.pid for p in seen]), \
         mock.patch("deployments.host.gpu.sample", side_effect=guards.gpu.NvmlUnavailable("no NVML here")):
        guards.node_foreign_record(node.pk, None)  # None: never equal to a reading, always stored
    return seen, Node.objects.get(pk=node.pk).foreign_processes
