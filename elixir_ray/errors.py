"""Errors that users see. Each names what to change, so it is raised before any work starts."""


class ConfigError(ValueError):
    """A config value is missing, unknown or out of range."""


class ClusterError(RuntimeError):
    """The Ray cluster cannot host the requested workers, or a worker failed."""


class NonFiniteLossError(ClusterError):
    """A step's loss (the mean over the ranks, so every rank sees it) was NaN or infinite, with
    `train.stop_on_nonfinite` on: the run ends at that step. Not a worker's failure to restart
    from: the restart would replay the same steps from the same checkpoint."""

    def __init__(self, step: int, loss: float):
        super().__init__(step, loss)  # args: how a pickled exception is rebuilt (it crosses from a worker)
        self.step, self.loss = step, loss

    def __str__(self) -> str:
        return f"step {self.step}: the loss is {self.loss}, not finite: the run stops there (train.stop_on_nonfinite)"


def nothing_left_to_train(uri: str, step: int, steps: int) -> str:
    """The refusal of a --resume whose checkpoint is already at train.steps (the driver's early check
    and the restore itself say the same)."""
    return (f"--resume {uri!r}: the checkpoint is at step {step}, and train.steps={steps}: nothing is left to "
            f"train. Raise train.steps (e.g. --set train.steps={step + steps}) or resume from an earlier checkpoint")
