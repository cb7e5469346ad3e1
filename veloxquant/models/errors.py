"""Exception type shared by the model helpers."""

from ..errors import VeloxError


class ModelError(VeloxError):
    """A model file is missing, corrupt, or of an architecture we cannot convert."""
