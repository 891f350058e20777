"""The progress output when it is not a terminal (a log file, `ray job logs`)."""

import io

from elixir_ray.progress import ProgressBar


def test_a_log_shows_the_first_step_seen_every_nth_and_the_last_with_notes_between():
    """A resumed run starts past step 1: its first line came only at the next multiple of log_every."""
    out = io.StringIO()
    bar = ProgressBar(total=30, every=10, stream=out)
    for step in range(13, 31):
        bar.update(step, 2.0, 1000.0)
        if step == 15:
            bar.note("step 15: eval loss 2.5000")
    lines = out.getvalue().splitlines()
    assert [line.split("  ")[0].split()[-1] for line in lines if line.startswith("[")] == ["13/30", "20/30", "30/30"]
    assert "step 15: eval loss 2.5000" in lines
