"""What a deploy checks of sleep mode (services/deploys.py): where vLLM has it, and which deployments on the chosen
GPUs a sleep-mode deployment shares them with rather than replaces. Sleep, wake and swap are sleeps.py."""
from deployments import claims
from deployments.models import Deployment, Node
from plumbing.errors import ServiceError


def check_sleep_mode(node: Node, nnodes: int, sleep_mode: bool, start_asleep: bool) -> None:
    """Sleep mode where vLLM has it: CUDA GPUs (the CPU build refuses it), one node."""
    if start_asleep and not sleep_mode:
        raise ServiceError("Starting asleep needs sleep mode.", field="start_asleep")
    if not sleep_mode:
        return
    if "cpu" in (node.engine_version or "").lower():
        raise ServiceError(f"{node}'s engine ({node.engine_version}) is vLLM's CPU build, which has no sleep mode.",
                           field="sleep_mode", code="no_sleep_mode")
    if nnodes > 1:
        raise ServiceError("Sleep mode is for deployments on one node.", field="sleep_mode", code="no_sleep_mode")


def sharers(node: Node, gpu_indices: list[int], sleep_mode: bool, exclude: Deployment | None = None) -> set[int]:
    """Deployments on these GPUs that a sleep-mode deployment shares them with (sleep mode too, loaded): the
    plan puts them to sleep instead of stopping them."""
    if not sleep_mode:
        return set()
    return set(claims.sleep_sharers(node, gpu_indices, exclude=exclude).values_list("pk", flat=True))
