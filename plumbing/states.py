"""Guarded status changes, shared by every model that has a status (deployments, runs, copies)."""


class InvalidTransition(Exception):
    """A status change the model does not allow from where it is."""


class Transitions:
    """Mixin: the status field moves only along TRANSITIONS ({from: {to, ...}}), through transition().

    A model names its status groups (ACTIVE, TERMINAL, IN_FLIGHT) next to TRANSITIONS and may
    override entered() to stamp times.
    """

    STATUS_FIELD = "status"
    TRANSITIONS: dict = {}

    def can_transition(self, to) -> bool:
        return to in self.TRANSITIONS.get(getattr(self, self.STATUS_FIELD), ())

    def transition(self, to, **fields) -> None:
        """Move to `to`, setting `fields` with it, or raise InvalidTransition; the caller saves."""
        current = getattr(self, self.STATUS_FIELD)
        if not self.can_transition(to):
            raise InvalidTransition(f"{self}: cannot go from {current} to {to}")
        setattr(self, self.STATUS_FIELD, to)
        for name, value in fields.items():
            setattr(self, name, value)
        self.entered(to)

    def entered(self, status) -> None:
        """Called after each move (stamp times here)."""
