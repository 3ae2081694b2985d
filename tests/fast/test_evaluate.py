"""VerilogEval-style evaluation: code extraction, the iverilog harness and its failure categories, pass@k,
problem loading, the OpenAI-compatible client (against a fake server on 127.0.0.1) and the `eval` CLI.

The iverilog tests are skipped only when iverilog is not installed.
"""

import argparse
import dataclasses
import http.server
import itertools
import json
import math
import os
import re
import shutil
import socket
import threading
import time
from fractions import Fraction
from pathlib import Path

import pytest

from gemma_tpu_helpers import __main__ as cli
from gemma_tpu_helpers.course.commands import commands_serve
from gemma_tpu_helpers.course.config import paths
from gemma_tpu_helpers.course.views import eval_views
from gemma_tpu_helpers.fixes.eval import eval_problems, eval_sample, eval_score, eval_simulate
from support import run_cli


def _have_iverilog():
    try:
        eval_simulate.simulator_tools()
        return True
    except eval_simulate.IverilogNotFoundError:
        return False


needs_iverilog = pytest.mark.skipif(not _have_iverilog(), reason="install Icarus Verilog 12: make iverilog")
REAL_TOOLS = eval_simulate.simulator_tools() if _have_iverilog() else None  # before any test changes the environment

PROBLEMS = eval_problems.load_problems(paths.SHIPPED_EVAL)
BY_ID = {p.task_id: p for p in PROBLEMS}
MAJ = BY_ID["Prob001_majority3"]


def as_top(problem):
    """The reference solution renamed to TopModule: a correct answer by construction."""
    return re.sub(r"\bRefModule\b", "TopModule", problem.ref)


def fenced(code, lang="verilog"):
    return f"Here is the module.\n```{lang}\n{code}\n```\nIt implements the spec."


# Prob001: y = majority(a, b, c).
MAJ_PORTS = "module TopModule(input a, input b, input c, output y);\n"
MAJ_AND = MAJ_PORTS + "    assign y = a & b & c;\nendmodule\n"  # wrong logic
MAJ_SYNTAX = MAJ_PORTS + "    assign y = (a & b) | (a & c) | (b & c)\nendmodule\n"  # missing semicolon
MAJ_WRONG_NAME = as_top(MAJ).replace("TopModule", "Majority")
MAJ_HANG = MAJ_PORTS + "    assign y = a;\n    initial while (1) begin end\nendmodule\n"  # zero-time infinite loop
MAJ_EARLY_FINISH = MAJ_PORTS + "    assign y = a;\n    initial $finish;\nendmodule\n"  # ends before the report


# ---------------------------------------------------------------------------
# extract_verilog
# ---------------------------------------------------------------------------

GOOD = "module TopModule(input a, output y);\n  assign y = a;\nendmodule"


@pytest.mark.parametrize("lang", ["verilog", "systemverilog", "", "Verilog", "sv"])
def test_extract_fenced_block(lang):
    assert eval_problems.extract_verilog(fenced(GOOD, lang)) == GOOD


def test_extract_prefers_the_topmodule_block_and_ignores_other_languages():
    helper = "module helper(input x, output z);\n  assign z = ~x;\nendmodule"
    text = (f"First a script:\n```python\nprint('module Fake')\n```\nA helper:\n```verilog\n{helper}\n```\n"
            f"The answer:\n```verilog\n{GOOD}\n```")
    assert eval_problems.extract_verilog(text) == GOOD
    # without a TopModule block the first Verilog block with a module is taken
    assert eval_problems.extract_verilog(f"```verilog\n{helper}\n```\n"
                                         f"```verilog\n{helper.replace('helper', 'h2')}\n```") == helper


def test_extract_unterminated_fence_and_bare_module():
    cut = "Sure:\n```verilog\nmodule TopModule(input a, output y);\n  assign y = a;\n"  # cut by max_tokens
    assert eval_problems.extract_verilog(cut) == "module TopModule(input a, output y);\n  assign y = a;"
    bare = f"The design:\n\n{GOOD}\n\nDone. Another:\nmodule other; endmodule\nbye"
    assert eval_problems.extract_verilog(bare) == GOOD + "\n\nmodule other; endmodule"


def test_extract_strips_think():
    draft = "module TopModule(input a, output y); assign y = 0; endmodule"
    text = f"<think>Let me try\n```verilog\n{draft}\n```\nno, wrong.</think>\nFinal:\n{fenced(GOOD)}"
    assert eval_problems.extract_verilog(text) == GOOD
    # the template opened <think> in the prompt: only the part after </think> is the answer
    assert eval_problems.extract_verilog(f"reasoning {draft} ...</think>{fenced(GOOD)}") == GOOD
    # reasoning cut off by max_tokens: a module inside it is not an answer
    assert eval_problems.extract_verilog(f"<think>maybe\n```verilog\n{draft}\n```\nhmm") is None


@pytest.mark.parametrize("text", [None, "", "I cannot help with that.", "```python\nx = 1\n```",
                                  "```verilog\n// just a comment\n```", "the module should be fast"])
def test_extract_none_without_code(text):
    assert eval_problems.extract_verilog(text) is None


# ---------------------------------------------------------------------------
# simulate: each category from a crafted sample
# ---------------------------------------------------------------------------

@needs_iverilog
def test_reference_passes():
    r = eval_simulate.simulate(as_top(MAJ), MAJ)
    assert r.category == "pass" and r.passed
    # Prob001's testbench checks twice in each of 16 cycles.
    assert (r.mismatches, r.samples) == (0, 32)


