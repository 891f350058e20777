"""Errors that users see. Each names what to change, so it is raised before any work starts."""


class ConfigError(ValueError):
    """A config value is missing, unknown or out of range."""


class ClusterError(RuntimeError):
    """The Ray cluster cannot host the requested workers, or a worker failed."""
