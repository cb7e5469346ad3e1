"""Exception type shared by the model helpers."""


class ModelError(Exception):
    """A model file is missing, corrupt, or of an architecture we cannot convert."""