@needs_iverilog
def test_wrong_logic_is_a_mismatch():
    r = eval_simulate.simulate(MAJ_AND, MAJ)
    # a&b&c differs from majority when exactly two inputs are 1: 3 of the 8 input values; the testbench walks
    # cycle = 0..15 ({a,b,c} = its low 3 bits, so each value twice) and checks twice per cycle: 3 * 2 * 2 = 12.
    assert (r.category, r.mismatches, r.samples) == ("mismatch", 12, 32)
    assert not r.passed and "12 of 32" in r.detail


@needs_iverilog
@pytest.mark.parametrize("code, expect", [(MAJ_SYNTAX, "syntax error"), (MAJ_WRONG_NAME, "Unknown module type")])
def test_compile_errors(code, expect):
    r = eval_simulate.simulate(code, MAJ)
    assert r.category == "compile_error" and expect in r.detail and expect in r.log_tail
    assert r.mismatches is None


@needs_iverilog
def test_hang_is_killed_as_timeout():
    start = time.monotonic()
    r = eval_simulate.simulate(MAJ_HANG, MAJ, timeout=2)
    elapsed = time.monotonic() - start
    assert r.category == "timeout" and "2 s" in r.detail
    assert elapsed < 10, elapsed


@needs_iverilog
def test_no_result_line_is_a_runtime_error():
    r = eval_simulate.simulate(MAJ_EARLY_FINISH, MAJ)
    assert r.category == "runtime_error" and "Mismatches" in r.detail


@needs_iverilog
@pytest.mark.parametrize("report, category", [
    ('$display("Mismatches: 0 in 0 samples");', "runtime_error"),  # nothing was checked
    ('$display("TIMEOUT");', "timeout"),  # the testbench's own time limit
    ('$display("Mismatches: 0 in 5 samples");', "pass"),
    ('$display("Mismatches: 2 in 5 samples");', "mismatch"),
])
def test_testbench_report_parsing(report, category):
    tb = ("module tb(); wire y; TopModule dut(.a(1'b0), .b(1'b0), .c(1'b0), .y(y));\n"
          f"initial begin #1 {report} $finish; end\nendmodule\n")
    prob = eval_problems.Problem(task_id="custom", prompt="", ref=MAJ.ref, test=tb)
    assert eval_simulate.simulate(as_top(MAJ), prob).category == category


@needs_iverilog
def test_output_flood_is_stopped(monkeypatch):
    monkeypatch.setattr(eval_simulate, "MAX_LOG_BYTES", 20_000)
    flood = MAJ_PORTS + '    assign y = a;\n    initial forever $display("spam spam spam spam");\nendmodule\n'
    start = time.monotonic()
    r = eval_simulate.simulate(flood, MAJ, timeout=20)
    assert r.category == "runtime_error" and "20,000 bytes" in r.detail
    assert time.monotonic() - start < 15


def test_no_code_needs_no_simulator():
    assert eval_simulate.simulate(None, MAJ).category == "no_code"
    assert eval_simulate.simulate("   \n", MAJ).category == "no_code"


def test_missing_iverilog_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty folder: no iverilog, no vvp
    with pytest.raises(eval_simulate.IverilogNotFoundError, match=r"not on PATH.*Icarus Verilog 12"):
        eval_simulate.simulate(as_top(MAJ), MAJ)
    with pytest.raises(eval_simulate.IverilogNotFoundError, match="not on PATH"):
        eval_score.score_completions([MAJ], [{"task_id": MAJ.task_id, "completion": fenced(as_top(MAJ))}], ks=(1,))
    with pytest.raises(eval_simulate.IverilogNotFoundError, match="nothing-here.*not an executable"):
        eval_simulate.simulator_tools(tmp_path / "nothing-here")


# ---------------------------------------------------------------------------
# pass@k
# ---------------------------------------------------------------------------

def brute_force_pass_at_k(n, c, k):
    """Fraction of all k-subsets of n samples (the first c correct) that hold at least one correct sample."""
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(i < c for i in s) for s in subsets) / len(subsets)


def test_pass_at_k_matches_brute_force():
    for n in range(1, 8):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert (eval_score.pass_at_k(n, c, k)
                        == pytest.approx(brute_force_pass_at_k(n, c, k), abs=1e-12)), (n, c, k)


