"""Checks on the shipped Verilog data (gemma_tpu_helpers/data).

- the SFT rows follow the CodeV-R1 schema and every Verilog answer compiles;
- every eval problem's reference passes its own testbench with the official
  VerilogEval command, and deliberately broken samples fail it;
- tools/make_verilog_data.py reproduces the shipped files byte for byte.

The iverilog checks are skipped only when iverilog is not installed.
"""

import json
import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from support import REPO

ROOT = REPO
DATA = ROOT / "gemma_tpu_helpers" / "data"
SFT = DATA / "verilog_sft.jsonl"
EVAL = DATA / "eval"
GENERATOR = ROOT / "tools" / "make_verilog_data.py"

OFFICIAL_FLAGS = ["-Wall", "-Winfloop", "-Wno-timescale", "-g2012", "-s", "tb"]
FENCE = re.compile(r"```verilog\n(.*?)\n```", re.S)
MISMATCHES = re.compile(r"Mismatches: (\d+) in (\d+) samples")
PORT_LINE = re.compile(r"^ - (input|output)\s+(\w+)(?: \((\d+) bits\))?$", re.M)
WORKERS = max(2, os.cpu_count() or 2)

needs_iverilog = pytest.mark.skipif(
    shutil.which("iverilog") is None, reason="install iverilog: apt-get install iverilog"
)


def load_rows():
    with open(SFT, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def task_ids():
    return sorted(p.name[: -len("_prompt.txt")] for p in EVAL.glob("*_prompt.txt"))


def parallel(fn, items):
    with ThreadPoolExecutor(max_workers=WORKERS) as pool:
        return list(pool.map(fn, items))


def run(cmd, cwd, timeout=60):
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout)


# ---------------------------------------------------------------------------
# SFT rows
# ---------------------------------------------------------------------------

def test_sft_rows_follow_schema():
    rows = load_rows()
    assert len(rows) >= 200
    ids = [r["id"] for r in rows]
    assert len(set(ids)) == len(ids), "duplicate ids"
    assert len({r["prompt"] for r in rows}) == len(rows), "duplicate prompts"
    families = {r["family"] for r in rows}
    assert len(families) >= 12, families
    for r in rows:
        assert list(r) == ["id", "family", "system", "prompt", "response"], r["id"]  # the real SFT columns + ours
        assert r["system"].strip() and r["prompt"].strip() and r["response"].strip(), r["id"]
        assert r["response"].count("```verilog\n") == 1, r["id"]
        assert r["response"].count("```") == 2, r["id"]
        assert len(r["response"]) <= 1500, r["id"]
        code = FENCE.search(r["response"]).group(1)
        name = re.match(r"module (\w+)", code)
        assert name and f"`{name.group(1)}`" in r["prompt"], r["id"]
        assert code.count("module ") == 1 and code.rstrip().endswith("endmodule"), r["id"]


def test_sft_responses_have_the_real_r1_form():
    """<think>reasoning</think> then <answer>prose + fence</answer>; every tenth row lacks the <answer> tags."""
    rows = load_rows()
    for i, r in enumerate(rows, start=1):
        assert r["response"].startswith("<think>\n") and r["response"].count("</think>") == 1, r["id"]
        head, tail = r["response"].split("</think>", 1)
        assert len(head) > 20 and "```verilog" in tail and "<think>" not in tail, r["id"]
        if i % 10:
            assert tail.startswith("\n<answer>\n") and tail.endswith("```\n</answer>"), r["id"]
            assert not tail.split("<answer>\n", 1)[1].startswith("```"), f"{r['id']}: prose before the fence"
        else:
            assert "<answer>" not in tail, r["id"]
    assert sum("<answer>" in r["response"] for r in rows) == len(rows) - len(rows) // 10
    assert len({r["system"] for r in rows}) == 1


