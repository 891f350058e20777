"""Errors that users see. Each names what to change, so it is raised before any work starts."""


class ConfigError(ValueError):
    """A config value is missing, unknown or out of range."""


class ClusterError(RuntimeError):
    """The Ray cluster cannot host the requested workers, or a worker failed."""


def nothing_left_to_train(uri: str, step: int, steps: int) -> str:
    """The refusal of a --resume whose checkpoint is already at train.steps (the driver's early check
    and the restore itself say the same)."""
    return (f"--resume {uri!r}: the checkpoint is at step {step}, and train.steps={steps}: nothing is left to "
            f"train. Raise train.steps (e.g. --set train.steps={step + steps}) or resume from an earlier checkpoint")
