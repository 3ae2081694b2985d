"""TPU-vs-GPU cost: training runs and serving throughput turned into dollars (notebook 10).

Prices are parameters with a date, not facts: the defaults are list prices (on-demand, us-central1) from
:data:`profiles.PRICES_USD_PER_HOUR` as of :data:`profiles.PRICES_DATE`. Pass ``prices={"v5p-8": 12.0}`` (or
``--price v5p-8=12.0`` on the command line) to use yours; a new name adds a platform.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Mapping

from ...fixes.core.errors import GemmaTpuError
from ..config.profiles import PRICES_DATE, PRICES_USD_PER_HOUR

DEFAULT_TPU = "v5p-8"
DEFAULT_GPU = "2xH100"


class CostError(GemmaTpuError, ValueError):
    pass


def _positive(name: str, value, allow_zero: bool = False) -> float:
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise CostError(f"{name} must be a number (got {value!r})") from None
    if math.isnan(v) or math.isinf(v) or v < 0 or (v == 0 and not allow_zero):
        raise CostError(f"{name} must be {'>= 0' if allow_zero else '> 0'} and finite (got {value!r})")
    return v


def price_table(prices: Mapping[str, float] | None = None) -> dict[str, float]:
    """The default list prices with ``prices`` laid over them (USD per hour)."""
    out = dict(PRICES_USD_PER_HOUR)
    for name, usd in (prices or {}).items():
        out[str(name)] = _positive(f"price of {name!r}", usd)
    return out


def price(platform: str, prices: Mapping[str, float] | None = None) -> float:
    """USD per hour of ``platform``; a clear error naming the known platforms otherwise."""
    table = price_table(prices)
    if platform not in table:
        raise CostError(f"Unknown platform {platform!r}. Known: {', '.join(table)} (prices of {PRICES_DATE}); "
                        f"add one with prices={{'{platform}': USD_PER_HOUR}} or --price {platform}=USD_PER_HOUR.")
    return table[platform]


def parse_price_overrides(items) -> dict[str, float]:
    """``["v5p-8=15.5", "v6e-4=10.8"]`` -> ``{"v5p-8": 15.5, "v6e-4": 10.8}``."""
    out = {}
    for item in items or []:
        name, sep, usd = str(item).partition("=")
        if not sep or not name.strip():
            raise CostError(f"--price takes NAME=USD_PER_HOUR, e.g. v5p-8=16.80 (got {item!r})")
        out[name.strip()] = _positive(f"price of {name.strip()!r}", usd.strip())
    return out


def training_cost(hours: float, platform: str, prices: Mapping[str, float] | None = None) -> float:
    """USD for ``hours`` of ``platform``."""
    return _positive("hours", hours, allow_zero=True) * price(platform, prices)


def training_comparison(tpu_hours: float, gpu_hours: float, tpu: str = DEFAULT_TPU, gpu: str = DEFAULT_GPU,
                        prices: Mapping[str, float] | None = None):
    """One table: hours, USD/h and USD per platform, plus a ``GPU / TPU`` row holding the ratios.

    In the ratio row, ``hours`` is the time ratio (GPU time / TPU time), ``usd_per_hour`` the price ratio and
    ``cost_usd`` the cost ratio (how many times more the GPU run costs).
    """
    import pandas as pd

    tpu_h = _positive("TPU hours (--tpu-hours)", tpu_hours)
    gpu_h = _positive("GPU hours (--gpu-hours)", gpu_hours)
    p_tpu, p_gpu = price(tpu, prices), price(gpu, prices)
    c_tpu, c_gpu = tpu_h * p_tpu, gpu_h * p_gpu
    df = pd.DataFrame([
        {"platform": tpu, "hours": tpu_h, "usd_per_hour": p_tpu, "cost_usd": c_tpu},
        {"platform": gpu, "hours": gpu_h, "usd_per_hour": p_gpu, "cost_usd": c_gpu},
        {"platform": f"{gpu} / {tpu}", "hours": gpu_h / tpu_h, "usd_per_hour": p_gpu / p_tpu,
         "cost_usd": c_gpu / c_tpu},
    ])
    df.attrs.update(time_ratio=gpu_h / tpu_h, cost_ratio=c_gpu / c_tpu, prices_date=PRICES_DATE)
    return df


def cost_per_million_output_tokens(output_tokens_per_s: float, platform: str,
                                   prices: Mapping[str, float] | None = None) -> float:
    """USD per 1e6 generated tokens at a sustained ``output_tokens_per_s`` (``vllm bench serve``'s
    ``output_throughput``) on ``platform``: price per hour / (tokens per hour) x 1e6."""
    tps = _positive("output tokens per second", output_tokens_per_s)
    return price(platform, prices) / (tps * 3600.0) * 1e6


def read_bench_throughput(path: str | os.PathLike) -> float:
    """``output_throughput`` (tokens/s) from a ``vllm bench serve --save-result`` JSON file."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise CostError(f"benchmark result {path} does not exist") from None
    except json.JSONDecodeError as e:
        raise CostError(f"{path} is not JSON ({e.msg})") from None
    if "output_throughput" not in data:
        raise CostError(f"{path} has no 'output_throughput' field; is it a `vllm bench serve` result?")
    return float(data["output_throughput"])


def serving_comparison(throughputs: Mapping[str, float | str | os.PathLike],
                       prices: Mapping[str, float] | None = None):
    """USD per million output tokens per platform, cheapest first.

    ``throughputs`` maps a platform to its output tokens/s, or to a ``vllm bench serve`` result JSON.
    ``vs_cheapest`` is each platform's cost over the cheapest one's.
    """
    import pandas as pd

    if not throughputs:
        raise CostError("serving_comparison needs at least one platform")
    rows = []
    for platform, tps in throughputs.items():
        if isinstance(tps, (str, os.PathLike)):
            tps = read_bench_throughput(tps)
        rows.append({"platform": platform, "output_tok_per_s": _positive(f"throughput of {platform!r}", tps),
                     "usd_per_hour": price(platform, prices),
                     "usd_per_million_output_tokens": cost_per_million_output_tokens(tps, platform, prices)})
    df = pd.DataFrame(rows).sort_values("usd_per_million_output_tokens", kind="stable").reset_index(drop=True)
    df["vs_cheapest"] = df["usd_per_million_output_tokens"] / df["usd_per_million_output_tokens"].iloc[0]
    df.attrs["prices_date"] = PRICES_DATE
    return df