def test_replica_holds_the_same_sft_rows_and_the_declared_configs():
    replica = DATA / "codev_r1_replica"
    assert (replica / "codev_r1_sft.jsonl").read_bytes() == SFT.read_bytes()
    header = (replica / "README.md").read_text().split("---")[1]
    for line in ("config_name: sft", "path: codev_r1_sft.jsonl", "config_name: rl", "split: validation",
                 "path: codev_r1_rl_train.parquet", "path: codev_r1_rl_val.parquet"):
        assert line in header, line
    assert "default" not in header  # no default config, as in the real repository


@needs_iverilog
def test_sft_verilog_compiles(tmp_path):
    rows = load_rows()

    def compile_row(i):
        src = tmp_path / f"row{i}.v"
        src.write_text(FENCE.search(rows[i]["response"]).group(1) + "\n")
        res = run(["iverilog", "-g2012", "-Wall", "-o", f"row{i}.vvp", src.name], tmp_path)
        return rows[i]["id"], res.returncode, res.stdout + res.stderr

    results = parallel(compile_row, range(len(rows)))
    failed = [f"{rid}: {out}" for rid, rc, out in results if rc != 0]
    assert not failed, "\n".join(failed[:10])
    warned = [f"{rid}: {out}" for rid, rc, out in results if out.strip()]
    assert not warned, "\n".join(warned[:10])


# ---------------------------------------------------------------------------
# Eval problems
# ---------------------------------------------------------------------------

def test_eval_problems_are_complete():
    tasks = task_ids()
    assert len(tasks) >= 20
    for t in tasks:
        assert re.fullmatch(r"Prob\d{3}_\w+", t), t
        prompt = (EVAL / f"{t}_prompt.txt").read_text()
        ref = (EVAL / f"{t}_ref.sv").read_text()
        test = (EVAL / f"{t}_test.sv").read_text()
        assert "module named TopModule" in prompt and PORT_LINE.search(prompt), t
        assert "module RefModule" in ref, t
        assert "module tb()" in test and "RefModule good1" in test, t
        assert "TopModule top_module1" in test, t
        assert '$display("Mismatches: %1d in %1d samples", errors, samples);' in test, t
        assert "TIMEOUT" in test, t
    with open(EVAL / "problems.jsonl") as f:
        listed = [json.loads(line) for line in f]
    assert sorted(p["task_id"] for p in listed) == tasks
    assert all(p["description"].strip() for p in listed)
    kinds = {p["kind"] for p in listed}
    assert kinds == {"combinational", "sequential"}


def prompt_ports(task):
    """(direction, name, width) for every port listed in the problem's prompt."""
    prompt = (EVAL / f"{task}_prompt.txt").read_text()
    return [(d, n, int(w or 1)) for d, n, w in PORT_LINE.findall(prompt)]


def wrapped_reference(task, change):
    """A TopModule with the prompt's ports that instantiates RefModule and drives each output
    with change(name, width, good) instead of the reference's value `good`."""
    ports = prompt_ports(task)
    decls = [f"    {d} {f'[{w - 1}:0] ' if w > 1 else ''}{n}" for d, n, w in ports]
    body, conns = [], []
    for d, n, w in ports:
        if d == "output":
            body.append(f"    wire {f'[{w - 1}:0] ' if w > 1 else ''}{n}_good;")
            body.append(f"    assign {n} = {change(n, w, n + '_good')};")
            conns.append(f".{n}({n}_good)")
        else:
            conns.append(f".{n}({n})")
    body.append(f"    RefModule good ({', '.join(conns)});")
    return "module TopModule (\n" + ",\n".join(decls) + "\n);\n" + "\n".join(body) + "\nendmodule\n"


BROKEN = {
    "zero": lambda n, w, good: "0",
    "inverted": lambda n, w, good: f"~{good}",
}


def stuck_at(port, bit, value):
    """Output `port` bit `bit` stuck at `value`; every other output is correct."""
    def change(n, w, good):
        if n != port:
            return good
        return f"{good} | {w}'d{1 << bit}" if value else f"{good} & ~{w}'d{1 << bit}"
    return change


