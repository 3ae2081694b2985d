"""`report --hardware` (course/commands/hardware_report.py) reading a run directory: each figure from the file its step
writes (train/done.json, train/metrics.jsonl, merged/merge_info.json, eval/last_score.json, bench/sweep.csv), and
each missing one with the step that makes it. The records are written by their own writers where they run here (the
training's device_record on this CPU, eval's record_eval); tests/e2e/test_user_paths.py reads the report of a real
smoke run."""

import json
import math
import statistics

import pytest

from gemma_tpu_helpers import __main__ as cli
from gemma_tpu_helpers.course.commands import hardware_report as hr
from gemma_tpu_helpers.course.config import profiles
from gemma_tpu_helpers.course.training import train
from support import have_iverilog, run_cli

SMOKE = profiles.get_profile("smoke")
V5P = profiles.get_profile("v5p-8")
PROG = "python -m gemma_tpu_helpers"


def cells(profile, run_dir) -> dict[str, str]:
    return {f.name: f.cell() for f in hr.figures(profile, run_dir)}


def metrics(run_dir, rows) -> None:
    (run_dir / "train").mkdir(parents=True, exist_ok=True)
    (run_dir / "train" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def done(run_dir, **fields) -> None:
    (run_dir / "train").mkdir(parents=True, exist_ok=True)
    (run_dir / "train" / train.DONE).write_text(json.dumps({"steps": 6, "seconds": 42.0, **fields}))


def merge_info(run_dir, **fields) -> None:
    (run_dir / "merged").mkdir(parents=True, exist_ok=True)
    (run_dir / "merged" / "merge_info.json").write_text(json.dumps({"step": 6, "total_size": 12_345_678_900,
                                                                     **fields}))


def test_an_empty_run_names_the_step_for_each_figure(tmp_path):
    run = tmp_path / "smoke"
    c = cells(SMOKE, run)
    train_step = f"missing: run `{PROG} train --profile smoke`"
    assert c["training devices"] == c["training"] == c["clean step time"] == train_step
    assert c["peak HBM (training)"] == train_step + " (recorded at the end of a training)"
    assert c["merge"] == f"missing: run `{PROG} merge --profile smoke`"
    assert c["pass@1"] == (f"missing: run `{PROG} eval --url http://127.0.0.1:8000 --model gemma --preset "
                           f"official-greedy --profile smoke` (with the server up)")
    assert c["serving (bench sweep)"].startswith(f"missing: run `{PROG} bench --url http://127.0.0.1:8000 --profile")
    assert c["versions"].startswith("python ") and "jax " in c["versions"]
    text, path = hr.write_report(SMOKE, run)
    assert path == run / hr.REPORT and path.read_text() == text
    last = text.strip().splitlines()[-1]
    assert last.startswith("To fill the missing figures, run: ") and last.count("`") == 8  # four steps, once each
    assert "predicted" not in text.splitlines()[2]  # a CPU profile has no prediction column


def test_a_whole_run_reads_back(tmp_path):
    run = tmp_path / "smoke"
    steps = [1.5, 2.25, 4.0]
    metrics(run, [{"step": 1, "loss": 7.0, "step_s": None}, {"step": 2, "loss": 6.0, "step_s": 9.0},
                  {"step": 2, "eval_loss": 6.5},  # an evaluation's line: not a step
                  {"step": 2, "loss": 6.0, "step_s": steps[0]},  # the resumed run's line wins
                  {"step": 3, "loss": 5.0, "step_s": steps[1]}, {"step": 4, "loss": 4.0, "step_s": steps[2]},
                  {"step": 5, "loss": 3.0, "step_s": None}])
    done(run, **train.device_record())  # this CPU, as the training writes it
    merge_info(run, seconds=3.456)
    hr.record_eval(run, {1: 0.75, 5: float("nan")}, problems=4, samples=4, simulator="12.0",
                   answers={"completions": "/x/answers.jsonl"})
    (run / "bench").mkdir()
    (run / "bench" / "sweep.csv").write_text("input_len,qps,output_throughput,median_ttft_ms\n"
                                             "512,1,10.5,120.0\n512,4,30.25,250.4\n4096,1,8.0,900.0\n")
    c = cells(SMOKE, run)
    assert c["training devices"] == "cpu x 8 (1 process)"
    assert c["training"] == "6 steps in 42.0 s (0.01 h)"
    assert c["clean step time"] == f"{statistics.median(steps):.2f} s per optimizer step (median of 3 clean steps of 5)"
    assert c["peak HBM (training)"] == "n/a on CPU"
    assert c["merge"] == "3.5 s (step 6, 12.35 GB written)"
    assert c["pass@1"].startswith("0.7500 on 4 problems (answers from /x/answers.jsonl; iverilog 12.0; ")
    assert c["serving (bench sweep)"] == ("peak 30.2 output tok/s at input 512, QPS 4 (median TTFT 250 ms there; "
                                          "3 points)")
    score = json.loads((run / "eval" / hr.EVAL_SCORE).read_text())
    assert score["pass_at_k"] == {"1": 0.75, "5": None}  # NaN (fewer samples than k) is null: standard JSON
    text, _ = hr.write_report(SMOKE, run)
    assert "missing" not in text and "To fill" not in text


def test_a_tpu_run_against_the_plans_prediction(tmp_path):
    """On a TPU profile the peak HBM of the chips and the plan's predictions stand side by side."""
    run = tmp_path / "v5p-8"
    done(run, platform="tpu", device_kind="TPU v5", device_count=4, process_count=1,
         peak_hbm_bytes=int(21.5 * 2**30), hbm_limit_bytes=int(95.74 * 2**30))
    found = {f.name: f for f in hr.figures(V5P, run)}
    assert found["training devices"].value == "TPU v5 x 4 (1 process)"
    assert found["peak HBM (training)"].value == "21.50 GiB of 95.74 GiB per chip (the largest of this process's chips)"
    pred = hr.prediction(V5P, run)
    assert found["peak HBM (training)"].compare == f"{pred['peak_bytes'] / 2**30:.2f} GiB per chip (AOT plan)"
    run_pred = pred["run"]
    assert found["clean step time"].compare == (f"{run_pred['step_s']:.2f} s (roofline) to "
                                                f"{run_pred['paper_mfu_step_s']:.2f} s (the paper's MFU)")
    assert "predicted by the course" in hr.format_report(V5P, list(found.values()), run)
    # a TPU whose runtime keeps no memory statistics
    done(run, platform="tpu", device_kind="TPU v5", device_count=4, process_count=1, peak_hbm_bytes=None)
    assert cells(V5P, run)["peak HBM (training)"] == "not reported by the tpu runtime"


def test_partial_and_older_records_say_what_to_do(tmp_path):
    run = tmp_path / "smoke"
    metrics(run, [{"step": 1, "loss": 7.0, "step_s": None}])
    c = cells(SMOKE, run)
    assert c["training"].endswith("(the training has not finished: the same command resumes it)")
    assert c["clean step time"].endswith("(none of its 1 steps is clean: a process's first step compiles, the last "
                                         "saves, and saves and evaluations are left out; train more steps)")
    done(run)  # written before the course recorded the devices
    merge_info(run)  # and a merge before it recorded its seconds
    c = cells(SMOKE, run)
    assert "(not recorded: trained before the course recorded it)" in c["training devices"]
    assert c["merge"] == (f"missing: run `{PROG} merge --profile smoke --overwrite` (not recorded: merged before the "
                          f"course recorded its time)")


def test_a_damaged_record_is_one_line_with_the_step(tmp_path, capsys):
    run = tmp_path / "runs" / "smoke"
    (run / "train").mkdir(parents=True)
    (run / "train" / train.DONE).write_text("{not json")
    with pytest.raises(hr.ReportError, match=r"done.json is not JSON .*train writes it: run that step again"):
        hr.figures(SMOKE, run)
    assert cli.main(["report", "--profile", "smoke", "--hardware", "--runs", str(tmp_path / "runs")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "done.json" in err[0], err
    (run / "train" / train.DONE).unlink()
    (run / "train" / "metrics.jsonl").write_text('{"step": 1, "loss": 7.0}\n{"step": 2, "lo')  # cut off
    with pytest.raises(hr.ReportError, match=r"metrics.jsonl has a line that is not JSON .*run the training again"):
        hr.figures(SMOKE, run)


def test_device_record_on_this_cpu():
    rec = train.device_record()
    assert rec == {"platform": "cpu", "device_kind": "cpu", "device_count": SMOKE.hardware.num_devices,
                   "process_count": 1, "peak_hbm_bytes": None, "hbm_limit_bytes": None}


def test_record_eval_writes_null_for_nan(tmp_path):
    path = hr.record_eval(tmp_path, {1: float("nan")}, 1, 1, "12.0", {"url": "u"})
    assert json.loads(path.read_text())["pass_at_k"] == {"1": None}
    assert not list(tmp_path.glob("eval/.*"))  # the atomic writer left no temporary file
    c = cells(SMOKE, tmp_path)
    assert c["pass@1"].startswith("missing: run ")  # pass@1 n/a is no score


@pytest.mark.skipif(not have_iverilog(), reason="install Icarus Verilog 12: make iverilog")
def test_eval_records_its_last_score(tmp_path):
    """The eval step writes what the report reads: its pass@k in RUN_DIR/eval/last_score.json."""
    from gemma_tpu_helpers.course.config import paths
    from gemma_tpu_helpers.fixes.eval import eval_problems

    probs = sorted(eval_problems.load_problems(paths.SHIPPED_EVAL), key=lambda p: len(eval_problems.reference_code(p)))
    ok, bad = probs[0], probs[1]
    comp = tmp_path / "answers.jsonl"
    comp.write_text(json.dumps({"task_id": ok.task_id, "completion": eval_problems.reference_code(ok)}) + "\n"
                    + json.dumps({"task_id": bad.task_id, "completion": "no code"}) + "\n")
    r = run_cli("eval", "--completions", comp, "--tasks", f"{ok.task_id},{bad.task_id}", "--run-dir", tmp_path,
                "--k", "1,5")
    assert r.returncode == 0, r.stderr
    score = json.loads((tmp_path / "eval" / hr.EVAL_SCORE).read_text())
    assert score["pass_at_k"] == {"1": 0.5, "5": None} and (score["problems"], score["samples"]) == (2, 2)
    assert score["answers"] == {"completions": str(comp)} and math.isfinite(score["pass_at_k"]["1"])
    assert f"score recorded in {tmp_path / 'eval' / hr.EVAL_SCORE}" in r.stdout


def test_the_report_imports_no_jax(tmp_path):
    """On the serving VM vLLM holds the TPU: the report (like eval) reads files and imports no JAX."""
    import subprocess
    import sys

    code = ("import sys, contextlib, io\nfrom gemma_tpu_helpers import __main__ as m\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            "    rc = m.main(['report', '--profile', 'v5p-8', '--hardware', '--runs', sys.argv[1]])\n"
            "print(rc, sorted(n for n in ('jax', 'jaxlib', 'torch', 'tunix') if n in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert r.stdout.split("\n")[0] == "0 []", (r.stdout, r.stderr[-2000:])
