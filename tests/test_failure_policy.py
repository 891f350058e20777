"""The restart policy alone: which failures are restarted, and when the run gives up."""

import pickle

from elixir_ray.cluster.failure import (Decision, FailureKind, RestartPolicy, StepError, WorkerGroupFailure,
                                        error_line)


def _failure(kind=FailureKind.RAISED, error="RuntimeError: boom", step=3, phase="training"):
    failure = WorkerGroupFailure(phase, f"a worker failed: {error}", kind, error=error if kind is FailureKind.RAISED
                                 else "")
    failure.step = step
    return failure


def test_failures_are_restarted_until_the_budget_is_spent():
    policy = RestartPolicy(max_restarts=2)
    died = [_failure(FailureKind.DIED), _failure(FailureKind.DIED)]
    assert policy.decide(_failure(FailureKind.DIED), []) is Decision.RESTART
    assert policy.decide(_failure(FailureKind.DIED), died[:1]) is Decision.RESTART
    assert policy.decide(_failure(FailureKind.DIED), died) is Decision.FAIL
    assert RestartPolicy(max_restarts=0).decide(_failure(), []) is Decision.FAIL


def test_the_same_error_at_the_same_step_after_a_restart_is_not_restarted_again():
    policy = RestartPolicy(max_restarts=5)
    assert policy.decide(_failure(), [_failure()]) is Decision.FAIL_REPEATED


def test_anything_that_differs_is_restarted():
    """A lost worker, a silent one, another error, another step or phase, or progress in between: restart."""
    policy = RestartPolicy(max_restarts=5)
    earlier = [_failure()]
    for failure in (_failure(FailureKind.DIED), _failure(FailureKind.SILENT), _failure(FailureKind.OTHER),
                    _failure(error="RuntimeError: other"), _failure(error="ValueError: boom"), _failure(step=4),
                    _failure(phase="taking a snapshot")):
        assert policy.decide(failure, earlier) is Decision.RESTART, failure
    assert policy.decide(_failure(FailureKind.DIED), [_failure(FailureKind.DIED)]) is Decision.RESTART
    # only the last failure counts: the same error twice with another in between is two separate events
    assert policy.decide(_failure(), [_failure(), _failure(FailureKind.DIED)]) is Decision.RESTART
    # a failure without the error it raised (the driver could not tell) is never called a repeat
    assert policy.decide(_failure(error=""), [_failure(error="")]) is Decision.RESTART


def test_a_step_error_keeps_its_error_apart_from_the_rank_and_survives_pickling():
    try:
        raise ValueError("bad shape\nsecond line")
    except ValueError as exc:
        error = StepError(1, 7, str(exc), error_line(exc), "Traceback ...")
    back = pickle.loads(pickle.dumps(error))
    assert (back.rank, back.step, back.error) == (1, 7, "ValueError: bad shape")
    assert str(back).startswith("rank 1 failed at step 7: bad shape\nsecond line")
    assert error_line(RuntimeError()) == "RuntimeError: "