def run_official(task, sample_text, workdir):
    """Compile and simulate like the VerilogEval harness; returns (compiled, mismatches, samples, output)."""
    workdir.mkdir()
    (workdir / "sample.sv").write_text(sample_text)
    shutil.copy(EVAL / f"{task}_test.sv", workdir / "test.sv")
    shutil.copy(EVAL / f"{task}_ref.sv", workdir / "ref.sv")
    comp = run(["iverilog", *OFFICIAL_FLAGS, "-o", "bin", "sample.sv", "test.sv", "ref.sv"], workdir)
    if comp.returncode != 0:
        return False, None, None, comp.stdout + comp.stderr
    sim = run(["vvp", "bin"], workdir)
    out = comp.stdout + comp.stderr + sim.stdout + sim.stderr
    found = MISMATCHES.search(sim.stdout)
    if not found or "TIMEOUT" in sim.stdout:
        return True, None, None, out
    return True, int(found.group(1)), int(found.group(2)), out


@needs_iverilog
def test_eval_references_pass_their_testbenches(tmp_path):
    def check(task):
        sample = (EVAL / f"{task}_ref.sv").read_text().replace("module RefModule", "module TopModule")
        compiled, bad, total, out = run_official(task, sample, tmp_path / task)
        ok = compiled and bad == 0 and total and total > 0
        return task, ok, out

    failed = [f"{t}: {out}" for t, ok, out in parallel(check, task_ids()) if not ok]
    assert not failed, "\n".join(failed)


def assert_all_caught(jobs, tmp_path):
    """jobs: (task, label, change). Each wrong sample must fail its problem's testbench."""
    def check(job):
        task, label, change = job
        compiled, bad, total, out = run_official(task, wrapped_reference(task, change),
                                                 tmp_path / f"{task}_{label}")
        caught = (not compiled) or bad is None or bad > 0
        return f"{task} ({label})", caught, out

    missed = [f"{name}: {out}" for name, caught, out in parallel(check, jobs) if not caught]
    assert not missed, "wrong samples that passed:\n" + "\n".join(missed)


@needs_iverilog
def test_eval_broken_samples_fail(tmp_path):
    jobs = [(t, how, change) for t in task_ids() for how, change in BROKEN.items()]
    assert_all_caught(jobs, tmp_path)


@needs_iverilog
def test_eval_testbenches_see_every_output_bit_stuck(tmp_path):
    """Every output bit is driven both ways, so a single stuck bit is always detected."""
    jobs = [(t, f"{n}{b}_sa{v}", stuck_at(n, b, v))
            for t in task_ids() for d, n, w in prompt_ports(t) if d == "output"
            for b in range(w) for v in (0, 1)]
    assert_all_caught(jobs, tmp_path)


# ---------------------------------------------------------------------------
# Independent solutions: written from each prompt alone, in a different style
# from the reference. If a reference or a prompt drifts, these stop passing.
# ---------------------------------------------------------------------------

