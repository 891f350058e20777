"""Engine errors users see before any state is touched."""


class PlanError(ValueError):
    """No placement fits the device-memory budget; the message names the minimum and what dominates it."""
