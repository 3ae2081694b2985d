"""The evaluation's results as notebook 09 shows them: a table per problem and a chart of the outcomes."""

from __future__ import annotations

from typing import Sequence

from ...fixes.eval.eval_score import category_counts, pass_at_k
from ...fixes.eval.eval_simulate import CATEGORIES


def results_table(results, ks: Sequence[int] = (1, 5)):
    """Per task of ``eval_score.score_completions``' results: samples, passes, pass@k (NaN where n < k), the count
    of each failure category and ``official``, the samples' VerilogEval letters in order, in groups of five as its
    analyzer prints them (e.g. ``..S.R .T``)."""
    import pandas as pd

    rows = []
    for task_id, g in results.groupby("task_id", sort=True):
        n, c = len(g), int(g["passed"].sum())
        row = {"task_id": task_id, "n": n, "passed": c}
        for k in ks:
            row[f"pass@{k}"] = pass_at_k(n, c, k) if k <= n else float("nan")
        counts = g["category"].value_counts()
        row.update({cat: int(counts.get(cat, 0)) for cat in CATEGORIES if cat != "pass"})
        if "official" in g:
            letters = "".join(g.sort_values("sample_index")["official"])
            row["official"] = " ".join(letters[i:i + 5] for i in range(0, len(letters), 5))
        rows.append(row)
    return pd.DataFrame(rows)


def failure_chart(results, ax=None, title: str | None = None):
    """Bar chart of the outcome categories (pass included, for scale). Returns the matplotlib Axes."""
    import matplotlib.pyplot as plt

    counts = category_counts(results)
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 3.2))
    colors = ["#2a9d8f" if c == "pass" else "#e76f51" for c in counts.index]
    bars = ax.bar(counts.index, counts.values, color=colors)
    ax.bar_label(bars)
    ax.set_ylabel("samples")
    ax.set_title(title or f"Outcomes of {int(counts.sum())} samples")
    ax.tick_params(axis="x", rotation=20)
    ax.figure.tight_layout()
    return ax
