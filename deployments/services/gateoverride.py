"""What the fit gate and the compatibility gate (services/fitgate.py, services/compatgate.py) do with a deploy their
verdict refuses: refuse it, unless an admin overrides the verdict now or overrode the same verdict on this deployment
before; then the override, for the deployment's timeline."""
from dataclasses import dataclass, field

from deployments.models import Deployment
from plumbing.errors import ServiceError


@dataclass
class GateOverride:
    """An admin's decision to deploy against a gate's verdict, for the deployment's timeline."""

    message: str
    data: dict = field(default_factory=dict)


def gate_override(refusal: ServiceError, *, check: str, step: str, verdict: str, says: str, data: dict,
                  override: bool, admin: bool, deployment: Deployment | None, override_field: str) -> GateOverride:
    """Raise `refusal` unless the verdict is overridden; an override by anyone but an admin is refused too. `check`
    names the gate ("the fit check"), `step` its timeline step, `says` what the override's message quotes of it."""
    earlier = deployment and deployment.events.filter(step=step, data__verdict=verdict).exists()
    if not override and not earlier:
        raise refusal
    if override and not admin:
        raise ServiceError(f"Only an admin can deploy against {check}.", field=override_field, code="forbidden")
    how = "kept from an earlier admin override" if not override else f"an admin overrode {check}"
    return GateOverride(f"Deployed although {check} says{says} ({how}).", data)