@pytest.mark.parametrize("n", [200, 2000])
def test_pass_at_k_is_stable_for_large_n(n):
    for c in (0, 1, 7, n // 2, n - 1, n):
        for k in (1, 5, 10, 100):
            exact = 1 - Fraction(math.comb(n - c, k), math.comb(n, k))  # exact rational arithmetic
            got = eval_score.pass_at_k(n, c, k)
            assert 0.0 <= got <= 1.0
            assert got == pytest.approx(float(exact), abs=1e-12), (n, c, k)
    assert eval_score.pass_at_k(n, 1, 1) == pytest.approx(1 / n, abs=1e-15)
    if n == 2000:  # the textbook float formula cannot even represent C(2000, 1000)
        with pytest.raises(OverflowError):
            float(math.comb(n, 1000))


def test_pass_at_k_edge_cases():
    assert eval_score.pass_at_k(5, 5, 5) == 1.0
    assert eval_score.pass_at_k(10, 8, 3) == 1.0  # n - c < k: every k-subset holds a correct sample
    assert eval_score.pass_at_k(10, 0, 3) == 0.0
    with pytest.raises(ValueError, match="at least 5 samples"):
        eval_score.pass_at_k(3, 1, 5)
    for bad in [(0, 0, 1), (3, 4, 1), (3, -1, 1), (3, 1, 0), (3.5, 1, 1)]:
        with pytest.raises(ValueError):
            eval_score.pass_at_k(*bad)


# ---------------------------------------------------------------------------
# problems and prompts
# ---------------------------------------------------------------------------

def test_shipped_problems_load():
    assert len(PROBLEMS) == 28 and [p.task_id for p in PROBLEMS] == sorted(BY_ID)
    for p in PROBLEMS:
        assert "TopModule" in p.prompt and "module RefModule" in p.ref and re.search(r"module tb\b", p.test)
    assert MAJ.kind == "combinational" and MAJ.description


def copy_problems(dst, task_ids):
    dst.mkdir(parents=True, exist_ok=True)
    for t in task_ids:
        for suffix in eval_problems.FILE_SUFFIXES.values():
            shutil.copy(paths.SHIPPED_EVAL / (t + suffix), dst / (t + suffix))
    return dst


def test_own_problem_folder_and_missing_file(tmp_path):
    d = copy_problems(tmp_path / "mine", ["Prob001_majority3", "Prob017_detect_0110"])
    got = eval_problems.load_problems(d)
    assert [p.task_id for p in got] == ["Prob001_majority3", "Prob017_detect_0110"]
    assert got[0].kind is None  # no problems.jsonl there: metadata is optional
    (d / "Prob017_detect_0110_test.sv").unlink()
    with pytest.raises(eval_problems.EvalError, match=r"Prob017_detect_0110.*missing Prob017_detect_0110_test\.sv"):
        eval_problems.load_problems(d)
    with pytest.raises(eval_problems.EvalError, match="does not exist"):
        eval_problems.load_problems(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(eval_problems.EvalError, match="No problems"):
        eval_problems.load_problems(tmp_path / "empty")
    with pytest.raises(eval_problems.EvalError, match="Unknown task"):
        eval_problems.load_problems(paths.SHIPPED_EVAL, tasks=["Prob999_nope"])


def test_build_prompt_is_spec_to_rtl():
    text = eval_problems.build_prompt(MAJ)
    assert MAJ.prompt.strip() in text
    assert text.index("Question:") < text.index(MAJ.prompt.strip()) < text.index("Answer:")
    assert "TopModule" in text and "```verilog" in text


# ---------------------------------------------------------------------------
# score_completions, tables, chart
# ---------------------------------------------------------------------------

@needs_iverilog
def test_all_shipped_references_score_pass_at_1_of_1():
    rows = [{"task_id": p.task_id, "completion": fenced(as_top(p))} for p in PROBLEMS]
    results, scores = eval_score.score_completions(PROBLEMS, rows, ks=(1,), progress=False)
    assert scores == {1: 1.0}
    assert len(results) == 28 and results["passed"].all()


@needs_iverilog
def test_broken_set_scores_zero_with_every_category():
    rows = [{"task_id": MAJ.task_id, "completion": c} for c in [
        "I am not sure how to do this.", fenced(MAJ_SYNTAX), fenced(MAJ_AND), fenced(MAJ_HANG),
        fenced(MAJ_EARLY_FINISH)]]
    results, scores = eval_score.score_completions(PROBLEMS, rows, ks=(1, 5), timeout=2, progress=False)
    assert scores == {1: 0.0, 5: 0.0}
    assert list(results["category"]) == ["no_code", "compile_error", "mismatch", "timeout", "runtime_error"]
    assert list(results["sample_index"]) == [0, 1, 2, 3, 4]


@needs_iverilog
def test_mixed_samples_pass_at_k_and_tables():
    good, bad = fenced(as_top(MAJ)), fenced(MAJ_AND)
    prob2 = BY_ID["Prob002_mux3_8bit"]
    rows = ([{"task_id": MAJ.task_id, "completion": c} for c in (good, bad, good, bad)]
            + [{"task_id": prob2.task_id, "completion": "no idea"}] * 4)
    results, scores = eval_score.score_completions(PROBLEMS, rows, ks=(1, 2, 5), progress=False)
    # Prob001: n=4, c=2 -> pass@1 = 1/2, pass@2 = 1 - C(2,2)/C(4,2) = 5/6; Prob002: 0. Mean over the two tasks.
    assert scores[1] == pytest.approx(0.25)
    assert scores[2] == pytest.approx(5 / 12)
    assert math.isnan(scores[5])  # 4 samples cannot give pass@5
    table = eval_views.results_table(results, ks=(1, 2)).set_index("task_id")
    assert table.loc[MAJ.task_id, "n"] == 4 and table.loc[MAJ.task_id, "passed"] == 2
    assert table.loc[MAJ.task_id, "mismatch"] == 2 and table.loc[prob2.task_id, "no_code"] == 4
    assert table.loc[MAJ.task_id, "pass@2"] == pytest.approx(5 / 6)
    assert table.loc[MAJ.task_id, "official"] == ".R.R" and table.loc[prob2.task_id, "official"] == "mmmm"

    import matplotlib

    matplotlib.use("Agg")
    ax = eval_views.failure_chart(results)
    heights = {t.get_text(): p.get_height() for t, p in zip(ax.get_xticklabels(), ax.patches)}
    assert heights == {"pass": 2, "mismatch": 2, "compile_error": 0, "runtime_error": 0, "timeout": 0, "no_code": 4}


def test_unknown_task_in_completions_is_an_error():
    with pytest.raises(eval_problems.EvalError, match="Prob999_x"):
        eval_score.score_completions(PROBLEMS, [{"task_id": "Prob999_x", "completion": "x"}], progress=False)


# ---------------------------------------------------------------------------
# The OpenAI-compatible client, against a fake server
# ---------------------------------------------------------------------------

class FakeServer:
    """Answers /v1/models and /v1/chat/completions like vLLM; each answer is the reference as TopModule."""

    def __init__(self, model="gemma-verilog", fail_chat=False):
        fake = self
        self.requests, self.headers = [], []
        refs = {p.prompt.strip(): as_top(p) for p in PROBLEMS}

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def reply(self, code, obj):
                body = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                if self.path == "/v1/models":
                    return self.reply(200, {"object": "list", "data": [{"id": model, "object": "model"}]})
                self.reply(404, {"error": "not found"})

            def do_POST(self):
                payload = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                fake.requests.append(payload)
                fake.headers.append(dict(self.headers))
                if fail_chat:
                    return self.reply(400, {"error": {"message": "max_tokens is too large"}})
                user = payload["messages"][-1]["content"]
                code = next(ref for spec, ref in refs.items() if spec in user)
                choices = [{"index": i, "message": {"role": "assistant", "content": fenced(code)},
                            "finish_reason": "stop"} for i in range(payload.get("n", 1))]
                self.reply(200, {"id": "x", "object": "chat.completion", "model": model, "choices": choices})

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def fake_server():
    servers = []

    def make(**kw):
        servers.append(FakeServer(**kw))
        return servers[-1]

    yield make
    for s in servers:
        s.close()


@needs_iverilog
def test_sample_completions_contract_and_scoring(fake_server):
    srv = fake_server()
    probs = [MAJ, BY_ID["Prob017_detect_0110"]]
    rows = eval_sample.sample_completions(srv.url, "gemma-verilog", probs, n=3, temperature=0.8, max_tokens=512,
                                 api_key="secret", top_p=0.95, progress=False)
    assert [(r["task_id"], r["sample_index"]) for r in rows] == [(p.task_id, i) for p in probs for i in range(3)]
    assert {r["finish_reason"] for r in rows} == {"stop"}
    req = srv.requests[0]
    assert (req["model"], req["n"], req["temperature"], req["max_tokens"], req["top_p"]) == (
        "gemma-verilog", 3, 0.8, 512, 0.95)
    assert req["messages"][0] == {"role": "system", "content": eval_problems.SYSTEM_PROMPT}
    assert (req["messages"][1]["role"] == "user"
            and req["messages"][1]["content"] in {eval_problems.build_prompt(p) for p in probs})
    assert srv.headers[0].get("Authorization") == "Bearer secret"
    results, scores = eval_score.score_completions(PROBLEMS, rows, ks=(1, 3), progress=False)
    assert scores == {1: 1.0, 3: 1.0}
    assert set(results["finish_reason"]) == {"stop"}  # kept, so truncated answers can be told apart


def test_server_errors_are_clear(fake_server):
    srv = fake_server()
    with pytest.raises(eval_sample.ServerError, match="does not serve model 'other'.*gemma-verilog"):
        eval_sample.sample_completions(srv.url + "/v1", "other", [MAJ], progress=False)
    bad = fake_server(fail_chat=True)
    with pytest.raises(eval_sample.ServerError, match="HTTP 400.*max_tokens is too large"):
        eval_sample.sample_completions(bad.url, "gemma-verilog", [MAJ], progress=False)


def test_unreachable_server_fails_fast():
    with socket.socket() as s:  # a port nobody listens on: connection refused
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    start = time.monotonic()
    with pytest.raises(eval_sample.ServerError, match="No OpenAI-compatible server answered at"):
        eval_sample.sample_completions(f"http://127.0.0.1:{port}", "m", [MAJ], connect_timeout=2, progress=False)
    assert time.monotonic() - start < 5


def test_silent_server_fails_within_the_connect_timeout():
    with socket.socket() as s:  # listens but never answers: a hung or still-loading server
        s.bind(("127.0.0.1", 0))
        s.listen(8)
        start = time.monotonic()
        with pytest.raises(eval_sample.ServerError, match="within 1 s"):
            eval_sample.sample_completions(f"http://127.0.0.1:{s.getsockname()[1]}", "m", [MAJ], connect_timeout=1,
                                  progress=False)
        assert time.monotonic() - start < 5


# ---------------------------------------------------------------------------
# Files and the CLI
# ---------------------------------------------------------------------------

def test_write_jsonl_atomic_refuses_to_overwrite(tmp_path):
    out = tmp_path / "sub" / "r.jsonl"
    eval_sample.write_jsonl_atomic(out, [{"a": 1}])
    with pytest.raises(FileExistsError, match="overwrite"):
        eval_sample.write_jsonl_atomic(out, [{"a": 2}])
    assert out.read_text() == '{"a": 1}\n'
    eval_sample.write_jsonl_atomic(out, [{"a": 2}], overwrite=True)
    assert out.read_text() == '{"a": 2}\n'
    assert [p.name for p in out.parent.iterdir()] == ["r.jsonl"]  # no temp files left behind


def test_read_completions_errors(tmp_path):
    f = tmp_path / "c.jsonl"
    f.write_text('{"task_id": "a", "completion": "x"}\nnot json\n')
    with pytest.raises(eval_problems.EvalError, match=r"c\.jsonl:2"):
        eval_sample.read_completions(f)
    f.write_text('{"task_id": "a"}\n')
    with pytest.raises(eval_problems.EvalError, match="'completion'"):
        eval_sample.read_completions(f)


@needs_iverilog
def test_eval_cli_with_completions_file(tmp_path):
    tasks = ["Prob001_majority3", "Prob009_gray_next4", "Prob020_lfsr5"]
    comp = tmp_path / "completions.jsonl"
    rows = [{"task_id": t, "completion": fenced(as_top(BY_ID[t]))} for t in tasks[:2]]
    rows.append({"task_id": tasks[2], "completion": "sorry, no code"})
    comp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "results.jsonl"

    r = run_cli("eval", "--completions", comp, "--k", "1,5", "--out", out, "--tasks", ",".join(tasks),
                "--run-dir", tmp_path)
    assert r.returncode == 0, r.stderr
    assert "pass@1: 0.6667" in r.stdout  # two of three tasks answered with the reference
    assert "pass@5: n/a" in r.stdout
    def strict(c):
        raise ValueError(f"not standard JSON: {c}")

    saved = [json.loads(line, parse_constant=strict) for line in out.read_text().splitlines()]
    assert saved[0]["mismatches"] == 0 and isinstance(saved[0]["samples"], int) and saved[2]["samples"] is None
    assert [(s["task_id"], s["category"]) for s in saved] == [
        (tasks[0], "pass"), (tasks[1], "pass"), (tasks[2], "no_code")]

    r = run_cli("eval", "--completions", comp, "--out", out)
    assert r.returncode == 2 and "--overwrite" in r.stderr
    # a results file is a completions file too: re-score it
    r = run_cli("eval", "--completions", out, "--k", "1", "--out", out, "--overwrite", "--run-dir", tmp_path)
    assert r.returncode == 0 and "pass@1: 0.6667" in r.stdout, r.stderr


def test_eval_cli_bad_input(tmp_path):
    d = copy_problems(tmp_path / "p", ["Prob001_majority3"])
    (d / "Prob001_majority3_ref.sv").unlink()
    comp = tmp_path / "c.jsonl"
    comp.write_text('{"task_id": "Prob001_majority3", "completion": "x"}\n')
    rc = cli.main(["eval", "--problems", str(d), "--completions", str(comp)])
    assert rc == 2
    assert cli.main(["eval", "--completions", str(comp), "--k", "one"]) == 2
    assert cli.main(["eval", "--url", "http://127.0.0.1:9", "--k", "1"]) == 2  # --url without --model


# ---------------------------------------------------------------------------
# The simulator: which one, its version, VerilogEval's failure letters
# ---------------------------------------------------------------------------

def fake_iverilog(directory, version):
    """An `iverilog` that reports ``version`` for -V and otherwise runs the real one (with the real vvp beside it)."""
    real_iverilog, real_vvp = REAL_TOOLS
    directory.mkdir(parents=True, exist_ok=True)
    script = directory / "iverilog"
    script.write_text(f'#!/bin/sh\nif [ "$1" = "-V" ]; then echo "Icarus Verilog version {version} (stable) ()"; '
                      f'exit 0; fi\nexec "{real_iverilog}" "$@"\n')
    script.chmod(0o755)
    (directory / "vvp").symlink_to(real_vvp)
    return script


@needs_iverilog
def test_the_harness_uses_the_required_iverilog():
    # `make test` builds Icarus Verilog 12 (tools/build_iverilog.sh): VerilogEval v2 requires it.
    version = eval_simulate.simulator_version()
    assert version.split(".")[0] == eval_simulate.REQUIRED_IVERILOG, (
        f"the harness found Icarus Verilog {version} ({eval_simulate.simulator_tools()[0]}); run `make iverilog`")
    assert eval_simulate.version_warning(version) is None
    iverilog, vvp = eval_simulate.simulator_tools()
    assert Path(vvp).parent == Path(iverilog).parent  # one installation, not a mixed pair


@needs_iverilog
def test_version_check_warns_for_another_version(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", f"{fake_iverilog(tmp_path / 'bin11', '11.0').parent}{os.pathsep}{os.environ['PATH']}")
    assert eval_simulate.simulator_version() == "11.0"
    warning = eval_simulate.version_warning()
    assert warning.startswith("warning:") and "Icarus Verilog 11.0" in warning and "requires version 12" in warning
    assert "Icarus Verilog 12.0 from its source" in warning  # says how to fix it
    assert eval_simulate.version_warning("12.0") is None and "13.0" in eval_simulate.version_warning("13.0")
    # every printed score carries the version, and the warning with it
    results, _ = eval_score.score_completions([MAJ], [{"task_id": MAJ.task_id, "completion": fenced(as_top(MAJ))}],
                                      ks=(1,), progress=False)
    lines = eval_score.score_lines(results, (1,))
    assert lines[0] == "pass@1: 1.0000 [iverilog 11.0]" and lines[-1] == warning


@needs_iverilog
def test_the_course_passes_its_built_iverilog_to_the_fix(tmp_path, monkeypatch):
    """The fix takes the iverilog it is given, else the first on PATH; the course gives `make iverilog`'s build (or
    $GEMMA_TPU_IVERILOG's), and PATH's when there is neither. Nothing changes PATH."""
    monkeypatch.delenv(paths.IVERILOG_ENV, raising=False)
    monkeypatch.setenv(paths.TOOLS_ENV, str(tmp_path / "tools"))
    fake_iverilog(tmp_path / "tools" / "iverilog-12" / "bin", "12.0")
    other = fake_iverilog(tmp_path / "path-bin", "11.0")
    monkeypatch.setenv("PATH", f"{other.parent}:/usr/bin:/bin")
    assert eval_simulate.simulator_tools()[0] == str(other)  # the fix alone: PATH's
    built = tmp_path / "tools" / "iverilog-12" / "bin"
    assert eval_simulate.simulator_tools(paths.iverilog()) == (str(built / "iverilog"), str(built / "vvp"))
    assert eval_simulate.simulator_version(paths.iverilog()) == "12.0"
    assert os.environ["PATH"] == f"{other.parent}:/usr/bin:/bin"
    (built / "iverilog").unlink()  # no build: PATH's is used
    assert paths.iverilog() == str(other) and eval_simulate.simulator_version(paths.iverilog()) == "11.0"
    mine = fake_iverilog(tmp_path / "mine", "12.0")
    monkeypatch.setenv(paths.IVERILOG_ENV, str(mine))  # an explicit choice wins over both
    assert eval_simulate.simulator_tools(paths.iverilog())[0] == str(mine)


@pytest.mark.parametrize("log, code, letter", [
    ("sample.sv:3: syntax error\nI give up.\n", "", "S"),
    ("sample.sv:4: error: This assignment requires an explicit cast.\n1 error(s)\n", "", "e"),
    ("sample.sv:2: error: Sized numeric constant must have a size greater than zero.\n", "", "0"),
    ("sample.sv:5: warning: always_comb process has no sensitivities.\nMismatches: 0 in 20 samples\n", "", "n"),
    ("sample.sv:5: warning: @* found no sensitivities so it will never trigger.\n", "", "n"),
    ("sample.sv:6: error: q is not a valid l-value in tb.top_module1.\nsample.sv:2:      : q is declared here as "
     "wire.\n", "", "w"),
    ("test.sv:40: error: Unknown module type: TopModule\n", "", "m"),
    ("sample.sv:7: error: Unable to bind wire/reg/memory `count' in `tb.top_module1'\n", "", "p"),
    ("sample.sv:7: error: Unable to bind wire/reg/memory `clk' in `tb.top_module1'\n", "", "c"),
    ("Hint: Output 'q' has 3 mismatches.\nTIMEOUT\n", "", "T"),
    ("sample.sv:9: error: Port 3 (y) of TopModule is unconnected.\n", "", "C"),
    ("Hint: Total mismatched samples is 0 out of 40 samples\n\nSimulation finished at 200 ps\n"
     "Mismatches: 0 in 40 samples\n", "", "."),
    ("Mismatches: 0 in 0 samples\n", "", "."),  # the official analyzer does not check M
    ("Mismatches: 3 in 40 samples\n", "always @(posedge clk, posedge reset)", "r"),
    ("Mismatches: 3 in 40 samples\n", "always @(posedge clk)", "R"),
    ("", None, "R"),
    # the first decisive line wins; the flags only decide when none is there
    ("a.sv:1: error: Unable to bind wire/reg/memory `x'\nb.sv:2: syntax error\n", "", "S"),
    ("a.sv:1: error: Unable to bind wire/reg/memory `x'\nb.sv:2: error: something else\n", "", "p"),
    ("Mismatches: 0 in 10 samples\nTIMEOUT\n", "", "T"),
])
def test_official_letter_rules(log, code, letter):
    assert eval_simulate.official_letter(log, code) == letter
    assert letter in eval_simulate.OFFICIAL_LETTERS


@needs_iverilog
def test_official_letters_beside_our_categories():
    cases = [(as_top(MAJ), "pass", "."), (MAJ_SYNTAX, "compile_error", "S"), (MAJ_WRONG_NAME, "compile_error", "m"),
             (MAJ_AND, "mismatch", "R"), (MAJ_HANG, "timeout", "T"), (MAJ_EARLY_FINISH, "runtime_error", "R"),
             (None, "no_code", "m")]
    for code, category, letter in cases:
        r = eval_simulate.simulate(code, MAJ, timeout=2)
        assert (r.category, r.official) == (category, letter), code
        assert r.as_dict()["official"] == letter
    # per task, in sample order and in groups of five, as VerilogEval's analyzer prints a row
    rows = [{"task_id": MAJ.task_id, "completion": fenced(c) if c else "none"} for c, _, _ in cases]
    results, _ = eval_score.score_completions([MAJ], rows, ks=(1,), timeout=2, progress=False)
    assert eval_views.results_table(results, (1,)).loc[0, "official"] == ".SmRT Rm"


# ---------------------------------------------------------------------------
# Calibration: the toolchain's ceiling
# ---------------------------------------------------------------------------

# A testbench in VerilogEval's style whose own time limit fires: it waits for a `done` the reference never raises.
WAIT_TB = """module tb();
  reg clk = 0; always #5 clk = ~clk;
  wire done_ref, done_dut;
  RefModule good1(.clk(clk), .done(done_ref));
  TopModule top_module1(.clk(clk), .done(done_dut));
  initial begin
    wait (done_ref);
    $display("Mismatches: 0 in 1 samples");
    $finish;
  end
  initial begin #1000 $display("TIMEOUT"); $finish(); end
endmodule
"""
WAIT_REF = "module RefModule(input clk, output done);\n  assign done = 1'b0;\nendmodule\n"
# A reference with a construct Icarus Verilog 11 and 12 do not support ("sorry: Streaming concatenation not
# supported"), as VerilogEval's Prob151 has a cast that 11 does not support.
UNSUPPORTED_REF = MAJ.ref.replace("endmodule", "  wire [3:0] unused = {<<{a, b, c, a}};\nendmodule")


def broken_problem_set(directory):
    """Two shipped problems, one whose reference times out, one whose reference does not compile here."""
    copy_problems(directory, ["Prob001_majority3", "Prob002_mux3_8bit"])
    for task, ref, test in [("Prob901_waits_forever", WAIT_REF, WAIT_TB),
                            ("Prob902_unsupported", UNSUPPORTED_REF, MAJ.test)]:
        (directory / f"{task}_prompt.txt").write_text("Implement module TopModule.\n")
        (directory / f"{task}_ref.sv").write_text(ref)
        (directory / f"{task}_test.sv").write_text(test)
    return directory


@needs_iverilog
def test_calibration_of_the_shipped_problems_passes_every_reference(tmp_path, monkeypatch):
    cal = eval_score.calibrate(PROBLEMS, cache_dir=tmp_path, progress=False)
    assert cal.excluded == [] and cal.calibrated == sorted(BY_ID) and cal.ceiling() == 1.0
    assert cal.simulator == eval_simulate.simulator_version() and cal.digest == eval_problems.problems_digest(PROBLEMS)
    assert cal.path == tmp_path / f"calibration-{cal.digest[:16]}-iverilog-{cal.simulator}.json"
    assert {r["official"] for r in cal.references.values()} == {"."}
    assert "28 of 28 references pass" in cal.summary() and cal.table().empty
    assert [p.name for p in tmp_path.iterdir()] == [cal.path.name]  # atomic write: no temp file left

    # cached per (problems, simulator version): the second call simulates nothing, refresh=True does
    calls = []
    real_simulate = eval_simulate.simulate
    monkeypatch.setattr(eval_score, "simulate", lambda *a, **kw: calls.append(a) or real_simulate(*a, **kw))
    assert eval_score.calibrate(PROBLEMS, cache_dir=tmp_path, progress=False) == cal and calls == []
    assert eval_score.find_calibration(PROBLEMS[:3], tmp_path) == cal  # it covers any subset
    changed = [dataclasses.replace(PROBLEMS[0], test=PROBLEMS[0].test + "\n// edited\n")]
    assert eval_score.find_calibration(changed, tmp_path) is None  # an edited testbench is not calibrated
    eval_score.calibrate(PROBLEMS[:2], cache_dir=tmp_path, refresh=True, progress=False)
    assert len(calls) == 2


@needs_iverilog
def test_a_broken_reference_lowers_the_ceiling_not_the_model_score(tmp_path):
    problems = eval_problems.load_problems(broken_problem_set(tmp_path / "probs"))
    cal = eval_score.calibrate(problems, cache_dir=tmp_path / "eval", timeout=10, progress=False)
    assert cal.calibrated == ["Prob001_majority3", "Prob002_mux3_8bit"]
    assert cal.excluded == ["Prob901_waits_forever", "Prob902_unsupported"]
    refs = cal.references
    assert (refs["Prob901_waits_forever"]["category"], refs["Prob901_waits_forever"]["official"]) == ("timeout", "T")
    assert refs["Prob902_unsupported"]["category"] == "compile_error"
    assert "sorry: Streaming concatenation not supported" in refs["Prob902_unsupported"]["detail"]
    assert refs["Prob902_unsupported"]["official"] == "R"  # no "error" in the log: VerilogEval calls it a runtime one
    assert cal.ceiling() == 0.5
    assert list(cal.table()["task_id"]) == cal.excluded

    # a model that answers every problem with the reference: perfect on the calibrated set
    rows = [{"task_id": p.task_id, "completion": fenced(eval_problems.reference_code(p))} for p in problems]
    results, scores = eval_score.score_completions(problems, rows, ks=(1,), timeout=10, progress=False)
    assert scores == {1: 0.5}
    lines = eval_score.score_lines(results, (1,), cal)
    version = eval_simulate.simulator_version()
    assert lines[0] == f"pass@1: 0.5000 (ceiling 0.5000; 1.0000 over the 2 calibrated problems) [iverilog {version}]"
    assert lines[1] == (f"not counted over the calibrated set (their reference fails with iverilog {version}): "
                        "Prob901_waits_forever (timeout), Prob902_unsupported (compile_error)")


@needs_iverilog
def test_eval_cli_calibrate_then_score(tmp_path):
    probs = broken_problem_set(tmp_path / "probs")
    run_dir = tmp_path / "run"
    r = run_cli("eval", "--calibrate", "--problems", probs, "--run-dir", run_dir, "--timeout", 10)
    assert r.returncode == 0, r.stderr
    version = eval_simulate.simulator_version()
    assert f"simulator: Icarus Verilog {version}" in r.stdout
    assert "2 of 4 references pass" in r.stdout and "Prob901_waits_forever: timeout [T]" in r.stdout
    cached = list((run_dir / "eval").glob("calibration-*.json"))
    assert len(cached) == 1 and f"cached in {cached[0]}" in r.stdout

    comp = tmp_path / "c.jsonl"
    answers = {"Prob001_majority3": fenced(as_top(MAJ)), "Prob002_mux3_8bit": "no idea",
               "Prob901_waits_forever": "no idea", "Prob902_unsupported": fenced(as_top(MAJ))}
    comp.write_text("".join(json.dumps({"task_id": t, "completion": c}) + "\n" for t, c in answers.items()))
    r = run_cli("eval", "--completions", comp, "--problems", probs, "--run-dir", run_dir, "--k", "1",
                "--timeout", 10)
    assert r.returncode == 0, r.stderr
    assert f"pass@1: 0.2500 (ceiling 0.5000; 0.5000 over the 2 calibrated problems) [iverilog {version}]" in r.stdout
    assert "official letters: .=1 m=2 R=1" in r.stdout
    # without a calibration for these problems: the raw score, and how to get one
    r = run_cli("eval", "--completions", comp, "--problems", probs, "--run-dir", tmp_path / "other", "--k", "1",
                "--timeout", 10)
    assert r.returncode == 0 and f"pass@1: 0.2500 [iverilog {version}]" in r.stdout
    assert "run `eval --calibrate --problems" in r.stdout


# ---------------------------------------------------------------------------
# The official protocol as presets
# ---------------------------------------------------------------------------

def test_presets_are_the_official_protocol():
    # top_k 0 is vLLM's "no top-k": unset, vLLM would take the checkpoint's generation_config (Gemma 4: top_k 64)
    assert eval_sample.PRESETS == {"official-greedy": {"n": 1, "temperature": 0.0, "top_p": 0.01, "top_k": 0},
                          "official-sampled": {"n": 20, "temperature": 0.85, "top_p": 0.95, "top_k": 0}}

    def args(**kw):
        return argparse.Namespace(**{"preset": None, "n": None, "temperature": None, "top_p": None,
                                     "top_k": None, **kw})

    assert commands_serve.sampling_settings(args()) == {"n": 1, "temperature": 0.0, "top_p": 1.0, "top_k": 0}
    assert commands_serve.sampling_settings(args(preset="official-sampled")) == eval_sample.PRESETS["official-sampled"]
    assert (commands_serve.sampling_settings(args(preset="official-sampled", n=20, top_k=0))
            == eval_sample.PRESETS["official-sampled"])
    assert (commands_serve.sampling_settings(args(n=5, temperature=0.8, top_p=0.95))
            == {"n": 5, "temperature": 0.8, "top_p": 0.95, "top_k": 0})
    assert commands_serve.sampling_settings(args(temperature=0.8, top_k=40))["top_k"] == 40
    with pytest.raises(eval_problems.EvalError,
                       match="--preset official-greedy sets --temperature 0.0; drop --temperature 0.8"):
        commands_serve.sampling_settings(args(preset="official-greedy", temperature=0.8))
    with pytest.raises(eval_problems.EvalError, match="--preset official-sampled sets --top-k 0; drop --top-k 64"):
        commands_serve.sampling_settings(args(preset="official-sampled", top_k=64))


@needs_iverilog
@pytest.mark.parametrize("flags, expected", [
    ([], {"n": 1, "temperature": 0.0, "top_p": 1.0, "top_k": 0}),  # greedy: no nucleus, no top-k
    (["--preset", "official-greedy"], {"n": 1, "temperature": 0.0, "top_p": 0.01, "top_k": 0}),
    (["--preset", "official-sampled"], {"n": 20, "temperature": 0.85, "top_p": 0.95, "top_k": 0}),
    (["--temperature", "0.8", "--top-k", "40"], {"n": 1, "temperature": 0.8, "top_p": 1.0, "top_k": 40}),
    (["--temperature", "0.8"], {"n": 1, "temperature": 0.8, "top_p": 1.0, "top_k": 0}),  # not the checkpoint's 0.95
])
def test_eval_requests_carry_the_whole_sampling(fake_server, tmp_path, flags, expected):
    """What reaches the server: temperature, top_p and top_k, always (an unset one would be the checkpoint's
    generation_config's, e.g. top_p 0.95), and the results file records the three."""
    srv = fake_server()
    out = tmp_path / "results.jsonl"
    rc = cli.main(["eval", "--url", srv.url, "--model", "gemma-verilog", "--tasks", MAJ.task_id,
                   "--run-dir", str(tmp_path), "--out", str(out), *flags])
    assert rc == 0
    assert [{key: req.get(key, "absent") for key in expected} for req in srv.requests] == [expected]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert {(r["temperature"], r["top_p"], r["top_k"]) for r in rows} == {
        (expected["temperature"], expected["top_p"], expected["top_k"])}


@needs_iverilog
def test_eval_cli_top_k_may_not_contradict_a_preset(fake_server, tmp_path, capsys):
    srv = fake_server()
    rc = cli.main(["eval", "--url", srv.url, "--model", "gemma-verilog", "--preset", "official-sampled",
                  "--top-k", "64", "--tasks", MAJ.task_id, "--run-dir", str(tmp_path)])
    assert rc == 2 and ("--preset official-sampled sets --top-k 0; drop --top-k 64 or the preset"
                        in capsys.readouterr().err)
    assert srv.requests == []


@needs_iverilog
def test_eval_cli_preset_sends_the_official_sampling(fake_server, tmp_path):
    srv = fake_server()
    r = run_cli("eval", "--url", srv.url, "--model", "gemma-verilog", "--preset", "official-sampled",
                "--tasks", MAJ.task_id, "--run-dir", tmp_path)
    assert r.returncode == 0, r.stderr
    req = srv.requests[0]
    assert (req["n"], req["temperature"], req["top_p"], req["top_k"]) == (20, 0.85, 0.95, 0)
    assert "scored 20 samples" in r.stdout and "pass@1: 1.0000" in r.stdout and "pass@5" not in r.stdout
    r = run_cli("eval", "--url", srv.url, "--model", "gemma-verilog", "--preset", "official-greedy", "--n", "5",
                "--tasks", MAJ.task_id, "--run-dir", tmp_path)
    assert r.returncode == 2 and "drop --n 5 or the preset" in r.stderr
