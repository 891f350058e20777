"""The error a plan search raises and the engine passes on from rank 0."""


class PlanError(ValueError):
    """No placement fits the device-memory budget; the message names the minimum and what dominates it."""