INDEPENDENT_SOLUTIONS = {
    "Prob001_majority3": """
module TopModule(input a, input b, input c, output y);
  assign y = (a + b + c) >= 2;
endmodule
""",
    "Prob002_mux3_8bit": """
module TopModule(input [7:0] a, input [7:0] b, input [7:0] c, input [1:0] sel, output [7:0] out);
  assign out = sel == 0 ? a : sel == 1 ? b : sel == 2 ? c : 0;
endmodule
""",
    "Prob003_sat_add8": """
module TopModule(input [7:0] a, input [7:0] b, output [7:0] sum, output overflow);
  assign overflow = (a + b) > 255;
  assign sum = overflow ? 255 : a + b;
endmodule
""",
    "Prob004_abs_diff6": """
module TopModule(input [5:0] a, input [5:0] b, output [5:0] diff, output b_larger);
  wire signed [7:0] d = $signed({2'b0, a}) - $signed({2'b0, b});
  assign diff = d < 0 ? -d : d;
  assign b_larger = d < 0;
endmodule
""",
    "Prob005_leading_zeros8": """
module TopModule(input [7:0] in, output reg [3:0] zeros);
  always @(*) casez (in)
    8'b1???????: zeros = 0; 8'b01??????: zeros = 1; 8'b001?????: zeros = 2; 8'b0001????: zeros = 3;
    8'b00001???: zeros = 4; 8'b000001??: zeros = 5; 8'b0000001?: zeros = 6; 8'b00000001: zeros = 7;
    default: zeros = 8;
  endcase
endmodule
""",
    "Prob006_lowest_set_bit6": """
module TopModule(input [5:0] in, output [2:0] pos, output [5:0] mask, output valid);
  assign valid = in != 0;
  assign pos = in[0] ? 0 : in[1] ? 1 : in[2] ? 2 : in[3] ? 3 : in[4] ? 4 : in[5] ? 5 : 0;
  assign mask = valid ? (6'd1 << pos) : 0;
endmodule
""",
    "Prob007_bcd_digit_inc": """
module TopModule(input [3:0] d, input inc, output [3:0] q, output carry);
  wire valid = d < 10;
  assign carry = valid && inc && d == 9;
  assign q = !valid ? 0 : !inc ? d : (d == 9 ? 0 : d + 1);
endmodule
""",
    "Prob008_bit_reverse10": """
module TopModule(input [9:0] in, output [9:0] out, output palindrome);
  genvar i;
  generate for (i = 0; i < 10; i = i + 1) begin : g
    assign out[i] = in[9-i];
  end endgenerate
  assign palindrome = in[0]==in[9] && in[1]==in[8] && in[2]==in[7] && in[3]==in[6] && in[4]==in[5];
endmodule
""",
    "Prob009_gray_next4": """
module TopModule(input [3:0] g, output reg [3:0] next);
  integer i;
  reg [3:0] b;
  always @(*) begin
    b[3] = g[3];
    for (i = 2; i >= 0; i = i - 1) b[i] = b[i+1] ^ g[i];
    b = b + 1;
    next = {b[3], b[3]^b[2], b[2]^b[1], b[1]^b[0]};
  end
endmodule
""",
    "Prob010_min3_u8": """
module TopModule(input [7:0] a, input [7:0] b, input [7:0] c, output [7:0] min_val, output [1:0] idx);
  assign idx = (a <= b && a <= c) ? 0 : (b <= c) ? 1 : 2;
  assign min_val = idx == 0 ? a : idx == 1 ? b : c;
endmodule
""",
    "Prob011_hex_to_7seg_n": """
module TopModule(input [3:0] hex, output [6:0] seg_n);
  // segments: a=0 .. g=6; lit when 0
  reg [6:0] on;
  always @(*) case (hex)
    0: on = 7'b0111111; 1: on = 7'b0000110; 2: on = 7'b1011011; 3: on = 7'b1001111;
    4: on = 7'b1100110; 5: on = 7'b1101101; 6: on = 7'b1111101; 7: on = 7'b0000111;
    8: on = 7'b1111111; 9: on = 7'b1101111; 10: on = 7'b1110111; 11: on = 7'b1111100;
    12: on = 7'b0111001; 13: on = 7'b1011110; 14: on = 7'b1111001; default: on = 7'b1110001;
  endcase
  assign seg_n = ~on;
endmodule
""",
    "Prob012_onehot_check8": """
module TopModule(input [7:0] in, output zero, output onehot, output multi);
  wire [3:0] n = in[0]+in[1]+in[2]+in[3]+in[4]+in[5]+in[6]+in[7];
  assign zero = n == 0; assign onehot = n == 1; assign multi = n >= 2;
endmodule
""",
    "Prob013_rotate8_dir": """
module TopModule(input [7:0] data, input [2:0] amt, input left, output reg [7:0] out);
  integer i;
  always @(*) begin
    out = data;
    for (i = 0; i < amt; i = i + 1) out = left ? {out[6:0], out[7]} : {out[0], out[7:1]};
  end
endmodule
""",
    "Prob014_alu4_flags": """
module TopModule(input [3:0] a, input [3:0] b, input [1:0] op, output [3:0] y, output zero, output carry);
  wire [4:0] s = a + b;
  assign y = op == 0 ? s[3:0] : op == 1 ? a - b : op == 2 ? a & b : a ^ b;
  assign carry = op == 0 ? s[4] : op == 1 ? (a < b) : 0;
  assign zero = ~|y;
endmodule
""",
    "Prob015_count_3_to_12": """
module TopModule(input clk, input reset, input en, output reg [3:0] q);
  always @(posedge clk)
    if (reset) q <= 3;
    else if (en) begin if (q == 12) q <= 3; else q <= q + 1; end
endmodule
""",
    "Prob016_updown_sat4": """
module TopModule(input clk, input areset_n, input up, input down, output reg [3:0] q);
  always @(posedge clk, negedge areset_n)
    if (!areset_n) q <= 0;
    else case ({up, down})
      2'b10: if (q != 15) q <= q + 1;
      2'b01: if (q != 0) q <= q - 1;
      default: q <= q;
    endcase
endmodule
""",
    "Prob017_detect_0110": """
module TopModule(input clk, input reset, input in, output z);
  reg [3:0] h; reg [2:0] n;
  always @(posedge clk)
    if (reset) begin h <= 0; n <= 0; end
    else begin h <= {h[2:0], in}; if (n < 4) n <= n + 1; end
  assign z = (n == 4) && (h == 4'b0110);
endmodule
""",
    "Prob018_rise_counter": """
module TopModule(input clk, input reset, input sig, output rise, output reg [5:0] count);
  reg p;
  always @(posedge clk) begin
    p <= reset ? 0 : sig;
    count <= reset ? 0 : count + (sig & ~p);
  end
  assign rise = sig && !p;
endmodule
""",
    "Prob019_debounce3": """
module TopModule(input clk, input reset, input noisy, output reg clean);
  reg [1:0] n;
  always @(posedge clk)
    if (reset) begin clean <= 0; n <= 0; end
    else if (noisy != clean) begin
      if (n == 2) begin clean <= ~clean; n <= 0; end else n <= n + 1;
    end else n <= 0;
endmodule
""",
    "Prob020_lfsr5": """
module TopModule(input clk, input reset, input en, output reg [4:0] q);
  always @(posedge clk)
    if (reset) q <= 1;
    else if (en) begin q[4:1] <= q[3:0]; q[0] <= q[4] ^ q[2]; end
endmodule
""",
    "Prob021_pulse_stretch4": """
module TopModule(input clk, input reset, input trig, output busy);
  reg [3:0] sh;
  always @(posedge clk)
    if (reset) sh <= 0;
    else if (trig) sh <= 4'b1111;
    else sh <= sh >> 1;
  assign busy = |sh;
endmodule
""",
    "Prob022_serial_adder": """
module TopModule(input clk, input reset, input a, input b, output s, output reg c);
  wire [1:0] t = a + b + c;
  assign s = t[0];
  always @(posedge clk) c <= reset ? 0 : t[1];
endmodule
""",
    "Prob023_ones_run_length": """
module TopModule(input clk, input reset, input in, output reg [3:0] run);
  always @(posedge clk)
    if (reset) run <= 0;
    else if (in) run <= (run == 15) ? 15 : run + 1;
    else run <= 0;
endmodule
""",
    "Prob024_fifo4x8": """
module TopModule(input clk, input reset, input push, input pop, input [7:0] din,
                 output [7:0] dout, output [2:0] count, output full, output empty);
  // shift-register style FIFO: slot 0 is the oldest
  reg [7:0] s0, s1, s2, s3; reg [2:0] n;
  wire p = push && n != 4; wire q = pop && n != 0;
  wire [2:0] wpos = q ? n - 1 : n;   // position the new byte lands in after the pop shift
  always @(posedge clk)
    if (reset) n <= 0;
    else begin
      if (q) begin s0 <= s1; s1 <= s2; s2 <= s3; end
      if (p) case (wpos) 0: s0 <= din; 1: s1 <= din; 2: s2 <= din; default: s3 <= din; endcase
      n <= n + p - q;
    end
  assign count = n; assign full = n == 4; assign empty = n == 0;
  assign dout = empty ? 0 : s0;
endmodule
""",
    "Prob025_tick_div5": """
module TopModule(input clk, input reset, input en, output tick);
  reg [4:0] oh;  // one-hot ring
  always @(posedge clk)
    if (reset) oh <= 5'b00001;
    else if (en) oh <= {oh[3:0], oh[4]};
  assign tick = oh[4];
endmodule
""",
    "Prob026_regfile4x8_r0zero": """
module TopModule(input clk, input reset, input we, input [1:0] waddr, input [7:0] wdata,
                 input [1:0] raddr0, input [1:0] raddr1, output [7:0] rdata0, output [7:0] rdata1);
  reg [7:0] r [0:3];
  integer i;
  always @(posedge clk)
    if (reset) for (i = 0; i < 4; i = i + 1) r[i] <= 0;
    else if (we && waddr != 0) r[waddr] <= wdata;
  assign rdata0 = raddr0 == 0 ? 0 : r[raddr0];
  assign rdata1 = raddr1 == 0 ? 0 : r[raddr1];
endmodule
""",
    "Prob027_running_parity": """
module TopModule(input clk, input reset, input clear, input in, output reg odd);
  always @(posedge clk) odd <= (reset | clear) ? 1'b0 : (in ? ~odd : odd);
endmodule
""",
    "Prob028_load_down_timer": """
module TopModule(input clk, input reset, input load, input [5:0] value, output reg [5:0] count, output done);
  assign done = ~|count;
  always @(posedge clk)
    if (reset) count <= 0;
    else if (load) count <= value;
    else if (!done) count <= count - 1;
endmodule
""",
}


