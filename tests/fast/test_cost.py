"""TPU-vs-GPU cost: prices with their date, the paper's 2.12x training-cost ratio, $ per million output tokens."""

import json

import pytest

from gemma_tpu_helpers import __main__ as cli
from gemma_tpu_helpers.course.budget import cost
from gemma_tpu_helpers.course.config import profiles
from support import run_cli


def test_default_prices_come_from_profiles_with_their_date():
    # DESIGN.md: list prices of May 2026, on-demand, us-central1.
    assert profiles.PRICES_DATE == "2026-05"
    assert cost.price("v5p-8") == 16.80 and cost.price("v6e-8") == 21.52 and cost.price("2xH100") == 22.12
    assert cost.price_table() == profiles.PRICES_USD_PER_HOUR


def test_overrides_and_new_platforms_do_not_touch_the_defaults():
    before = dict(profiles.PRICES_USD_PER_HOUR)
    prices = {"v5p-8": 10.0, "v6e-4": 10.76}
    assert cost.price("v5p-8", prices) == 10.0 and cost.price("v6e-4", prices) == 10.76
    assert cost.price("2xH100", prices) == 22.12  # not overridden: the default stays
    assert profiles.PRICES_USD_PER_HOUR == before
    assert cost.parse_price_overrides(["v5p-8=10", " v6e-4 = 10.76 "]) == prices


def test_training_cost():
    assert cost.training_cost(2.5, "v5p-8") == pytest.approx(2.5 * 16.80)
    assert cost.training_cost(0, "2xH100") == 0.0
    assert cost.training_cost(3, "v5p-8", prices={"v5p-8": 4.0}) == pytest.approx(12.0)


@pytest.mark.parametrize("tpu_hours", [1.0, 10.0, 37.5])
def test_paper_training_cost_ratio_is_2_12(tpu_hours):
    # The paper's inputs: the GPU run took 1.61x as long as the TPU run; 2xH100 at $22.12/h vs v5p-8 at $16.80/h.
    df = cost.training_comparison(tpu_hours=tpu_hours, gpu_hours=1.61 * tpu_hours)
    assert round(df.attrs["time_ratio"], 2) == 1.61
    assert round(df.attrs["cost_ratio"], 2) == 2.12  # the paper's stated result
    rows = df.set_index("platform")
    assert list(rows.index) == ["v5p-8", "2xH100", "2xH100 / v5p-8"]
    assert rows.loc["v5p-8", "cost_usd"] == pytest.approx(tpu_hours * 16.80)
    assert rows.loc["2xH100", "cost_usd"] == pytest.approx(1.61 * tpu_hours * 22.12)
    assert rows.loc["2xH100 / v5p-8", "cost_usd"] == pytest.approx(df.attrs["cost_ratio"])
    assert rows.loc["2xH100 / v5p-8", "usd_per_hour"] == pytest.approx(22.12 / 16.80)


def test_cost_ratio_follows_price_overrides():
    # Equal prices: the cost ratio is the time ratio.
    df = cost.training_comparison(2.0, 3.0, prices={"v5p-8": 20.0, "2xH100": 20.0})
    assert df.attrs["cost_ratio"] == pytest.approx(1.5)


def test_cost_per_million_output_tokens():
    # $36/h is $0.01/s; at 1000 tok/s a million tokens take 1000 s -> $10.
    assert cost.cost_per_million_output_tokens(1000, "x", prices={"x": 36.0}) == pytest.approx(10.0)
    # v6e-8 at its list price: 21.52 / 3600 / 2500 * 1e6
    assert cost.cost_per_million_output_tokens(2500, "v6e-8") == pytest.approx(21.52 / 3600 / 2500 * 1e6)


def test_serving_comparison_orders_by_cost_and_reads_bench_json(tmp_path):
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"request_throughput": 3.0, "output_throughput": 2000.0, "mean_ttft_ms": 90.0}))
    df = cost.serving_comparison({"2xH100": 1000.0, "v6e-8": bench})
    assert list(df["platform"]) == ["v6e-8", "2xH100"]  # 21.52/2000 per token beats 22.12/1000
    assert df.loc[0, "output_tok_per_s"] == 2000.0
    assert df.loc[0, "vs_cheapest"] == 1.0
    assert df.loc[1, "vs_cheapest"] == pytest.approx((22.12 / 1000) / (21.52 / 2000))
    (tmp_path / "other.json").write_text("{}")
    with pytest.raises(cost.CostError, match="output_throughput"):
        cost.serving_comparison({"v6e-8": tmp_path / "other.json"})


@pytest.mark.parametrize("call, match", [
    (lambda: cost.price("a100"), "Unknown platform 'a100'.*v5p-8"),
    (lambda: cost.training_cost(-1, "v5p-8"), "hours"),
    (lambda: cost.training_comparison(0, 1), "TPU hours"),
    (lambda: cost.training_comparison(1, float("nan")), "GPU hours"),
    (lambda: cost.training_comparison(1, 2, gpu="8xB200"), "Unknown platform '8xB200'"),
    (lambda: cost.cost_per_million_output_tokens(0, "v6e-8"), "tokens per second"),
    (lambda: cost.price("v5p-8", prices={"v5p-8": -3}), "price"),
    (lambda: cost.parse_price_overrides(["v5p-8:16"]), "NAME=USD"),
    (lambda: cost.parse_price_overrides(["v5p-8=cheap"]), "number"),
    (lambda: cost.serving_comparison({}), "at least one"),
])
def test_bad_input_is_a_clear_error(call, match):
    with pytest.raises(cost.CostError, match=match):
        call()


def test_cost_command_in_process(capsys):
    assert cli.main(["cost", "--tpu-hours", "10", "--gpu-hours", "16.1"]) == 0
    out = capsys.readouterr().out
    assert "cost ratio (GPU/TPU): 2.12" in out and "2026-05" in out
    assert cli.main(["cost", "--throughput", "1000", "--platform", "x", "--price", "x=36"]) == 0
    out = capsys.readouterr().out
    assert "$10.00 per million output tokens" in out and "overridden: x" in out
    for argv, msg in [([], "give --tpu-hours"), (["--tpu-hours", "1"], "both --tpu-hours and --gpu-hours"),
                      (["--throughput", "5"], "both --throughput and --platform"),
                      (["--tpu-hours", "-1", "--gpu-hours", "2"], "TPU hours"),
                      (["--throughput", "5", "--platform", "a100"], "Unknown platform")]:
        assert cli.main(["cost", *argv]) == 2
        assert msg in capsys.readouterr().err


def test_cost_cli():
    r = run_cli("cost", "--tpu-hours", "1", "--gpu-hours", "1.61", "--throughput", "2500", "--platform", "v6e-8")
    assert r.returncode == 0, r.stderr
    assert "cost ratio (GPU/TPU): 2.12" in r.stdout
    assert f"${21.52 / 3600 / 2500 * 1e6:.2f} per million output tokens" in r.stdout
    r = run_cli("cost", "--tpu-hours", "1", "--gpu-hours", "2", "--gpu", "a100")
    assert r.returncode == 2 and "Unknown platform 'a100'" in r.stderr
