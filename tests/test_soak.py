"""A soak that CI can afford: random cancels, deadlines and worker kills, then
exact outputs and nothing held anywhere."""

from conftest import tiny_model
from disagg import soak


def test_soak_with_cancels_deadlines_and_killed_workers(tmp_path):
    report = soak.run(["--model", tiny_model("llama"), "--requests", "150", "--concurrency", "16", "--kills", "2", "--max-new-tokens", "30", "--max-seconds", "240", "--log-dir", str(tmp_path)])
    assert report.outcomes["OK"] > 60, report.outcomes
    assert report.outcomes["CANCELLED (by client)"] > 10, report.outcomes
    assert len(report.kills) == 2, report.kills
    assert report.wrong == []
    assert report.held_at_end and all(v == [0, 0, 0, 0, 0] for v in report.held_at_end.values()), report.held_at_end
    # Requests that were refused or lost are named by status code; none is INTERNAL.
    assert "INTERNAL" not in report.outcomes and "UNKNOWN" not in report.outcomes, report.outcomes
