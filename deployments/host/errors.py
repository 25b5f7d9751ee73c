"""The one error type of host code (deployments/host, benchmarks/runner); each module subclasses it."""
from __future__ import annotations


class HostError(Exception):
    """A host-side failure with a message for the user; `permanent` means retrying cannot help.

    Subclasses set PERMANENT to what their failures usually are; a raise may say otherwise.
    """

    PERMANENT = False

    def __init__(self, message: str, permanent: bool | None = None):
        super().__init__(message)
        self.message = message
        self.permanent = self.PERMANENT if permanent is None else permanent
