"""A soak that CI can afford: random cancels, deadlines and worker kills, then
exact outputs and nothing held anywhere."""

from conftest import tiny_model

from disagg.tools import soak


def test_soak_with_cancels_deadlines_and_killed_workers(tmp_path):
    plan = ["--requests", "150", "--concurrency", "16", "--kills", "2", "--max-new-tokens", "30", "--max-seconds", "240"]
    report = soak.run(["--model", tiny_model("llama"), *plan, "--log-dir", str(tmp_path)])
    # Every planned cancel happens (each leaves a stream hundreds of tokens before its end); a
    # deadline is met or not as the host's speed makes it; a plain request ends OK unless a kill lost it.
    outcomes, planned = report.outcomes, report.planned
    lost_to_kills = sum(count for outcome, count in outcomes.items() if outcome not in ("OK", "CANCELLED (by client)", "DEADLINE_EXCEEDED"))
    assert sum(outcomes.values()) == sum(planned.values()) == 150 and planned["cancel"] > 20 and planned["plain"] > 80, (outcomes, planned)
    assert outcomes["CANCELLED (by client)"] == planned["cancel"] and outcomes["DEADLINE_EXCEEDED"] <= planned["deadline"], (outcomes, planned)
    assert outcomes["OK"] > 60 and outcomes["OK"] >= planned["plain"] - lost_to_kills, (outcomes, planned)
    assert len(report.kills) == 2, report.kills
    assert report.wrong == []
    assert report.held_at_end and all(v == [0, 0, 0, 0, 0] for v in report.held_at_end.values()), report.held_at_end
    # Requests that were refused or lost are named by status code; none is INTERNAL.
    assert "INTERNAL" not in report.outcomes and "UNKNOWN" not in report.outcomes, report.outcomes
