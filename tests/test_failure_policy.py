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


def test_a_collectives_error_is_never_the_runs_own():
    """A survivor's collective fails the same way on every try when a peer hangs (a gloo timeout's
    line has no address in it): restarted, never called a repeat."""
    import torch.distributed as dist

    for exc in (RuntimeError("[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting "
                             "3000ms for recv operation to complete"),
                RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer "
                             "[127.0.0.1]:41234"),
                dist.DistBackendError("NCCL communicator was aborted on rank 1"),
                dist.DistError("anything a collective raises")):
        assert error_line(exc) == "", exc
        error = StepError(0, 2, str(exc), error_line(exc), "")
        failures = [_failure(error=error.error, step=2), _failure(error=error.error, step=2)]
        assert RestartPolicy(max_restarts=3).decide(failures[1], failures[:1]) is Decision.RESTART
    assert error_line(FloatingPointError("the loss is not finite")) == "FloatingPointError: the loss is not finite"


def test_a_step_predicted_to_outlast_the_hang_timeout_is_refused_and_one_near_it_warned():
    """A step slower than fault.detect_timeout_s is taken for a hung worker on every try (a new
    user's seq_len 100000 on the CPU, predicted at 28 minutes a step, restarted three times): the
    driver refuses it before training, naming the setting and a value that fits three steps."""
    from elixir_ray.cluster.failure import step_against_timeout

    error, warning = step_against_timeout(1701.5, 60)
    assert warning is None and error.startswith("the plan predicts 1,701.5 s a step, and fault.detect_timeout_s is 60 s")
    assert "Set fault.detect_timeout_s to at least 5105 (three steps)" in error and "train.grad_accum" in error
    assert step_against_timeout(60, 60)[0] is not None  # a step as long as the timeout fails as surely
    error, warning = step_against_timeout(25, 60)
    assert error is None and "consider fault.detect_timeout_s=75" in warning
    # rounded up: never a value the run already has
    assert "consider fault.detect_timeout_s=61" in step_against_timeout(20.1, 60)[1]
    where = " for 2 worker(s) after a restart (before it, 4)"
    assert step_against_timeout(70, 60, where)[0].startswith("the plan" + where + " predicts 70.0 s a step")
    assert step_against_timeout(19.9, 60) == (None, None)
    assert step_against_timeout(0.0, 60) == (None, None)  # no prediction (a plan read from an older file)
