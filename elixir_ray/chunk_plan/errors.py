"""The error a plan search raises and the engine passes on from rank 0."""

from __future__ import annotations

from typing import Optional


class PlanError(ValueError):
    """No placement fits the device-memory budget. Its message says so in at most three lines: the
    budget and the smallest plan's need, what dominates that need, and what to change; the same
    parts are attributes, for a caller that acts on them (None where the refusal has no size):

    `min_bytes`: the smallest device budget that would fit (bytes, the margin included), under
    the same host limit; `dominant`: what dominates it ("activations at micro-batch 8 need 20.1
    MiB"); `remedy`: what to change, the message's last line."""

    def __init__(self, message: str, *, min_bytes: Optional[int] = None, dominant: Optional[str] = None,
                 remedy: Optional[str] = None):
        super().__init__(message)
        self.min_bytes, self.dominant, self.remedy = min_bytes, dominant, remedy

    def with_remedy(self, remedy: str) -> "PlanError":
        """The same refusal with another remedy (a config's keys added to the planner's advice): the
        message's last line, where it is the remedy, is replaced."""
        text = str(self)
        if self.remedy and text.endswith(self.remedy):
            text = text[: len(text) - len(self.remedy)] + remedy
        else:
            text = f"{text}\n{remedy}"
        return PlanError(text, min_bytes=self.min_bytes, dominant=self.dominant, remedy=remedy)

    def parts(self) -> dict:
        """The attributes by name, as the constructor takes them (the engine sends them on from rank 0)."""
        return {"min_bytes": self.min_bytes, "dominant": self.dominant, "remedy": self.remedy}

    def __reduce__(self):  # pickled (a Ray task's error) with its attributes, not only its message
        return _rebuild, (str(self), self.parts())


def _rebuild(message: str, parts: dict) -> PlanError:
    return PlanError(message, **parts)
