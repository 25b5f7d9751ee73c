from rest_framework import viewsets

from deployments import selectors
from deployments.api import serializers


class NodeViewSet(viewsets.ReadOnlyModelViewSet):
    serializer_class = serializers.NodeSerializer
    queryset = selectors.node_list()


class ModelRepoViewSet(viewsets.ReadOnlyModelViewSet):
    serializer_class = serializers.ModelRepoSerializer
    queryset = selectors.model_list()


class DeploymentViewSet(viewsets.ReadOnlyModelViewSet):
    serializer_class = serializers.DeploymentSerializer
    queryset = selectors.deployment_list()
