"""DRF permissions: any role may read, only operators may change."""
from rest_framework.permissions import SAFE_METHODS, BasePermission

from plumbing.roles import is_operator, is_viewer


class IsViewerOrOperator(BasePermission):
    message = "Changing things needs the operator role."

    def has_permission(self, request, view):
        if request.method in SAFE_METHODS:
            return is_viewer(request.user)
        return is_operator(request.user)
