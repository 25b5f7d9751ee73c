"""What a deploy checks of sleep mode (services/deploys.py): where vLLM has it, and which deployments on the chosen
GPUs a sleep-mode deployment shares them with rather than replaces. Sleep, wake and swap are sleeps.py."""
from deployments import claims
from deployments.models import Deployment, Node
from deployments.services import doctor
from plumbing.errors import ServiceError


def check_sleep_mode(node: Node, nnodes: int, sleep_mode: bool, start_asleep: bool, admin: bool = False,
                     was_on: bool = False) -> None:
    """Sleep mode where vLLM has it: CUDA GPUs (the CPU build refuses it), one node.

    Sleep mode needs VLLM_SERVER_DEV_MODE=1, and vLLM checks its key only under /v1 and a few other prefixes:
    its development routes (/collective_rpc, /sleep, /wake_up, /reset_prefix_cache) answer whoever reaches the
    port without a key. Where the node's doctor proved engine ports answer only its agent (the loopback door,
    host/door.py) an operator may turn it on; elsewhere it is the admin's call, as the variable itself is
    (privileged.py), and an operator may redeploy one an admin set up."""
    if start_asleep and not sleep_mode:
        raise ServiceError("Starting asleep needs sleep mode.", field="start_asleep")
    if not sleep_mode:
        return
    if not admin and not was_on and not doctor.door_shut(node):
        raise ServiceError(f"Needs the admin role on {node}: its engine ports answer every local user (see the node's "
                           "engine_door check), and sleep mode starts the engine with VLLM_SERVER_DEV_MODE=1, whose "
                           "development routes (/collective_rpc, /sleep, /wake_up) need no key.",
                           field="sleep_mode", code="forbidden")
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