@needs_iverilog
def test_eval_references_agree_with_independent_solutions(tmp_path):
    assert sorted(INDEPENDENT_SOLUTIONS) == task_ids()

    def check(task):
        compiled, bad, total, out = run_official(task, INDEPENDENT_SOLUTIONS[task],
                                                 tmp_path / f"{task}_independent")
        return task, compiled and bad == 0 and total > 0, out

    failed = [f"{t}: {out}" for t, ok, out in parallel(check, task_ids()) if not ok]
    assert not failed, "\n".join(failed)


# ---------------------------------------------------------------------------
# Generator
# ---------------------------------------------------------------------------

def file_content(path):
    """Bytes, or the rows of a parquet file (pyarrow writes its own version into the file's metadata)."""
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    return path.read_bytes()


def generated_files(root):
    return {str(p.relative_to(root)): file_content(p) for p in sorted(root.rglob("*")) if p.is_file()}


def test_generator_is_deterministic_and_matches_shipped_files(tmp_path):
    outputs = []
    for name in ("first", "second"):
        out = tmp_path / name
        subprocess.run([sys.executable, str(GENERATOR), "--out", str(out)], check=True,
                       capture_output=True, timeout=120)
        outputs.append(generated_files(out))
    assert outputs[0] == outputs[1], "two runs of the generator differ"
    shipped = DATA
    for rel, content in outputs[0].items():
        assert (shipped / rel).is_file(), f"{rel} is generated but not shipped"
        assert file_content(shipped / rel) == content, f"{rel} differs from the generator output"
    stale = {str(p.relative_to(shipped)) for p in shipped.rglob("*") if p.is_file()
             and p.parent.name in ("eval", "codev_r1_replica")} - set(outputs[0])
    assert not stale, f"shipped eval files the generator does not write: {sorted(stale)}"
