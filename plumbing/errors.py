"""The one refusal type services raise and views, API views and tasks translate for the user."""


class ServiceError(Exception):
    """A request the panel refuses, with a message for the user (and the field it is about)."""

    def __init__(self, message: str, field: str | None = None, code: str = "invalid"):
        super().__init__(message)
        self.message, self.field, self.code = message, field, code
