"""The bench command itself, run briefly so it never breaks (no timing asserts)."""

from __future__ import annotations

import json

from disagg.cli.main import main


def test_open_loop_sweep_with_json_and_plots(llama_cluster, tmp_path):
    out = tmp_path / "bench.json"
    code = main(["bench", "--address", llama_cluster.router_address, "--sweep", "20,40", "--requests", "8", "--warmup", "2",
                 "--prompt-len", "8:24", "--output-len", "6", "--json", str(out), "--plot", str(tmp_path / "bench"), "--no-progress"])
    assert code == 0
    runs = json.loads(out.read_text())
    assert [r["rate"] for r in runs] == [20.0, 40.0]
    for run in runs:
        assert run["ok"] == run["requests"] == 8 and run["errors"] == {}
        assert run["output_tokens_per_second"] > 0 and 0 < run["ttft"]["p50"] <= run["ttft"]["p99"]
        assert set(run["goodput"]) == {"ttft_target", "itl_target", "share"}
    assert (tmp_path / "bench-cdf.png").stat().st_size > 0 and (tmp_path / "bench-vs-rate.png").stat().st_size > 0


def test_closed_loop_on_a_sharegpt_style_dataset(llama_cluster, tmp_path, capsys):
    data = tmp_path / "prompts.jsonl"
    rows = [{"conversations": [{"from": "human", "value": "The baker opens his shop"}, {"from": "gpt", "value": "before the sun is up."}]},
            {"prompt": "The cat slept", "output_len": 5}] * 3
    data.write_text("\n".join(json.dumps(r) for r in rows))
    out = tmp_path / "closed.json"
    assert main(["bench", "--address", llama_cluster.router_address, "--dataset", str(data), "--concurrency", "3", "--requests", "4",
                 "--warmup", "2", "--output-len", "32", "--json", str(out), "--no-progress"]) == 0
    run = json.loads(out.read_text())[0]
    assert run["mode"] == "closed" and run["concurrency"] == 3 and run["ok"] == 4
    assert "goodput:" in capsys.readouterr().out
