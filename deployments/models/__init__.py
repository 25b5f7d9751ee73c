"""What sits on a host: nodes, their GPUs, models, model copies and deployments. One module per subject
(hosts, store, engines, learned, versions); everything is imported from here, as Django and the rest of the code expect.
May import plumbing's states and its own modules only."""
from deployments.models.engines import Deployment, DeploymentEvent, DeploymentRank, EngineProcess
from deployments.models.hosts import Gpu, Node, NodeMetric
from deployments.models.learned import FitCalibration, Recipe, SleepProbe
from deployments.models.store import ModelCopy, ModelRepo, Secret
from deployments.models.versions import DeploymentEnergy, DeployVersion

__all__ = ["DeployVersion", "Deployment", "DeploymentEnergy", "DeploymentEvent", "DeploymentRank", "EngineProcess", "FitCalibration", "Gpu", "ModelCopy",
           "ModelRepo", "Node", "NodeMetric", "Recipe", "Secret", "SleepProbe"]
