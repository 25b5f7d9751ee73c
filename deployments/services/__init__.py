"""Writes that span models, the queue, the channel layer or a host, one module per subject."""
from deployments.services.nodes import *  # noqa: F401,F403
from deployments.services.models import *  # noqa: F401,F403
from deployments.services.deploys import *  # noqa: F401,F403
from deployments.services.engines import *  # noqa: F401,F403
from deployments.services.guards import *  # noqa: F401,F403
from deployments.services.loadtime import *  # noqa: F401,F403
