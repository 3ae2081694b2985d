#!/usr/bin/env python3
"""Generate the small, self-written Verilog data shipped with gemma_tpu_helpers.

Everything here is produced from hand-written, parameterised templates (no
third-party dataset is copied). The output is byte-for-byte deterministic.

Writes, under --out (default: gemma_tpu_helpers/data next to this repo):

  verilog_sft.jsonl     instruction/response pairs in the CodeV-R1 SFT schema
                        ("system", "prompt", "response") plus "id" and "family"
  codev_r1_replica/     a replica of the zhuyaoyu/CodeV-R1-dataset repository layout:
                        codev_r1_sft.jsonl (the same rows), codev_r1_rl_train.parquet and
                        codev_r1_rl_val.parquet (RL rows in the verl schema) and a README.md
                        whose YAML header declares the `sft` and `rl` configs
  eval/<task>_prompt.txt, eval/<task>_ref.sv, eval/<task>_test.sv
                        held-out spec-to-RTL problems in the VerilogEval v2 form
  eval/problems.jsonl   one line per eval problem: task_id, kind, description
  README.md             what the files are

Usage:  python tools/make_verilog_data.py [--out DIR]
The standard library writes everything but the two RL parquet files, which need pyarrow
(installed with `datasets` in the training venv).
"""

import argparse
import json
import random
import textwrap
from pathlib import Path

SEED = 20240601
ROWS_PER_FAMILY = 15
MAX_RESPONSE_CHARS = 1500
# The real CodeV-R1 SFT responses are DeepSeek-R1 outputs: "<think>...</think>" reasoning, then the answer (prose
# around one fenced Verilog block) inside "<answer>...</answer>". Nine rows in ten here have that form; every tenth
# row has the reasoning but no <answer> tags, so the loader's fallback (the text after </think>) is exercised too.
NO_ANSWER_TAGS_EVERY = 10
# The rows' "system" field. What the real field holds is not published; this is a self-written prompt of the kind
# the CodeV-R1 authors use for their R1-style prompts (reasoning in <think>, final code in <answer>).
R1_SYSTEM_PROMPT = (
    "You are a helpful assistant who writes Verilog. Reason about the task first, then answer. Put the reasoning "
    "between <think> and </think>, and the answer between <answer> and </answer>; the answer holds the final "
    "Verilog in a ```verilog fenced block."
)
RL_TRAIN_PER_FAMILY = 1  # one RL row per family in codev_r1_rl_train.parquet
RL_VAL_EVERY = 3  # one family in three also gets a row in codev_r1_rl_val.parquet
REPLICA = "codev_r1_replica"

DEFAULT_OUT = Path(__file__).resolve().parent.parent / "gemma_tpu_helpers" / "data"


# ---------------------------------------------------------------------------
# Small helpers shared by the SFT templates
# ---------------------------------------------------------------------------

def clog2(n):
    """Bits needed to hold the values 0 .. n-1 (at least 1)."""
    return max(1, (n - 1).bit_length())


def vec(width):
    """'[7:0] ' for an 8-bit signal, '' for a single bit."""
    return f"[{width - 1}:0] " if width > 1 else ""


def inp(name, width=1, desc=""):
    return {"dir": "input", "name": name, "width": width, "desc": desc, "reg": False}


def out(name, width=1, desc="", reg=False):
    return {"dir": "output", "name": name, "width": width, "desc": desc, "reg": reg}


def header(name, ports, sv=False):
    """ANSI-style module header with aligned port declarations."""
    ranges = [vec(p["width"]).strip() for p in ports]
    pad = max(len(r) for r in ranges)
    lines = []
    for p, r in zip(ports, ranges):
        if sv:
            kind = "logic"
        else:
            kind = "reg " if p["reg"] else "wire"
        decl = f"{p['dir']:<6} {kind} "
        if pad:
            decl += f"{r:<{pad}} "
        lines.append("    " + decl + p["name"])
    return f"module {name} (\n" + ",\n".join(lines) + "\n);"


def with_article(phrase):
    first = phrase.split()[0].lower()
    vowel_sound = first[0] in "aeiou8" or first.startswith(("11-", "18-"))
    if first.startswith(("one", "uni")):
        vowel_sound = False
    return ("an " if vowel_sound else "a ") + phrase


def pick_reset(rng):
    kind = rng.choice(["sync_high", "sync_low", "async_high", "async_low"])
    sync = kind.startswith("sync")
    high = kind.endswith("high")
    if high:
        names = ["rst", "reset", "rst_i"] if sync else ["rst", "areset", "arst"]
    else:
        names = ["rst_n", "resetn", "rst_ni"] if sync else ["rst_n", "aresetn", "arst_n"]
    return {"sync": sync, "high": high, "name": rng.choice(names)}


def reset_words(r):
    timing = "synchronous" if r["sync"] else "asynchronous"
    level = "active-high" if r["high"] else "active-low"
    return f"{timing} {level} reset"


def reset_port(r):
    return inp(r["name"], desc=reset_words(r))


def sensitivity(r, clk="clk"):
    if r["sync"]:
        return f"@(posedge {clk})"
    edge = "posedge" if r["high"] else "negedge"
    return f"@(posedge {clk} or {edge} {r['name']})"


def always_ff(r, sv=False, clk="clk"):
    return ("always_ff " if sv else "always ") + sensitivity(r, clk)


def always_comb(sv=False):
    return "always_comb" if sv else "always @(*)"


def reset_cond(r):
    return r["name"] if r["high"] else f"!{r['name']}"


CLK = inp("clk", desc="clock; registers update on its rising edge")


# ---------------------------------------------------------------------------
# Prompt rendering: several phrasings shared by every family
# ---------------------------------------------------------------------------

def size_words(p):
    return "1 bit" if p["width"] == 1 else f"{p['width']} bits"


def bullet(p, style):
    if style == 0:
        return f"- `{p['name']}` ({p['dir']}, {size_words(p)}): {p['desc']}"
    if style == 1:
        return f"- {p['dir']} {vec(p['width'])}{p['name']} -- {p['desc']}"
    return f"* {p['name']}: {p['dir']}, {size_words(p)}; {p['desc']}"


def inline(ports):
    parts = []
    for p in ports:
        width = f"{p['width']}-bit " if p["width"] > 1 else ""
        parts.append(f"{width}{p['dir']} `{p['name']}`")
    if len(parts) == 1:
        return parts[0]
    return ", ".join(parts[:-1]) + " and " + parts[-1]


def render_prompt(rng, name, summary, details, ports, sv=False):
    lang = "SystemVerilog" if sv else "Verilog"
    bullet_style = rng.randrange(3)
    bullets = "\n".join(bullet(p, bullet_style) for p in ports)
    ins = [p for p in ports if p["dir"] == "input"]
    outs = [p for p in ports if p["dir"] == "output"]
    text = " ".join(details)
    style = rng.randrange(6)
    if style == 0:
        return (f"Write a {lang} module named `{name}` that implements "
                f"{with_article(summary)}.\n\n{text}\n\nPorts:\n{bullets}")
    if style == 1:
        return (f"Design {with_article(summary)} in {lang}. The module must be called "
                f"`{name}` and use exactly these ports:\n{bullets}\n\n{text}")
    if style == 2:
        return (f"Implement the module `{name}` in synthesizable {lang}.\n\n"
                f"Specification: {text}\n\nInterface:\n{bullets}")
    if style == 3:
        return (f"I need {with_article(summary)} written as a {lang} module called "
                f"`{name}`. {text} The ports are {inline(ports)}.")
    if style == 4:
        return (f"Create a {lang} module `{name}` ({with_article(summary)}). "
                f"Inputs: {inline(ins)}. Outputs: {inline(outs)}. {text}")
    return (f"Please provide RTL for `{name}`, {with_article(summary)}. {text}\n"
            f"Port list:\n{bullets}\nOnly this one module is needed.")


# ---------------------------------------------------------------------------
# SFT families. Each returns a dict with: tag, name, summary, details (list of
# sentences), ports, code, explain (response sentence), think (reasoning),
# and optionally sv (bool).
# ---------------------------------------------------------------------------

def fam_counter(rng):
    w = rng.choice([3, 4, 5, 6, 8, 10, 12, 16])
    mode = rng.choice(["up", "down", "updown"])
    r = pick_reset(rng)
    en = rng.random() < 0.6
    sv = rng.random() < 0.3
    q = rng.choice(["count", "q", "cnt", "value"])
    names = {
        "up": ["up_counter", f"counter_up_{w}", f"cnt{w}_up"],
        "down": ["down_counter", f"counter_down_{w}", f"dec_counter{w}"],
        "updown": ["updown_counter", f"counter_ud_{w}", "bidir_counter"],
    }
    name = rng.choice(names[mode])
    ports = [CLK, reset_port(r)]
    if en:
        ports.append(inp("en", desc="count enable; the counter holds its value when low"))
    if mode == "updown":
        ports.append(inp("up", desc="direction: 1 counts up, 0 counts down"))
    ports.append(out(q, w, desc="current count value", reg=True))

    if mode == "down":
        init, init_words = f"{{{w}{{1'b1}}}}", "all ones"
        step = f"{q} - 1'b1"
    else:
        init, init_words = f"{w}'d0", "zero"
        step = f"{q} + 1'b1" if mode == "up" else f"up ? {q} + 1'b1 : {q} - 1'b1"
    cond = "else if (en)" if en else "else"
    code = "\n".join([
        header(name, ports, sv),
        f"    {always_ff(r, sv)} begin",
        f"        if ({reset_cond(r)})",
        f"            {q} <= {init};",
        f"        {cond}",
        f"            {q} <= {step};",
        "    end",
        "endmodule",
    ])
    action = {"up": "increments by one", "down": "decrements by one",
              "updown": "increments when `up` is 1 and decrements when `up` is 0"}[mode]
    when = " while `en` is high" if en else ""
    summary = f"{w}-bit {'up/down' if mode == 'updown' else mode} counter"
    details = [
        f"On each rising edge of `clk` the counter {action}{when}.",
        f"The {reset_words(r)} `{r['name']}` sets `{q}` to {init_words}.",
        f"The count wraps around naturally at the {w}-bit boundary.",
    ]
    explain = (f"This {summary} keeps its value in the `{q}` register; the "
               f"{reset_words(r)} has priority and otherwise the register {action}{when}.")
    think = (f"The task is {with_article(summary)} called {name}. One clocked always block is enough. "
             f"Reset is {reset_words(r)}, so the sensitivity list is "
             f"'{sensitivity(r)}' and the reset test is "
             f"'{reset_cond(r)}'. {'Enable gates the update. ' if en else ''}"
             f"Wrap-around needs no extra logic because {w}-bit arithmetic wraps by itself.")
    return dict(tag=f"{mode}_w{w}", name=name, summary=summary, details=details,
                ports=ports, code=code, explain=explain, think=think, sv=sv)


def fam_modn(rng):
    n = rng.choice([3, 5, 6, 7, 9, 10, 11, 12, 13, 24, 60, 100])
    w = clog2(n)
    r = pick_reset(rng)
    en = rng.random() < 0.5
    q = rng.choice(["count", "q", "cnt"])
    tc = rng.choice(["tc", "wrap", "done", "carry"])
    gated = en and rng.random() < 0.5
    name = rng.choice([f"mod{n}_counter", f"counter_mod{n}", f"modn_counter_{n}",
                       f"div{n}_count"])
    ports = [CLK, reset_port(r)]
    if en:
        ports.append(inp("en", desc="count enable"))
    ports.append(out(q, w, desc=f"count value, 0 to {n - 1}", reg=True))
    ports.append(out(tc, desc="terminal-count flag"))
    last = f"{w}'d{n - 1}"
    tc_expr = f"en && ({q} == {last})" if gated else f"({q} == {last})"
    code = "\n".join([
        header(name, ports),
        f"    {always_ff(r)} begin",
        f"        if ({reset_cond(r)})",
        f"            {q} <= {w}'d0;",
        f"        {'else if (en) begin' if en else 'else begin'}",
        f"            if ({q} == {last})",
        f"                {q} <= {w}'d0;",
        "            else",
        f"                {q} <= {q} + 1'b1;",
        "        end",
        "    end",
        "",
        f"    assign {tc} = {tc_expr};",
        "endmodule",
    ])
    kind = "decade counter" if n == 10 else f"modulo-{n} counter"
    when = " whenever `en` is 1" if en else ""
    flag = (f"`{tc}` is high when the count is {n - 1} and `en` is 1" if gated
            else f"`{tc}` is high whenever the count equals {n - 1}")
    details = [
        f"The counter counts {', '.join(map(str, range(n))) if n <= 5 else f'0, 1, ..., {n - 1}'} "
        f"and then returns to 0, advancing on each "
        f"rising clock edge{when}.",
        f"{flag}.",
        f"Use {with_article(reset_words(r))} `{r['name']}` that clears the count to 0.",
    ]
    explain = (f"The {w}-bit register wraps to zero after reaching {n - 1}, and the "
               f"terminal-count output is a simple compare against {n - 1}.")
    think = (f"A mod-{n} counter needs ceil(log2({n})) = {w} bits. I compare against {n - 1} "
             f"before incrementing so the count never reaches {n}. The flag `{tc}` is "
             f"combinational{' and also gated by en' if gated else ''}.")
    return dict(tag=f"mod{n}", name=name, summary=kind, details=details, ports=ports,
                code=code, explain=explain, think=think)


def fam_mux(rng):
    kind = rng.choice(["2to1", "4to1", "nway"])
    w = rng.choice([1, 2, 4, 8, 16, 32])
    sv = rng.random() < 0.25
    y = rng.choice(["y", "out", "dout"])
    if kind == "2to1":
        a, b = rng.choice([("a", "b"), ("in0", "in1"), ("d0", "d1")])
        name = rng.choice(["mux2", f"mux2_w{w}", "mux_2to1", "sel2"])
        ports = [inp(a, w, "selected when sel is 0"), inp(b, w, "selected when sel is 1"),
                 inp("sel", desc="select"), out(y, w, "selected data")]
        code = "\n".join([header(name, ports, sv), f"    assign {y} = sel ? {b} : {a};",
                          "endmodule"])
        summary = f"{w}-bit 2-to-1 multiplexer" if w > 1 else "2-to-1 multiplexer"
        details = [f"`{y}` must equal `{a}` when `sel` is 0 and `{b}` when `sel` is 1.",
                   "The circuit is purely combinational."]
        explain = "A single conditional assignment gives the 2-to-1 selection."
        think = "Two inputs and one select bit: a ternary operator in a continuous assignment is the whole design."
        n = 2
    elif kind == "4to1":
        ins_ = [f"in{i}" for i in range(4)] if rng.random() < 0.5 else ["a", "b", "c", "d"]
        name = rng.choice(["mux4", f"mux4_w{w}", "mux_4to1", "quad_mux"])
        ports = [inp(x, w, f"selected when sel is {i}") for i, x in enumerate(ins_)]
        ports += [inp("sel", 2, "select"), out(y, w, "selected data", reg=True)]
        body = [f"    {always_comb(sv)} begin", "        case (sel)"]
        body += [f"            2'd{i}: {y} = {x};" for i, x in enumerate(ins_[:3])]
        body += [f"            default: {y} = {ins_[3]};", "        endcase", "    end"]
        code = "\n".join([header(name, ports, sv)] + body + ["endmodule"])
        summary = f"{w}-bit 4-to-1 multiplexer" if w > 1 else "4-to-1 multiplexer"
        details = [f"The 2-bit `sel` input chooses which of {', '.join(f'`{x}`' for x in ins_)} "
                   f"drives `{y}` (sel = 0 selects `{ins_[0]}`, sel = 3 selects `{ins_[3]}`).",
                   "No clock is involved."]
        explain = "A case statement inside a combinational always block selects one of the four inputs."
        think = "Four inputs, 2-bit select. A case statement with a default branch avoids latches."
        n = 4
    else:
        n = rng.choice([3, 5, 6, 8, 12, 16])
        s = clog2(n)
        name = rng.choice([f"mux{n}", f"mux_{n}way", f"bus_mux{n}"])
        ports = [inp("data", n * w, f"{n} packed {w}-bit inputs; input i is "
                 f"data[i*{w} +: {w}]"), inp("sel", s, "select"),
                 out(y, w, "selected data")]
        pick = "data[sel]" if w == 1 else f"data[sel*{w} +: {w}]"
        if n == 1 << s:
            line = f"    assign {y} = {pick};"
            extra = ""
        else:
            line = f"    assign {y} = (sel < {s}'d{n}) ? {pick} : {w}'d0;"
            extra = f" When `sel` is {n} or more, `{y}` must be 0."
        code = "\n".join([header(name, ports, sv), line, "endmodule"])
        summary = f"{n}-way multiplexer with {w}-bit inputs"
        details = [f"The {n} inputs are packed into `data`; input i occupies bits "
                   f"[i*{w}+{w - 1}:i*{w}]. `{y}` must equal input number `sel`.{extra}"]
        explain = "An indexed part-select picks the chosen field out of the packed input bus."
        think = (f"{n} inputs need a {s}-bit select. With a packed bus the indexed part-select "
                 f"data[sel*{w} +: {w}] is the cleanest form."
                 + ("" if n == 1 << s
                    else f" sel values {n}..{(1 << s) - 1} are out of range, so I return 0 for them."))
    return dict(tag=f"{kind}_w{w}" if kind != "nway" else f"n{n}_w{w}", name=name,
                summary=summary, details=details, ports=ports, code=code, explain=explain,
                think=think, sv=sv)


def fam_addsub(rng):
    kind = rng.choice(["adder", "subtractor", "addsub", "full_adder"])
    w = rng.choice([4, 6, 8, 12, 16, 24, 32])
    if kind == "full_adder":
        name = rng.choice(["full_adder", "fa", "fadd1"])
        ports = [inp("a"), inp("b"), inp("cin", desc="carry in"),
                 out("s", desc="sum bit"), out("cout", desc="carry out")]
        style = rng.randrange(2)
        if style == 0:
            body = ["    assign {cout, s} = a + b + cin;"]
        else:
            body = ["    assign s    = a ^ b ^ cin;",
                    "    assign cout = (a & b) | (a & cin) | (b & cin);"]
        code = "\n".join([header(name, ports)] + body + ["endmodule"])
        return dict(tag="full_adder", name=name, summary="1-bit full adder",
                    details=["Add the three input bits; `s` is the sum bit and `cout` the carry out."],
                    ports=ports, code=code,
                    explain="The sum is the XOR of the three inputs and the carry is their majority.",
                    think="A full adder: sum = a^b^cin, carry = majority(a, b, cin).")
    a, b = rng.choice([("a", "b"), ("x", "y"), ("op_a", "op_b")])
    if kind == "adder":
        name = rng.choice([f"adder{w}", f"add_w{w}", "ripple_adder", "adder_with_carry"])
        ports = [inp(a, w, "first operand"), inp(b, w, "second operand"),
                 inp("cin", desc="carry in"), out("sum", w, "sum"), out("cout", desc="carry out")]
        body = [f"    assign {{cout, sum}} = {a} + {b} + cin;"]
        summary = f"{w}-bit adder with carry in and carry out"
        details = [f"Compute `{a}` + `{b}` + `cin` as unsigned numbers. `sum` holds the low "
                   f"{w} bits and `cout` the carry out of the top bit."]
        explain = "Concatenating the carry with the sum on the left-hand side keeps the extra result bit."
        think = f"Assigning to {{cout, sum}} makes the addition {w + 1} bits wide, so the carry falls out for free."
    elif kind == "subtractor":
        name = rng.choice([f"sub{w}", f"subtractor_w{w}", "borrow_sub"])
        ports = [inp(a, w, "minuend"), inp(b, w, "subtrahend"), inp("bin", desc="borrow in"),
                 out("diff", w, "difference"), out("bout", desc="borrow out")]
        body = [f"    assign {{bout, diff}} = {{1'b0, {a}}} - {{1'b0, {b}}} - bin;"]
        summary = f"{w}-bit subtractor with borrow"
        details = [f"Compute `{a}` - `{b}` - `bin` on unsigned values. `diff` is the low {w} "
                   f"bits of the result and `bout` is 1 when the true result is negative."]
        explain = f"Doing the subtraction on {w + 1}-bit zero-extended operands makes the top bit the borrow."
        think = (f"Zero-extend both operands to {w + 1} bits; the result's MSB is then 1 exactly "
                 f"when {a} < {b} + bin, which is the borrow out.")
    else:
        name = rng.choice([f"addsub{w}", f"add_sub_w{w}", "adder_subtractor"])
        ports = [inp(a, w, "first operand"), inp(b, w, "second operand"),
                 inp("sub", desc="0 = add, 1 = subtract"), out("result", w, "result"),
                 out("carry", desc="carry (add) or borrow (subtract)"),
                 out("overflow", desc="signed overflow")]
        m = w - 1
        body = [
            f"    wire [{w}:0] add_ext = {{1'b0, {a}}} + {{1'b0, {b}}};",
            f"    wire [{w}:0] sub_ext = {{1'b0, {a}}} - {{1'b0, {b}}};",
            "",
            "    assign {carry, result} = sub ? sub_ext : add_ext;",
            f"    assign overflow = sub ? (({a}[{m}] ^ {b}[{m}]) & (result[{m}] ^ {a}[{m}]))",
            f"                          : (~({a}[{m}] ^ {b}[{m}]) & (result[{m}] ^ {a}[{m}]));",
        ]
        summary = f"{w}-bit adder/subtractor"
        details = [f"When `sub` is 0, `result` = `{a}` + `{b}` and `carry` is the carry out. "
                   f"When `sub` is 1, `result` = `{a}` - `{b}` and `carry` is the borrow "
                   f"(1 when `{a}` < `{b}` as unsigned numbers).",
                   "`overflow` flags two's-complement overflow of the selected operation."]
        explain = ("Both results are formed one bit wider; the mode bit picks one, and the "
                   "overflow flag compares operand and result sign bits.")
        think = ("Signed overflow for addition happens when both operands have the same sign and "
                 "the result's sign differs; for subtraction when the operands' signs differ and "
                 "the result's sign differs from a.")
    code = "\n".join([header(name, ports)] + body + ["endmodule"])
    return dict(tag=f"{kind}_w{w}", name=name, summary=summary, details=details, ports=ports,
                code=code, explain=explain, think=think)


def fam_shift(rng):
    kind = rng.choice(["sipo_left", "sipo_right", "piso", "bidir"])
    w = rng.choice([4, 5, 6, 8, 12, 16])
    r = pick_reset(rng)
    en = kind in ("piso", "bidir") or rng.random() < 0.5
    q = rng.choice(["q", "data_out", "sr"])
    sin = rng.choice(["sin", "din", "serial_in"])
    name = {"sipo_left": ["shift_left_reg", f"sipo{w}", "shreg_left"],
            "sipo_right": ["shift_right_reg", f"sipo{w}_r", "shreg_right"],
            "piso": [f"piso{w}", "load_shift_reg", "par2ser"],
            "bidir": ["bidir_shift_reg", f"univ_shift{w}", "shift_reg_lr"]}[kind]
    name = rng.choice(name)
    ports = [CLK, reset_port(r)]
    if en:
        ports.append(inp("en", desc="shift enable"))
    if kind in ("piso", "bidir"):
        ports.append(inp("load", desc="parallel load (has priority over shifting)"))
        ports.append(inp("d", w, "parallel load data"))
    if kind == "bidir":
        ports.append(inp("dir", desc="1 shifts left, 0 shifts right"))
    if kind != "piso":
        ports.append(inp(sin, desc="serial input bit"))
    ports.append(out(q, w, "register contents", reg=True))
    if kind == "piso":
        ports.append(out("sout", desc="serial output (MSB first)"))
    left = f"{{{q}[{w - 2}:0], {sin}}}"
    right = f"{{{sin}, {q}[{w - 1}:1]}}"
    body = [f"    {always_ff(r)} begin", f"        if ({reset_cond(r)})",
            f"            {q} <= {w}'d0;"]
    if kind == "piso":
        body += ["        else if (load)", f"            {q} <= d;",
                 "        else if (en)", f"            {q} <= {{{q}[{w - 2}:0], 1'b0}};"]
        desc = ("When `load` is 1 the register takes `d`; otherwise, while `en` is 1, it shifts "
                "left by one each cycle with a 0 entering at bit 0. `sout` is the MSB of the register.")
    elif kind == "bidir":
        body += ["        else if (load)", f"            {q} <= d;",
                 "        else if (en) begin",
                 "            if (dir)", f"                {q} <= {left};",
                 "            else", f"                {q} <= {right};", "        end"]
        desc = (f"`load` has priority and copies `d` into the register. Otherwise, when `en` is 1, "
                f"`dir` = 1 shifts left (`{sin}` enters at bit 0) and `dir` = 0 shifts right "
                f"(`{sin}` enters at bit {w - 1}).")
    else:
        nxt = left if kind == "sipo_left" else right
        body += [f"        {'else if (en)' if en else 'else'}", f"            {q} <= {nxt};"]
        where = ("bit 0, moving bits toward the MSB" if kind == "sipo_left"
                 else f"bit {w - 1}, moving bits toward the LSB")
        desc = (f"On each rising clock edge{' with `en` high' if en else ''} the register shifts "
                f"by one position and `{sin}` enters at {where}.")
    body.append("    end")
    if kind == "piso":
        body += ["", f"    assign sout = {q}[{w - 1}];"]
    code = "\n".join([header(name, ports)] + body + ["endmodule"])
    summary = {"sipo_left": f"{w}-bit serial-in shift register (shifting left)",
               "sipo_right": f"{w}-bit serial-in shift register (shifting right)",
               "piso": f"{w}-bit parallel-load shift register with serial output",
               "bidir": f"{w}-bit bidirectional shift register with parallel load"}[kind]
    details = [desc, f"{with_article(reset_words(r)).capitalize()} `{r['name']}` clears the register."]
    explain = "The shift is written as a concatenation inside one clocked always block."
    think = (f"Shifting is just a concatenation of the kept bits and the new bit. "
             f"Priority order inside the clocked block: reset, "
             f"{'load, ' if kind in ('piso', 'bidir') else ''}then the shift.")
    return dict(tag=f"{kind}_w{w}", name=name, summary=summary, details=details, ports=ports,
                code=code, explain=explain, think=think)


def fam_decoder(rng):
    n = rng.choice([2, 3, 3, 4, 5])
    m = 1 << n
    en = rng.random() < 0.6
    low = rng.random() < 0.3
    style = rng.choice(["shift", "loop"] + (["case"] if n <= 3 else []))
    a = rng.choice(["a", "sel", "addr", "in"])
    y = "y_n" if low else rng.choice(["y", "out", "dec"])
    name = rng.choice([f"decoder{n}to{m}", f"dec_{n}_{m}", f"decode{n}"])
    ports = [inp(a, n, "binary input")]
    if en:
        ports.append(inp("en", desc="enable"))
    ports.append(out(y, m, "decoded outputs" + (" (active low)" if low else ""), reg=style != "shift"))
    off = f"{{{m}{{1'b{'1' if low else '0'}}}}}"
    if style == "shift":
        hot = f"({m}'d1 << {a})"
        val = f"~{hot}" if low else hot
        line = f"    assign {y} = en ? {val} : {off};" if en else f"    assign {y} = {val};"
        body = [line]
    elif style == "loop":
        bit = "1'b0" if low else "1'b1"
        body = ["    always @(*) begin", f"        {y} = {off};"]
        if en:
            body += ["        if (en)", f"            {y}[{a}] = {bit};"]
        else:
            body += [f"        {y}[{a}] = {bit};"]
        body.append("    end")
    else:
        body = ["    always @(*) begin"]
        ind = "        "
        if en:
            body += ["        if (!en)", f"            {y} = {off};", "        else begin"]
            ind = "            "
        body.append(f"{ind}case ({a})")
        for i in range(m):
            word = (1 << i) ^ ((1 << m) - 1 if low else 0)
            body.append(f"{ind}    {n}'d{i}: {y} = {m}'b{word:0{m}b};")
        body += [f"{ind}    default: {y} = {off};", f"{ind}endcase"]
        if en:
            body.append("        end")
        body.append("    end")
    code = "\n".join([header(name, ports)] + body + ["endmodule"])
    level = "low" if low else "high"
    details = [f"Output bit `{y}[i]` is active ({level}) exactly when `{a}` equals i; all other "
               f"output bits are inactive."]
    if en:
        details.append(f"When `en` is 0 every output bit is inactive ({'1' if low else '0'}).")
    summary = f"{n}-to-{m} decoder" + (" with active-low outputs" if low else "")
    explain = {"shift": "Shifting a single 1 by the input value produces the one-hot pattern.",
               "loop": "The always block clears every output and then sets the addressed bit.",
               "case": "Each input value maps to its one-hot pattern in a case statement."}[style]
    think = (f"{n} input bits give {m} outputs. One-hot output: bit i set for input i"
             f"{', inverted because outputs are active low' if low else ''}.")
    return dict(tag=f"{n}to{m}_{style}", name=name, summary=summary, details=details,
                ports=ports, code=code, explain=explain, think=think)


def fam_encoder(rng):
    kind = rng.choice(["onehot", "prio_high", "prio_low"])
    n = rng.choice([4, 8, 8, 16] if kind == "onehot" else [4, 5, 6, 8, 10, 16])
    s = clog2(n)
    req = rng.choice(["in", "req", "onehot"] if kind == "onehot" else ["req", "in", "irq"])
    idx = rng.choice(["bin", "code", "idx"])
    ports = [inp(req, n, "input vector")]
    if kind == "onehot":
        name = rng.choice([f"enc{n}to{s}", f"onehot_to_bin{n}", f"encoder{n}"])
        ports.append(out(idx, s, "binary index of the set bit"))
        body = []
        for k in range(s):
            bits = ", ".join(f"{req}[{i}]" for i in reversed(range(n)) if i >> k & 1)
            body.append(f"    assign {idx}[{k}] = |{{{bits}}};" if s > 1 else f"    assign {idx} = |{{{bits}}};")
        summary = f"{n}-to-{s} one-hot to binary encoder"
        details = [f"Assume exactly one bit of `{req}` is set; `{idx}` must give its position. "
                   f"Each output bit is the OR of the input bits whose index has that bit set."]
        explain = "Each index bit is the OR of the input lines whose position has that bit set."
        think = (f"For a one-hot input, {idx}[k] is 1 iff the hot position has bit k set, "
                 f"so an OR over those inputs works.")
    else:
        high = kind == "prio_high"
        name = rng.choice([f"prio_enc{n}", f"priority_encoder_{n}", f"{'msb' if high else 'lsb'}_first_enc{n}"])
        ports += [out(idx, s, "index of the winning request", reg=True),
                  out("valid", desc="1 when any request bit is set", reg=True)]
        if n <= 8 and rng.random() < 0.5:
            body = ["    always @(*) begin", "        valid = 1'b1;", f"        casez ({req})"]
            order = reversed(range(n)) if high else range(n)
            for i in order:
                pat = ["?"] * n
                pat[n - 1 - i] = "1"
                for j in range(n):
                    if (high and j > i) or (not high and j < i):
                        pat[n - 1 - j] = "0"
                body.append(f"            {n}'b{''.join(pat)}: {idx} = {s}'d{i};")
            body += [f"            default: begin {idx} = {s}'d0; valid = 1'b0; end",
                     "        endcase", "    end"]
        else:
            loop = (f"for (i = 0; i < {n}; i = i + 1)" if high else
                    f"for (i = {n - 1}; i >= 0; i = i - 1)")
            body = ["    integer i;", "", "    always @(*) begin", f"        {idx} = {s}'d0;",
                    "        valid = 1'b0;", f"        {loop}", f"            if ({req}[i]) begin",
                    f"                {idx} = i;", "                valid = 1'b1;",
                    "            end", "    end"]
        side = "highest" if high else "lowest"
        summary = f"{n}-input priority encoder ({side} index wins)"
        details = [f"`{idx}` is the index of the {side}-numbered set bit of `{req}` and `valid` is "
                   f"1 when at least one bit is set. When no bit is set, `{idx}` is 0 and `valid` is 0."]
        explain = (f"Scanning the request bits so that the {side} set bit is seen last (or matched "
                   f"first in a casez) gives the priority.")
        think = (f"Priority goes to the {side} index. In a for loop the last assignment wins, so I "
                 f"loop {'upward' if high else 'downward'}; a casez with don't-cares works as well.")
    code = "\n".join([header(name, ports)] + body + ["endmodule"])
    return dict(tag=f"{kind}{n}", name=name, summary=summary, details=details, ports=ports,
                code=code, explain=explain, think=think)


def fam_compare(rng):
    kind = rng.choice(["three", "max", "ge"])
    w = rng.choice([4, 6, 8, 10, 16, 32])
    signed = rng.random() < 0.35
    a, b = rng.choice([("a", "b"), ("x", "y"), ("lhs", "rhs")])
    A, B = (f"$signed({a})", f"$signed({b})") if signed else (a, b)
    num = "two's-complement signed" if signed else "unsigned"
    ports = [inp(a, w, f"first operand ({num})"), inp(b, w, f"second operand ({num})")]
    if kind == "three":
        name = rng.choice([f"cmp{w}", f"comparator_{w}", "mag_compare"])
        ports += [out("eq", desc=f"{a} == {b}"), out("lt", desc=f"{a} < {b}"), out("gt", desc=f"{a} > {b}")]
        body = [f"    assign eq = ({a} == {b});", f"    assign lt = ({A} < {B});",
                f"    assign gt = ({A} > {B});"]
        summary = f"{w}-bit {'signed' if signed else 'unsigned'} magnitude comparator"
        details = [f"Exactly one of `eq`, `lt`, `gt` is 1, telling whether `{a}` is equal to, "
                   f"less than or greater than `{b}` ({num} comparison)."]
    elif kind == "max":
        name = rng.choice([f"max{w}", f"max_select_{w}", "larger_of_two"])
        wins = f"{a}_wins"
        ports += [out("max", w, "the larger operand"), out(wins, desc=f"1 when {a} >= {b}")]
        body = [f"    assign {wins} = ({A} >= {B});", f"    assign max = {wins} ? {a} : {b};"]
        summary = f"{w}-bit maximum selector"
        details = [f"`max` outputs the larger of `{a}` and `{b}` ({num}); `{wins}` is 1 when "
                   f"`{a}` >= `{b}` (then `max` = `{a}`)."]
    else:
        name = rng.choice([f"ge{w}", f"greater_equal_{w}", "cmp_ge"])
        ports += [out("ge", desc=f"{a} >= {b}")]
        body = [f"    assign ge = ({A} >= {B});"]
        summary = f"{w}-bit greater-or-equal comparator"
        details = [f"`ge` must be 1 when `{a}` >= `{b}`, comparing them as {num} numbers."]
    code = "\n".join([header(name, ports)] + body + ["endmodule"])
    explain = ("The relational operators are applied to "
               + ("$signed() views of the operands so the comparison is signed." if signed
                  else "the unsigned operands directly."))
    think = ("Signed comparison needs $signed() on both sides; otherwise Verilog compares "
             "the bit patterns as unsigned." if signed else
             "Plain unsigned vectors compare as unsigned numbers, so the operators are enough.")
    return dict(tag=f"{kind}_{'s' if signed else 'u'}{w}", name=name, summary=summary,
                details=details, ports=ports, code=code, explain=explain, think=think)


FSM_PATTERNS = ["101", "110", "011", "100", "010", "111", "1011", "1101", "1001", "0101",
                "1110", "0011", "1111", "10110", "11010", "11011", "10101", "01110", "1100"]


def kmp_next(pattern, matched, bit):
    """Length of the longest suffix of pattern[:matched] + bit that is a prefix of pattern."""
    s = pattern[:matched] + bit
    for k in range(min(len(s), len(pattern)), 0, -1):
        if s.endswith(pattern[:k]):
            return k
    return 0


def fam_fsm(rng):
    pat = rng.choice(FSM_PATTERNS)
    moore = rng.random() < 0.5
    overlap = rng.random() < 0.6
    r = pick_reset(rng)
    sv = rng.random() < 0.25
    x = rng.choice(["din", "x", "bit_in", "s_in"])
    z = rng.choice(["detected", "match", "z"])
    L = len(pat)
    name = rng.choice([f"seq_det_{pat}", f"detect_{pat}", f"{'moore' if moore else 'mealy'}_{pat}"])
    nstates = L + 1 if moore else L
    sw = clog2(nstates)
    names = ["IDLE"] + [f"GOT_{pat[:k]}" for k in range(1, nstates)]

    def nxt(k, bit):
        if moore and k == L:
            return kmp_next(pat, L, bit) if overlap else kmp_next(pat, 0, bit)
        j = kmp_next(pat, k, bit)
        if j == L and not moore:  # Mealy: a full match emits z and moves on
            return border(pat) if overlap else 0
        return j

    ports = [CLK, reset_port(r), inp(x, desc="serial input bit"), out(z, desc="detection flag")]
    width_n = max(len(nm) for nm in names)
    lead = f"    localparam [{sw - 1}:0] "  # patterns have 3+ bits, so sw >= 2
    decl = [f"{nm:<{width_n}} = {sw}'d{i}" for i, nm in enumerate(names)]
    body = [lead + (",\n" + " " * len(lead)).join(decl) + ";"]
    typ = "logic" if sv else "reg"
    body += ["", f"    {typ} [{sw - 1}:0] state, next_state;", "",
             f"    {always_ff(r, sv)} begin", f"        if ({reset_cond(r)})",
             "            state <= IDLE;", "        else", "            state <= next_state;",
             "    end", "", f"    {always_comb(sv)} begin", "        case (state)"]
    for k, nm in enumerate(names):
        one, zero = names[nxt(k, "1")], names[nxt(k, "0")]
        body.append(f"            {nm + ':':<{width_n + 1}} next_state = {x} ? {one} : {zero};")
    body += [f"            {'default:':<{width_n + 1}} next_state = IDLE;", "        endcase", "    end", ""]
    if moore:
        body.append(f"    assign {z} = (state == {names[L]});")
    else:
        body.append(f"    assign {z} = (state == {names[L - 1]}) && ({x} == 1'b{pat[-1]});")
    code = "\n".join([header(name, ports, sv)] + body + ["endmodule"])
    kind = "Moore" if moore else "Mealy"
    summary = f"{kind} FSM that detects the bit sequence {pat}"
    timing = (f"`{z}` must be 1 during the clock cycle after the last bit of the sequence has been "
              f"sampled (it depends only on the state)" if moore else
              f"`{z}` must be 1 combinationally while the current input completes the sequence")
    details = [f"The FSM samples `{x}` on every rising clock edge, first bit of the pattern first, "
               f"and looks for {pat}.", timing + ".",
               ("Overlapping occurrences count (the tail of one match may start the next)." if overlap
                else "Occurrences may not overlap: after a match the search starts from scratch."),
               f"Use {with_article(reset_words(r))} `{r['name']}` that returns the FSM to its idle state."]
    explain = (f"The states record how much of {pat} has been matched so far; "
               + ("the output is decoded from the final state." if moore else
                  "the output combines the last partial-match state with the current input."))
    think = (f"States track the longest prefix of {pat} that is a suffix of the input so far. "
             f"{'Moore' if moore else 'Mealy'} needs {nstates} states. On a mismatch I fall back "
             f"to the longest prefix that still matches, like KMP. "
             + ("After a match the overlap rule keeps the matching tail." if overlap else
                "After a match the search restarts from IDLE."))
    return dict(tag=f"{kind.lower()}_{pat}", name=name, summary=summary, details=details,
                ports=ports, code=code, explain=explain, think=think, sv=sv)


def border(pattern):
    """Length of the longest proper prefix of pattern that is also a suffix."""
    for k in range(len(pattern) - 1, 0, -1):
        if pattern.endswith(pattern[:k]):
            return k
    return 0


def fam_parity(rng):
    kind = rng.choice(["even", "odd", "append", "check"])
    w = rng.choice([4, 7, 8, 9, 12, 16, 32])
    d = rng.choice(["data", "d", "word"])
    loop = kind in ("even", "odd") and rng.random() < 0.4
    ports = [inp(d, w, "data word")]
    if kind in ("even", "odd"):
        name = rng.choice([f"{kind}_parity{w}", f"parity_gen_{kind}", f"par{w}_{kind}"])
        ports.append(out("parity", desc=f"{kind} parity bit", reg=loop))
        if loop:
            body = ["    integer i;", "", "    always @(*) begin",
                    f"        parity = 1'b{'0' if kind == 'even' else '1'};",
                    f"        for (i = 0; i < {w}; i = i + 1)",
                    f"            parity = parity ^ {d}[i];", "    end"]
        else:
            body = [f"    assign parity = {'^' if kind == 'even' else '~^'}{d};"]
        summary = f"{kind}-parity generator for {with_article(f'{w}-bit')} word"
        details = [f"`parity` must be chosen so that `{d}` together with the parity bit holds an "
                   f"{kind} number of 1s."]
        explain = ("XOR-reducing the word gives 1 exactly when it holds an odd number of ones"
                   + ("; the odd-parity bit is its complement." if kind == "odd" else "."))
    elif kind == "append":
        name = rng.choice([f"add_parity{w}", "parity_append", f"tag_parity_{w}"])
        ports.append(out("frame", w + 1, "data with the even parity bit appended as LSB"))
        body = [f"    assign frame = {{{d}, ^{d}}};"]
        summary = f"even-parity framer for {w}-bit data"
        details = [f"`frame` is `{d}` shifted up by one with an even parity bit in bit 0, so "
                   f"`frame` always holds an even number of 1s."]
        explain = "The reduction XOR gives the even parity bit, which is concatenated below the data."
    else:
        name = rng.choice([f"parity_check{w}", "parity_checker", f"chk_par_{w}"])
        odd = rng.random() < 0.5
        scheme = "odd" if odd else "even"
        ports += [inp("parity_bit", desc=f"received {scheme} parity bit"),
                  out("error", desc="1 when the parity check fails")]
        body = [f"    assign error = {'~^' if odd else '^'}{{{d}, parity_bit}};"]
        summary = f"{scheme}-parity checker for {w}-bit data"
        details = [f"The word and `parity_bit` together should contain an {scheme} number of 1s; "
                   f"`error` is 1 when they do not."]
        explain = "Reducing the data and the received parity bit with XOR exposes a parity error."
        kind = f"check_{scheme}"
    code = "\n".join([header(name, ports)] + body + ["endmodule"])
    think = ("Parity is an XOR reduction. ^x is 1 for an odd count of ones; ~^x is its complement. "
             "No clock is needed.")
    return dict(tag=f"{kind}_w{w}", name=name, summary=summary, details=details, ports=ports,
                code=code, explain=explain, think=think)


def fam_edge(rng):
    kind = rng.choice(["rise", "fall", "both"])
    w = rng.choice([1, 1, 1, 4, 8])
    r = pick_reset(rng)
    sync = w == 1 and rng.random() < 0.35
    registered = not sync and rng.random() < 0.3
    s = rng.choice(["sig", "in", "din", "btn"])
    o = {"rise": "rise", "fall": "fall", "both": "toggle"}[kind]
    o = rng.choice([o, "pulse", "det"])
    name = rng.choice([f"{kind}_edge_det", f"edge_detect_{kind}", f"{kind}_detector"] +
                      ([f"sync_{kind}_edge"] if sync else []))
    ports = [CLK, reset_port(r), inp(s, w, "input signal" + (" (asynchronous to clk)" if sync else "")),
             out(o, w, "one-cycle pulse per detected edge", reg=registered)]
    expr = {"rise": "{cur} & ~{prev}", "fall": "~{cur} & {prev}", "both": "{cur} ^ {prev}"}[kind]
    if sync:
        body = ["    reg [2:0] sync_q;  // two synchronizer flops plus one history flop", "",
                f"    {always_ff(r)} begin", f"        if ({reset_cond(r)})",
                "            sync_q <= 3'b000;", "        else",
                f"            sync_q <= {{sync_q[1:0], {s}}};", "    end", "",
                f"    assign {o} = {expr.format(cur='sync_q[1]', prev='sync_q[2]')};"]
    else:
        body = [f"    reg {vec(w)}prev;", "", f"    {always_ff(r)} begin",
                f"        if ({reset_cond(r)}) begin" if registered else f"        if ({reset_cond(r)})",
                f"            prev <= {w}'d0;"]
        if registered:
            body += [f"            {o} <= {w}'d0;", "        end else begin",
                     f"            prev <= {s};", f"            {o} <= {expr.format(cur=s, prev='prev')};",
                     "        end", "    end"]
        else:
            body += ["        else", f"            prev <= {s};", "    end", "",
                     f"    assign {o} = {expr.format(cur=s, prev='prev')};"]
    code = "\n".join([header(name, ports)] + body + ["endmodule"])
    what = {"rise": "rising (0 to 1)", "fall": "falling (1 to 0)", "both": "rising or falling"}[kind]
    per_bit = " Each bit is handled independently." if w > 1 else ""
    if sync:
        timing = (f"First pass `{s}` through a two-flop synchronizer, then compare the synchronized "
                  f"value with its previous value; `{o}` is high for one cycle per {what} edge.")
    elif registered:
        timing = (f"`{o}` is a registered output: it goes high at the first clock edge that samples "
                  f"the new value of `{s}` and stays high for exactly one cycle.")
    else:
        timing = (f"Keep the previous sample of `{s}` in a register; `{o}` is high while the current "
                  f"value and the stored previous value form a {what} transition.")
    details = [f"Detect {what} edges of `{s}`.{per_bit}", timing,
               f"The history register is cleared by {with_article(reset_words(r))} `{r['name']}`."]
    summary = ({"rise": "rising-edge", "fall": "falling-edge", "both": "dual-edge"}[kind] + " detector"
               + (f" for {with_article(f'{w}-bit')} bus" if w > 1 else ""))
    explain = "A register holds the previous sample and the edge is found by comparing it with the current value."
    think = (f"Edge detection = compare the signal with a one-cycle-delayed copy. "
             f"{'The input is asynchronous, so two flops synchronize it first. ' if sync else ''}"
             f"Rising is cur & ~prev, falling ~cur & prev, either edge cur ^ prev.")
    return dict(tag=f"{kind}_w{w}{'_sync' if sync else ''}", name=name, summary=summary,
                details=details, ports=ports, code=code, explain=explain, think=think)


def fam_clkdiv(rng):
    kind = rng.choice(["even", "pow2", "tick"])
    r = pick_reset(rng)
    if kind == "even":
        n = rng.choice([2, 4, 6, 8, 10, 12, 20, 50, 100])
        half = n // 2
        w = clog2(half)
        name = rng.choice([f"clk_div{n}", f"clock_divider_{n}", f"div_by_{n}"])
        ports = [CLK, reset_port(r), out("clk_out", desc=f"clk divided by {n}, 50% duty cycle", reg=True)]
        body = [f"    reg [{w - 1}:0] cnt;" if w > 1 else "    reg cnt;", "",
                f"    {always_ff(r)} begin", f"        if ({reset_cond(r)}) begin",
                f"            cnt     <= {w}'d0;", "            clk_out <= 1'b0;",
                f"        end else if (cnt == {w}'d{half - 1}) begin",
                f"            cnt     <= {w}'d0;", "            clk_out <= ~clk_out;",
                "        end else begin", "            cnt     <= cnt + 1'b1;", "        end", "    end"]
        summary = f"divide-by-{n} clock divider"
        details = [f"`clk_out` toggles every {half} input clock cycles, giving a clock {n} times "
                   f"slower with a 50% duty cycle.",
                   f"{with_article(reset_words(r)).capitalize()} `{r['name']}` clears the internal counter "
                   f"and drives `clk_out` low."]
        explain = f"A counter runs from 0 to {half - 1}; each time it wraps, the output clock toggles."
        think = f"For 50% duty with even N={n}, toggle every N/2={half} cycles. The counter needs {w} bit(s)."
        tag = f"even{n}"
    elif kind == "pow2":
        k = rng.randint(1, 6)
        name = rng.choice([f"clk_div_pow2_{k}", f"ripple_div{1 << k}", f"div{1 << k}_counter"])
        ports = [CLK, reset_port(r), out("clk_out", desc=f"clk divided by {1 << k}")]
        body = [f"    reg {vec(k)}cnt;", "", f"    {always_ff(r)} begin",
                f"        if ({reset_cond(r)})", f"            cnt <= {k}'d0;", "        else",
                "            cnt <= cnt + 1'b1;", "    end", "",
                f"    assign clk_out = cnt[{k - 1}];" if k > 1 else "    assign clk_out = cnt;"]
        summary = f"divide-by-{1 << k} clock divider"
        details = [f"Use a free-running {k}-bit counter and drive `clk_out` from its most "
                   f"significant bit, which divides the clock by {1 << k}.",
                   f"Reset (`{r['name']}`, {reset_words(r)}) clears the counter."]
        explain = f"The MSB of a {k}-bit binary counter toggles every {1 << (k - 1)} cycles."
        think = f"Dividing by a power of two only needs a binary counter; bit {k - 1} has period {1 << k}."
        tag = f"pow2_{1 << k}"
    else:
        n = rng.choice([3, 5, 7, 10, 16, 25, 100, 1000])
        w = clog2(n)
        name = rng.choice([f"tick_gen_{n}", f"enable_every_{n}", f"strobe{n}"])
        ports = [CLK, reset_port(r), out("tick", desc=f"one-cycle pulse every {n} cycles")]
        body = [f"    reg [{w - 1}:0] cnt;", "", f"    {always_ff(r)} begin",
                f"        if ({reset_cond(r)})", f"            cnt <= {w}'d0;",
                f"        else if (cnt == {w}'d{n - 1})", f"            cnt <= {w}'d0;",
                "        else", "            cnt <= cnt + 1'b1;", "    end", "",
                f"    assign tick = (cnt == {w}'d{n - 1});"]
        summary = f"clock-enable generator that fires every {n} cycles"
        details = [f"Instead of a divided clock, produce `tick`, which is high for one `clk` cycle "
                   f"out of every {n}. An internal counter runs 0..{n - 1}; `tick` is high while it "
                   f"equals {n - 1}.",
                   f"{with_article(reset_words(r)).capitalize()} `{r['name']}` clears the counter."]
        explain = ("Generating an enable pulse keeps all logic on the original clock, "
                   "which is safer than a derived clock.")
        think = f"Count 0..{n - 1} with a {w}-bit counter and decode the last value as the tick."
        tag = f"tick{n}"
    code = "\n".join([header(name, ports)] + body + ["endmodule"])
    return dict(tag=tag, name=name, summary=summary, details=details, ports=ports, code=code,
                explain=explain, think=think)


def fam_gray(rng):
    kind = rng.choice(["bin2gray", "gray2bin", "counter"])
    w = rng.choice([3, 4, 5, 6, 8, 10, 12])
    if kind == "bin2gray":
        name = rng.choice([f"bin2gray{w}", f"binary_to_gray_{w}", "to_gray"])
        ports = [inp("bin", w, "binary value"), out("gray", w, "Gray code")]
        body = ["    assign gray = bin ^ (bin >> 1);"]
        summary = f"{w}-bit binary-to-Gray converter"
        details = ["Each Gray bit is the XOR of the corresponding binary bit and the next higher "
                   "binary bit; the MSB is copied."]
        explain = "XORing the value with itself shifted right by one produces the Gray code."
        think = "gray = bin ^ (bin >> 1); the MSB stays because the shifted-in bit is 0."
    elif kind == "gray2bin":
        name = rng.choice([f"gray2bin{w}", f"gray_to_binary_{w}", "from_gray"])
        ports = [inp("gray", w, "Gray code"), out("bin", w, "binary value", reg=True)]
        body = ["    integer i;", "", "    always @(*) begin", f"        for (i = 0; i < {w}; i = i + 1)",
                "            bin[i] = ^(gray >> i);", "    end"]
        summary = f"{w}-bit Gray-to-binary converter"
        details = ["Binary bit i is the XOR of all Gray bits from i up to the MSB."]
        explain = "Each binary bit is the XOR reduction of the Gray bits at and above its position."
        think = "bin[i] = XOR of gray[MSB:i]; writing it as ^(gray >> i) avoids a chain through bin itself."
    else:
        r = pick_reset(rng)
        name = rng.choice([f"gray_counter{w}", f"gray_cnt_{w}", "gray_code_counter"])
        ports = [CLK, reset_port(r), inp("en", desc="count enable"), out("gray", w, "count in Gray code")]
        body = [f"    reg [{w - 1}:0] bin_cnt;", "", f"    {always_ff(r)} begin",
                f"        if ({reset_cond(r)})", f"            bin_cnt <= {w}'d0;",
                "        else if (en)", "            bin_cnt <= bin_cnt + 1'b1;", "    end", "",
                "    assign gray = bin_cnt ^ (bin_cnt >> 1);"]
        summary = f"{w}-bit Gray-code counter"
        details = ["The counter advances through the Gray sequence (one bit changes per step) on "
                   "each rising clock edge while `en` is 1.",
                   f"{with_article(reset_words(r)).capitalize()} `{r['name']}` returns it to 0."]
        explain = "A binary counter advances and its value is converted to Gray code combinationally."
        think = "Simplest correct approach: count in binary, output bin ^ (bin >> 1)."
        kind = "counter"
    code = "\n".join([header(name, ports)] + body + ["endmodule"])
    return dict(tag=f"{kind}_w{w}", name=name, summary=summary, details=details, ports=ports,
                code=code, explain=explain, think=think)


def fam_regfile(rng):
    depth = rng.choice([4, 8, 16, 32])
    w = rng.choice([8, 16, 32])
    a = clog2(depth)
    two = rng.random() < 0.6
    reset = rng.random() < 0.4
    sync_read = not two and rng.random() < 0.4
    name = rng.choice([f"regfile_{depth}x{w}", f"reg_file{depth}", f"rf_{depth}x{w}"])
    ports = [CLK]
    if reset:
        ports.append(inp("rst", desc="synchronous active-high reset; clears every register"))
    ports += [inp("we", desc="write enable"), inp("waddr", a, "write address"),
              inp("wdata", w, "write data")]
    reads = ["0", "1"] if two else [""]
    for s in reads:
        ports.append(inp(f"raddr{s}", a, "read address"))
    for s in reads:
        ports.append(out(f"rdata{s}", w, "read data", reg=sync_read))
    body = [f"    reg [{w - 1}:0] regs [0:{depth - 1}];", ""]
    if reset:
        body += ["    integer i;", "", "    always @(posedge clk) begin", "        if (rst) begin",
                 f"            for (i = 0; i < {depth}; i = i + 1)", f"                regs[i] <= {w}'d0;",
                 "        end else if (we) begin", "            regs[waddr] <= wdata;", "        end",
                 "    end"]
    else:
        body += ["    always @(posedge clk) begin", "        if (we)",
                 "            regs[waddr] <= wdata;", "    end"]
    body.append("")
    if sync_read:
        body += ["    always @(posedge clk)", "        rdata <= regs[raddr];"]
    else:
        body += [f"    assign rdata{s} = regs[raddr{s}];" for s in reads]
    code = "\n".join([header(name, ports)] + body + ["endmodule"])
    summary = f"{depth}-entry, {w}-bit register file"
    rd = ("one synchronous read port (`rdata` is registered on the clock edge)" if sync_read else
          f"{'two' if two else 'one'} asynchronous (combinational) read port{'s' if two else ''}")
    details = [f"The register file has {depth} registers of {w} bits, one write port "
               f"(written on the rising clock edge when `we` is 1) and {rd}."]
    if reset:
        details.append("`rst` clears all registers to zero.")
    explain = "The storage is a reg array; writes happen in a clocked block and reads index the array."
    think = (f"{depth} entries need {a}-bit addresses. "
             + ("Reads are combinational so they are plain continuous assignments. " if not sync_read
                else "The read is registered, so it goes in a clocked block. ")
             + ("Reset needs a for loop over the array." if reset
                else "No reset was asked for, which suits RAM inference."))
    return dict(tag=f"{depth}x{w}{'_2r' if two else ''}", name=name, summary=summary,
                details=details, ports=ports, code=code, explain=explain, think=think)


def fam_fifo(rng):
    depth = rng.choice([4, 8, 16])
    w = rng.choice([8, 16, 32])
    a = clog2(depth)
    fwft = rng.random() < 0.5
    r = {"sync": True, "high": rng.random() < 0.5, "name": ""}
    r["name"] = "rst" if r["high"] else "rst_n"
    has_count = rng.random() < 0.4
    name = rng.choice([f"sync_fifo_{depth}x{w}", f"fifo{depth}", "small_fifo"])
    ports = [CLK, reset_port(r), inp("wr_en", desc="write request"), inp("din", w, "write data"),
             inp("rd_en", desc="read request"), out("dout", w, "read data", reg=not fwft),
             out("full", desc="FIFO is full"), out("empty", desc="FIFO is empty")]
    if has_count:
        ports.append(out("count", a + 1, "number of stored words", reg=True))
    cnt = "count" if has_count else "used"
    body = [f"    reg [{w - 1}:0] mem [0:{depth - 1}];", f"    reg [{a - 1}:0] wr_ptr, rd_ptr;"]
    if not has_count:
        body.append(f"    reg [{a}:0] used;")
    body += ["", "    wire do_write = wr_en && !full;", "    wire do_read  = rd_en && !empty;", "",
             f"    assign full  = ({cnt} == {a + 1}'d{depth});", f"    assign empty = ({cnt} == {a + 1}'d0);"]
    if fwft:
        body.append("    assign dout  = mem[rd_ptr];")
    body += ["", "    always @(posedge clk) begin", "        if (do_write)",
             "            mem[wr_ptr] <= din;"]
    if not fwft:
        body += ["        if (do_read)", "            dout <= mem[rd_ptr];"]
    body += ["    end", "", "    always @(posedge clk) begin", f"        if ({reset_cond(r)}) begin",
             f"            wr_ptr <= {a}'d0;", f"            rd_ptr <= {a}'d0;",
             f"            {cnt} <= {a + 1}'d0;", "        end else begin",
             "            if (do_write) wr_ptr <= wr_ptr + 1'b1;",
             "            if (do_read)  rd_ptr <= rd_ptr + 1'b1;",
             f"            if (do_write && !do_read) {cnt} <= {cnt} + 1'b1;",
             f"            if (do_read && !do_write) {cnt} <= {cnt} - 1'b1;",
             "        end", "    end"]
    code = "\n".join([header(name, ports)] + body + ["endmodule"])
    summary = f"synchronous FIFO, {depth} deep and {w} bits wide"
    read = ("`dout` always shows the oldest stored word (first-word fall-through); a read "
            "removes it." if fwft else
            "A read loads the oldest word into the registered output `dout` on the clock edge.")
    details = ["Writes with `wr_en` are ignored when `full`; reads with `rd_en` are ignored when "
               "`empty`. Reading and writing in the same cycle is allowed.", read,
               f"Use {with_article(reset_words(r))} `{r['name']}` that empties the FIFO."]
    if has_count:
        details.append("`count` reports how many words are stored.")
    explain = ("Read and write pointers wrap around a small memory, and an occupancy counter "
               "gives the full and empty flags.")
    think = (f"Depth {depth} means {a}-bit pointers that wrap naturally. Tracking the occupancy in a "
             f"{a + 1}-bit counter avoids the full/empty ambiguity of equal pointers. Guard writes "
             f"with !full and reads with !empty.")
    return dict(tag=f"{depth}x{w}{'_fwft' if fwft else ''}", name=name, summary=summary,
                details=details, ports=ports, code=code, explain=explain, think=think)


ALU_OPS = {
    "ADD": ("{a} + {b}", "{a} + {b}"),
    "SUB": ("{a} - {b}", "{a} - {b}"),
    "AND": ("{a} & {b}", "bitwise AND"),
    "OR": ("{a} | {b}", "bitwise OR"),
    "XOR": ("{a} ^ {b}", "bitwise XOR"),
    "NOR": ("~({a} | {b})", "bitwise NOR"),
    "NOTA": ("~{a}", "bitwise NOT of {a}"),
    "SLL1": ("{a} << 1", "{a} shifted left by one"),
    "SRL1": ("{a} >> 1", "{a} shifted right by one (logical)"),
    "SLT": ("({a} < {b}) ? {one} : {zero}", "1 if {a} < {b} (unsigned) else 0"),
    "PASSB": ("{b}", "{b} unchanged"),
    "INC": ("{a} + 1'b1", "{a} + 1"),
}


def fam_alu(rng):
    w = rng.choice([4, 8, 16, 32])
    nops = rng.choice([4, 8])
    ops = rng.sample(sorted(ALU_OPS), nops)
    s = clog2(nops)
    sv = rng.random() < 0.25
    zero_flag = rng.random() < 0.6
    a, b = rng.choice([("a", "b"), ("x", "y"), ("src1", "src2")])
    name = rng.choice([f"alu{w}", f"simple_alu_{w}", f"alu_{nops}op"])
    ports = [inp(a, w, "operand A"), inp(b, w, "operand B"), inp("op", s, "operation select"),
             out("result", w, "result", reg=True)]
    if zero_flag:
        ports.append(out("zero", desc="1 when result is 0"))
    fmt = dict(a=a, b=b, one=f"{w}'d1", zero=f"{w}'d0")
    body = [f"    {always_comb(sv)} begin", "        case (op)"]
    table = []
    for i, op in enumerate(ops):
        expr, words = ALU_OPS[op]
        body.append(f"            {s}'d{i}: result = {expr.format(**fmt)};")
        table.append(f"{i}: {words.format(**fmt)}")
    body += [f"            default: result = {w}'d0;", "        endcase", "    end"]
    if zero_flag:
        body += ["", f"    assign zero = (result == {w}'d0);"]
    code = "\n".join([header(name, ports, sv)] + body + ["endmodule"])
    summary = f"{w}-bit ALU with {nops} operations"
    details = [f"`op` selects the operation: {'; '.join(table)}. Results are truncated to {w} bits."]
    if zero_flag:
        details.append("`zero` is 1 whenever `result` is all zeros.")
    explain = "A case statement on `op` inside a combinational block selects the operation result."
    think = (f"{nops} operations need a {s}-bit opcode. A combinational case statement with a "
             f"default keeps it latch-free{'; the zero flag is a compare on the result' if zero_flag else ''}.")
    return dict(tag=f"w{w}_{nops}op", name=name, summary=summary, details=details, ports=ports,
                code=code, explain=explain, think=think, sv=sv)


def fam_popcount(rng):
    kind = rng.choice(["ones", "ones", "zeros", "registered", "threshold"])
    w = rng.choice([4, 5, 7, 8, 12, 16, 31, 32])
    s = clog2(w + 1)
    d = rng.choice(["data", "in", "vec"])
    name = rng.choice([f"popcount{w}", f"count_ones_{w}", f"bit_count{w}"])
    if kind == "zeros":
        name = rng.choice([f"count_zeros_{w}", f"zero_count{w}"])
    ports = []
    if kind == "registered":
        r = pick_reset(rng)
        ports += [CLK, reset_port(r)]
    ports.append(inp(d, w, "input vector"))
    bit = f"~{d}[i]" if kind == "zeros" else f"{d}[i]"
    if kind == "threshold":
        k = rng.randint(2, w - 1)
        ports.append(out("at_least", desc=f"1 when {d} has {k} or more bits set"))
    else:
        ports.append(out("count", s, "number of " + ("zero" if kind == "zeros" else "one") + " bits",
                         reg=True))
    tgt = "ones" if kind in ("threshold", "registered") else "count"
    body = []
    if kind in ("threshold", "registered"):
        body.append(f"    reg [{s - 1}:0] ones;")
    body += ["    integer i;", "", "    always @(*) begin", f"        {tgt} = {s}'d0;",
             f"        for (i = 0; i < {w}; i = i + 1)",
             f"            {tgt} = {tgt} + {{{{{s - 1}{{1'b0}}}}, {bit}}};", "    end"]
    if kind == "registered":
        body += ["", f"    {always_ff(r)} begin", f"        if ({reset_cond(r)})",
                 f"            count <= {s}'d0;", "        else", "            count <= ones;", "    end"]
    elif kind == "threshold":
        body += ["", f"    assign at_least = (ones >= {s}'d{k});"]
    code = "\n".join([header(name, ports)] + body + ["endmodule"])
    what = "0 bits" if kind == "zeros" else "1 bits"
    if kind == "threshold":
        summary = f"{w}-bit threshold detector ({k} or more ones)"
        details = [f"`at_least` is 1 when at least {k} bits of `{d}` are 1."]
    else:
        summary = f"{w}-bit population counter" if kind != "zeros" else f"{w}-bit zero counter"
        details = [f"`count` holds how many {what} `{d}` contains (0 to {w})."]
        if kind == "registered":
            details.append(f"The count is registered on the rising edge of `clk`; {with_article(reset_words(r))} "
                           f"`{r['name']}` clears it.")
    explain = f"A for loop adds up the {what} one at a time into a {s}-bit sum."
    think = (f"Up to {w} ones need {s} bits. Each bit is zero-extended to {s} bits before adding, so "
             f"the loop sum cannot overflow.")
    return dict(tag=f"{kind}_w{w}", name=name, summary=summary, details=details, ports=ports,
                code=code, explain=explain, think=think)


def barrel_stages(w, left, rotate, a, amt):
    """Log-depth mux stages for a shift/rotate by amt."""
    lines, prev = [], a
    for k in range(clog2(w)):
        n = 1 << k
        cur = f"s{k}"
        if left:
            fill = f"{prev}[{w - 1}:{w - n}]" if rotate else f"{n}'d0"
            moved = f"{{{prev}[{w - 1 - n}:0], {fill}}}"
        else:
            fill = f"{prev}[{n - 1}:0]" if rotate else f"{n}'d0"
            moved = f"{{{fill}, {prev}[{w - 1}:{n}]}}"
        lines.append(f"    wire [{w - 1}:0] {cur} = {amt}[{k}] ? {moved} : {prev};")
        prev = cur
    return lines, prev


def fam_barrel(rng):
    kind = rng.choice(["sll", "srl", "rol", "ror", "sra", "dir", "multi"])
    w = rng.choice([8, 16, 32] if kind != "multi" else [8, 16])
    s = clog2(w)
    a = rng.choice(["a", "din", "data"])
    amt = rng.choice(["shamt", "amt", "sh"])
    name = rng.choice([f"barrel_{kind}{w}", f"shifter_{kind}_{w}", f"{kind}_shift{w}"])
    ports = [inp(a, w, "data in"), inp(amt, s, "shift amount")]
    if kind == "dir":
        ports.append(inp("left", desc="1 = shift left, 0 = shift right (logical)"))
    if kind == "multi":
        ports.append(inp("op", 2, "00 shift left, 01 logical right, 10 arithmetic right, 11 rotate left"))
    ports.append(out("y", w, "result", reg=kind == "multi"))
    if kind in ("sll", "srl", "rol", "ror") and rng.random() < 0.5:
        body, last = barrel_stages(w, kind in ("sll", "rol"), kind in ("rol", "ror"), a, amt)
        body += ["", f"    assign y = {last};"]
        style = "stages"
    else:
        style = "operator"
        rot = f"({a} << {amt}) | ({a} >> ({w} - {amt}))"
        line = {"sll": f"{a} << {amt}", "srl": f"{a} >> {amt}", "sra": f"$signed({a}) >>> {amt}",
                "rol": rot, "ror": f"({a} >> {amt}) | ({a} << ({w} - {amt}))",
                "dir": f"left ? ({a} << {amt}) : ({a} >> {amt})"}.get(kind)
        if kind == "multi":
            body = ["    always @(*) begin", "        case (op)",
                    f"            2'b00: y = {a} << {amt};", f"            2'b01: y = {a} >> {amt};",
                    f"            2'b10: y = $signed({a}) >>> {amt};", f"            default: y = {rot};",
                    "        endcase", "    end"]
        else:
            body = [f"    assign y = {line};"]
    code = "\n".join([header(name, ports)] + body + ["endmodule"])
    what = {"sll": "logical left shift", "srl": "logical right shift", "rol": "left rotate",
            "ror": "right rotate", "sra": "arithmetic right shift (sign bit copied in)",
            "dir": "logical shift left or right", "multi": "shift/rotate unit"}[kind]
    short = {"sll": "logical left shifts", "srl": "logical right shifts", "rol": "left rotation",
             "ror": "right rotation", "sra": "arithmetic right shifts",
             "dir": "left/right logical shifts", "multi": "shifts and rotation"}[kind]
    summary = f"{w}-bit barrel shifter for {short}"
    details = [f"`y` is `{a}` after {with_article(what)} by `{amt}` positions (0 to {w - 1})."]
    if kind == "multi":
        details = [f"`op` chooses the operation on `{a}` by `{amt}` positions: 00 logical left "
                   f"shift, 01 logical right shift, 10 arithmetic right shift, 11 rotate left."]
    if kind == "dir":
        details.append("`left` chooses the direction; vacated bits are filled with 0.")
    explain = ("Each stage conditionally moves the data by a power of two, so the shift takes "
               f"{s} levels of 2:1 muxes." if style == "stages" else
               "The Verilog shift operators describe the shifter directly; synthesis builds the mux tree.")
    think = ("An arithmetic shift needs a signed operand: $signed(x) >>> n; mixing it with unsigned "
             "terms in one expression would make it logical, so each case assigns separately."
             if kind in ("sra", "multi") else
             f"{with_article(f'{w}-bit').capitalize()} barrel shifter has {s} stages (shift by 1, 2, 4, ...); "
             f"a rotate refills from the bits that fall off.")
    return dict(tag=f"{kind}{w}", name=name, summary=summary, details=details, ports=ports,
                code=code, explain=explain, think=think)


FAMILIES = [
    ("counter", fam_counter),
    ("modn_counter", fam_modn),
    ("mux", fam_mux),
    ("addsub", fam_addsub),
    ("shift_register", fam_shift),
    ("decoder", fam_decoder),
    ("encoder", fam_encoder),
    ("comparator", fam_compare),
    ("fsm_sequence_detector", fam_fsm),
    ("parity", fam_parity),
    ("edge_detector", fam_edge),
    ("clock_divider", fam_clkdiv),
    ("gray_code", fam_gray),
    ("register_file", fam_regfile),
    ("fifo", fam_fifo),
    ("alu", fam_alu),
    ("popcount", fam_popcount),
    ("barrel_shifter", fam_barrel),
]


def make_sft_rows():
    rows = []
    for family, make in FAMILIES:
        rng = random.Random(f"{SEED}:{family}")
        seen = set()
        attempts = 0
        while len(seen) < ROWS_PER_FAMILY:
            attempts += 1
            if attempts > 2000:
                raise RuntimeError(f"family {family}: not enough distinct rows")
            item = make(rng)
            if item["code"] in seen:
                continue
            seen.add(item["code"])
            index = len(seen) - 1
            prompt = render_prompt(rng, item["name"], item["summary"], item["details"],
                                   item["ports"], item.get("sv", False))
            response = r1_response(item, answer_tags=(len(rows) + 1) % NO_ANSWER_TAGS_EVERY != 0)
            if len(response) > MAX_RESPONSE_CHARS:
                raise RuntimeError(f"{family}: response too long ({len(response)} chars)")
            rows.append({"id": f"{family}_{item['tag']}_{index:03d}", "family": family,
                         "system": R1_SYSTEM_PROMPT, "prompt": prompt, "response": response})
    return rows


def r1_response(item, answer_tags=True):
    """A response in the CodeV-R1 form: reasoning in <think>, then the explanation and the fenced code."""
    answer = f"{item['explain']}\n\n```verilog\n{item['code']}\n```"
    if answer_tags:
        answer = f"<answer>\n{answer}\n</answer>"
    return f"<think>\n{item['think']}\n</think>\n{answer}"


def make_rl_rows(sft_rows):
    """RL rows in the verl schema the CodeV-R1 RL parquet files use: a chat prompt (system + user), and the
    reference Verilog as the rule-based reward's ground truth. Drawn from the same templates with their own seed;
    no row repeats an SFT module."""
    taken = {row["response"].split("```verilog\n", 1)[1].split("\n```", 1)[0] for row in sft_rows}
    splits = {"train": [], "validation": []}
    for f, (family, make) in enumerate(FAMILIES):
        rng = random.Random(f"{SEED}:rl:{family}")
        wanted = {"train": RL_TRAIN_PER_FAMILY, "validation": 1 if f % RL_VAL_EVERY == 0 else 0}
        for split, n in wanted.items():
            while n:
                item = make(rng)
                if item["code"] in taken:
                    continue
                taken.add(item["code"])
                prompt = render_prompt(rng, item["name"], item["summary"], item["details"],
                                       item["ports"], item.get("sv", False))
                rows = splits[split]
                rows.append({
                    "data_source": "codev",
                    "prompt": [{"role": "system", "content": R1_SYSTEM_PROMPT}, {"role": "user", "content": prompt}],
                    "ability": "verilog",
                    "reward_model": {"style": "rule", "ground_truth": item["code"]},
                    "extra_info": {"split": split, "index": len(rows)},
                })
                n -= 1
    return splits


# ---------------------------------------------------------------------------
# Held-out eval problems (VerilogEval v2 spec-to-RTL form)
#
# ports: (direction, name, width, is_reg_in_reference)
# init:  tb statements run at time 0 (sequential problems assert reset here)
# stim:  tb statements run once per cycle at the falling clock edge; they may
#        use the loop counter `cycle`. Outputs are compared 2 time units after
#        each stimulus change and again at the next falling edge.
# ---------------------------------------------------------------------------

EVAL_PROBLEMS = [
    dict(
        task="Prob001_majority3", kind="combinational",
        desc="3-input majority gate",
        ports=[("input", "a", 1, False), ("input", "b", 1, False), ("input", "c", 1, False),
               ("output", "y", 1, False)],
        text=["The output y should be 1 when at least two of the three inputs a, b and c are "
              "1, and 0 otherwise."],
        ref="""    assign y = (a & b) | (a & c) | (b & c);""",
        init="{a, b, c} = 3'b000;", stim="{a, b, c} = cycle;", n=16),
    dict(
        task="Prob002_mux3_8bit", kind="combinational",
        desc="8-bit 3-way multiplexer with a zero output for the unused select value",
        ports=[("input", "a", 8, False), ("input", "b", 8, False), ("input", "c", 8, False),
               ("input", "sel", 2, False), ("output", "out", 8, True)],
        text=["The module is a combinational multiplexer. When sel is 0, out should be a; "
              "when sel is 1, out should be b; when sel is 2, out should be c. When sel is 3, "
              "out should be 0."],
        ref="""    always @(*) begin
        case (sel)
            2'd0: out = a;
            2'd1: out = b;
            2'd2: out = c;
            default: out = 8'd0;
        endcase
    end""",
        init="a = 0; b = 0; c = 0; sel = 0;",
        stim="a = $random; b = $random; c = $random; sel = $random;", n=200),
    dict(
        task="Prob003_sat_add8", kind="combinational",
        desc="8-bit unsigned saturating adder with an overflow flag",
        ports=[("input", "a", 8, False), ("input", "b", 8, False), ("output", "sum", 8, False),
               ("output", "overflow", 1, False)],
        text=["Add the unsigned 8-bit numbers a and b. If the true sum fits in 8 bits, sum "
              "should be the true sum and overflow should be 0. If the true sum is larger than "
              "255, sum should saturate at 255 (8'hff) and overflow should be 1."],
        ref="""    wire [8:0] full = a + b;
    assign overflow = full[8];
    assign sum = full[8] ? 8'hff : full[7:0];""",
        init="a = 0; b = 0;", stim="a = $random; b = $random;", n=300),
    dict(
        task="Prob004_abs_diff6", kind="combinational",
        desc="absolute difference of two 6-bit unsigned numbers",
        ports=[("input", "a", 6, False), ("input", "b", 6, False), ("output", "diff", 6, False),
               ("output", "b_larger", 1, False)],
        text=["Treat a and b as unsigned numbers. diff should be the absolute value of their "
              "difference, |a - b|. b_larger should be 1 when b is strictly greater than a, "
              "and 0 otherwise."],
        ref="""    assign b_larger = (b > a);
    assign diff = b_larger ? (b - a) : (a - b);""",
        init="a = 0; b = 0;", stim="{a, b} = cycle;", n=4096),
    dict(
        task="Prob005_leading_zeros8", kind="combinational",
        desc="count of leading zero bits in an 8-bit word",
        ports=[("input", "in", 8, False), ("output", "zeros", 4, True)],
        text=["zeros should be the number of consecutive 0 bits at the most significant end "
              "of in, before the first 1 bit. For example in = 8'b00010110 gives 3 and "
              "in = 8'b10000000 gives 0. When in is all zeros, zeros should be 8."],
        ref="""    integer i;
    reg found;
    always @(*) begin
        zeros = 4'd0;
        found = 1'b0;
        for (i = 7; i >= 0; i = i - 1) begin
            if (in[i])
                found = 1'b1;
            else if (!found)
                zeros = zeros + 4'd1;
        end
    end""",
        init="in = 0;", stim="in = cycle;", n=256),
    dict(
        task="Prob006_lowest_set_bit6", kind="combinational",
        desc="position and mask of the lowest set bit of a 6-bit word",
        ports=[("input", "in", 6, False), ("output", "pos", 3, True), ("output", "mask", 6, False),
               ("output", "valid", 1, False)],
        text=["Find the lowest-numbered bit of in that is 1. pos should be its index (0 to 5) "
              "and mask should be a 6-bit value with only that bit set. valid should be 1 when "
              "in has at least one bit set. When in is 0, pos, mask and valid should all be 0."],
        ref="""    integer i;
    always @(*) begin
        pos = 3'd0;
        for (i = 5; i >= 0; i = i - 1)
            if (in[i])
                pos = i;
    end
    assign mask = in & (~in + 6'd1);
    assign valid = |in;""",
        init="in = 0;", stim="in = cycle;", n=64),
    dict(
        task="Prob007_bcd_digit_inc", kind="combinational",
        desc="BCD digit incrementer with carry and invalid-digit handling",
        ports=[("input", "d", 4, False), ("input", "inc", 1, False), ("output", "q", 4, True),
               ("output", "carry", 1, True)],
        text=["d is one BCD digit (0 to 9). When inc is 0, q should equal d and carry should be "
              "0. When inc is 1, q should be d + 1, except that 9 wraps around to 0 and then "
              "carry should be 1 (carry is 0 in every other case).",
              "If d is not a valid BCD digit (10 to 15), q and carry should both be 0 "
              "regardless of inc."],
        ref="""    always @(*) begin
        q = 4'd0;
        carry = 1'b0;
        if (d <= 4'd9) begin
            if (!inc)
                q = d;
            else if (d == 4'd9)
                carry = 1'b1;
            else
                q = d + 4'd1;
        end
    end""",
        init="d = 0; inc = 0;", stim="{d, inc} = cycle;", n=32),
    dict(
        task="Prob008_bit_reverse10", kind="combinational",
        desc="10-bit bit reversal with a palindrome flag",
        ports=[("input", "in", 10, False), ("output", "out", 10, True),
               ("output", "palindrome", 1, False)],
        text=["out should be in with its bit order reversed: out[0] = in[9], out[1] = in[8], "
              "..., out[9] = in[0]. palindrome should be 1 when the reversed vector equals in "
              "itself, and 0 otherwise."],
        ref="""    integer i;
    always @(*)
        for (i = 0; i < 10; i = i + 1)
            out[i] = in[9 - i];
    assign palindrome = (out == in);""",
        init="in = 0;",
        stim="in = $random; if (cycle % 4 == 0) in[4:0] = {in[5], in[6], in[7], in[8], in[9]};",
        n=300),
    dict(
        task="Prob009_gray_next4", kind="combinational",
        desc="next value in the 4-bit Gray code sequence",
        ports=[("input", "g", 4, False), ("output", "next", 4, False)],
        text=["g is a 4-bit reflected binary Gray code. next should be the Gray code of the "
              "following value in the counting sequence, i.e. convert g to binary, add 1 "
              "(modulo 16) and convert back to Gray code. For example g = 4'b0000 gives "
              "4'b0001, g = 4'b0001 gives 4'b0011 and g = 4'b1000 (binary 15) gives 4'b0000."],
        ref="""    wire [3:0] b = {g[3], g[3] ^ g[2], g[3] ^ g[2] ^ g[1], g[3] ^ g[2] ^ g[1] ^ g[0]};
    wire [3:0] b1 = b + 4'd1;
    assign next = b1 ^ (b1 >> 1);""",
        init="g = 0;", stim="g = cycle;", n=16),
    dict(
        task="Prob010_min3_u8", kind="combinational",
        desc="minimum of three unsigned 8-bit values and its index",
        ports=[("input", "a", 8, False), ("input", "b", 8, False), ("input", "c", 8, False),
               ("output", "min_val", 8, True), ("output", "idx", 2, True)],
        text=["min_val should be the smallest of the unsigned numbers a, b and c. idx tells "
              "which input it came from: 0 for a, 1 for b, 2 for c. When several inputs share "
              "the smallest value, idx should name the first of them in the order a, b, c."],
        ref="""    always @(*) begin
        min_val = a;
        idx = 2'd0;
        if (b < min_val) begin
            min_val = b;
            idx = 2'd1;
        end
        if (c < min_val) begin
            min_val = c;
            idx = 2'd2;
        end
    end""",
        init="a = 0; b = 0; c = 0;",
        stim=("a = $random; b = $random; c = $random; if (cycle % 5 == 0) b = a; "
              "if (cycle % 7 == 0) c = a; if (cycle % 6 == 1) c = b;"),
        n=300),
    dict(
        task="Prob011_hex_to_7seg_n", kind="combinational",
        desc="hex digit to active-low seven-segment pattern",
        ports=[("input", "hex", 4, False), ("output", "seg_n", 7, True)],
        text=["Drive a common-anode seven-segment display: a segment is lit when its output "
              "bit is 0. seg_n[0] drives segment a, seg_n[1] segment b, and so on up to "
              "seg_n[6] for segment g.",
              "The lit segments for each value of hex are: 0: a b c d e f; 1: b c; "
              "2: a b d e g; 3: a b c d g; 4: b c f g; 5: a c d f g; 6: a c d e f g; 7: a b c; "
              "8: all segments; 9: a b c d f g; A: a b c e f g; b: c d e f g; C: a d e f; "
              "d: b c d e g; E: a d e f g; F: a e f g."],
        ref="""    always @(*) begin
        case (hex)
            4'h0: seg_n = ~7'h3f;
            4'h1: seg_n = ~7'h06;
            4'h2: seg_n = ~7'h5b;
            4'h3: seg_n = ~7'h4f;
            4'h4: seg_n = ~7'h66;
            4'h5: seg_n = ~7'h6d;
            4'h6: seg_n = ~7'h7d;
            4'h7: seg_n = ~7'h07;
            4'h8: seg_n = ~7'h7f;
            4'h9: seg_n = ~7'h6f;
            4'ha: seg_n = ~7'h77;
            4'hb: seg_n = ~7'h7c;
            4'hc: seg_n = ~7'h39;
            4'hd: seg_n = ~7'h5e;
            4'he: seg_n = ~7'h79;
            default: seg_n = ~7'h71;
        endcase
    end""",
        init="hex = 0;", stim="hex = cycle;", n=32),
    dict(
        task="Prob012_onehot_check8", kind="combinational",
        desc="classify an 8-bit word as zero, one-hot or multi-hot",
        ports=[("input", "in", 8, False), ("output", "zero", 1, False),
               ("output", "onehot", 1, False), ("output", "multi", 1, False)],
        text=["Exactly one of the three outputs should be 1. zero is 1 when no bit of in is "
              "set, onehot is 1 when exactly one bit is set, and multi is 1 when two or more "
              "bits are set."],
        ref="""    assign zero   = (in == 8'd0);
    assign onehot = !zero && ((in & (in - 8'd1)) == 8'd0);
    assign multi  = !zero && !onehot;""",
        init="in = 0;",
        stim="in = $random; if (cycle % 3 == 1) in = 8'd1 << (cycle % 8); if (cycle % 17 == 0) in = 8'd0;",
        n=300),
    dict(
        task="Prob013_rotate8_dir", kind="combinational",
        desc="8-bit rotator, left or right by a 3-bit amount",
        ports=[("input", "data", 8, False), ("input", "amt", 3, False), ("input", "left", 1, False),
               ("output", "out", 8, False)],
        text=["out should be data rotated by amt positions (0 to 7). When left is 1 rotate "
              "towards the most significant bit (bits leaving at bit 7 re-enter at bit 0); "
              "when left is 0 rotate towards the least significant bit (bits leaving at bit 0 "
              "re-enter at bit 7)."],
        ref="""    wire [15:0] dl = {data, data} << amt;
    wire [15:0] dr = {data, data} >> amt;
    assign out = left ? dl[15:8] : dr[7:0];""",
        init="data = 0; amt = 0; left = 0;",
        stim="data = $random; amt = $random; left = $random;", n=300),
    dict(
        task="Prob014_alu4_flags", kind="combinational",
        desc="4-bit ALU (add, subtract, and, xor) with zero and carry flags",
        ports=[("input", "a", 4, False), ("input", "b", 4, False), ("input", "op", 2, False),
               ("output", "y", 4, True), ("output", "zero", 1, False), ("output", "carry", 1, True)],
        text=["op selects the operation on the unsigned inputs a and b: 0 gives y = a + b, "
              "1 gives y = a - b, 2 gives y = a & b and 3 gives y = a ^ b (y keeps the low 4 "
              "bits).",
              "carry is the carry out of the addition for op 0, the borrow for op 1 (1 when "
              "a < b), and 0 for ops 2 and 3. zero is 1 when y is 0."],
        ref="""    always @(*) begin
        carry = 1'b0;
        case (op)
            2'd0: {carry, y} = a + b;
            2'd1: {carry, y} = {1'b0, a} - {1'b0, b};
            2'd2: y = a & b;
            default: y = a ^ b;
        endcase
    end
    assign zero = (y == 4'd0);""",
        init="a = 0; b = 0; op = 0;", stim="{op, a, b} = cycle;", n=1024),
    dict(
        task="Prob015_count_3_to_12", kind="sequential",
        desc="counter that counts from 3 to 12 with enable and synchronous reset",
        ports=[("input", "clk", 1, False), ("input", "reset", 1, False), ("input", "en", 1, False),
               ("output", "q", 4, True)],
        text=["Build a 4-bit counter that counts 3, 4, 5, ..., 12 and then wraps back to 3. "
              "It advances by one on each clock edge when en is 1 and holds its value when en "
              "is 0. reset is active high and synchronous, and resets the counter to 3."],
        ref="""    always @(posedge clk) begin
        if (reset)
            q <= 4'd3;
        else if (en)
            q <= (q == 4'd12) ? 4'd3 : q + 4'd1;
    end""",
        init="reset = 1; en = 0;",
        stim="reset = ($random & 63) == 0; en = ($random & 3) != 0;", n=400),
    dict(
        task="Prob016_updown_sat4", kind="sequential",
        desc="4-bit saturating up/down counter with asynchronous active-low reset",
        ports=[("input", "clk", 1, False), ("input", "areset_n", 1, False), ("input", "up", 1, False),
               ("input", "down", 1, False), ("output", "q", 4, True)],
        text=["Build a 4-bit counter. On each clock edge: if up is 1 and down is 0 the counter "
              "increments, but it stays at 15 instead of wrapping; if down is 1 and up is 0 it "
              "decrements, but it stays at 0 instead of wrapping; otherwise it holds.",
              "areset_n is an active-low asynchronous reset that sets q to 0 immediately."],
        ref="""    always @(posedge clk or negedge areset_n) begin
        if (!areset_n)
            q <= 4'd0;
        else if (up && !down && q != 4'd15)
            q <= q + 4'd1;
        else if (down && !up && q != 4'd0)
            q <= q - 4'd1;
    end""",
        init="areset_n = 0; up = 0; down = 0;",
        stim="""areset_n = ($random & 63) != 0;
if ((cycle / 50) % 2 == 0) begin  // mostly counting up
    up = ($random & 3) != 0;
    down = ($random & 3) == 0;
end else begin                    // mostly counting down
    up = ($random & 3) == 0;
    down = ($random & 3) != 0;
end""",
        n=400),
    dict(
        task="Prob017_detect_0110", kind="sequential",
        desc="Moore detector for the overlapping serial sequence 0110",
        ports=[("input", "clk", 1, False), ("input", "reset", 1, False), ("input", "in", 1, False),
               ("output", "z", 1, False)],
        text=["The input in is a serial bit stream sampled on each clock edge. Build a Moore "
              "state machine whose output z is 1 for one clock cycle after the four most "
              "recent samples (oldest first) were 0, 1, 1, 0. Overlapping occurrences count: "
              "the final 0 of one occurrence may be the first 0 of the next.",
              "reset is active high and synchronous; it returns the machine to the state in "
              "which no part of the sequence has been seen."],
        ref="""    localparam S0 = 3'd0, S1 = 3'd1, S2 = 3'd2, S3 = 3'd3, S4 = 3'd4;
    reg [2:0] state, next;
    always @(*) begin
        case (state)
            S0: next = in ? S0 : S1;
            S1: next = in ? S2 : S1;
            S2: next = in ? S3 : S1;
            S3: next = in ? S0 : S4;
            S4: next = in ? S2 : S1;
            default: next = S0;
        endcase
    end
    always @(posedge clk) begin
        if (reset)
            state <= S0;
        else
            state <= next;
    end
    assign z = (state == S4);""",
        init="reset = 1; in = 0;",
        stim="reset = ($random & 255) == 0; in = $random;", n=1000),
    dict(
        task="Prob018_rise_counter", kind="sequential",
        desc="rising-edge pulse and 6-bit rising-edge counter",
        ports=[("input", "clk", 1, False), ("input", "reset", 1, False), ("input", "sig", 1, False),
               ("output", "rise", 1, False), ("output", "count", 6, True)],
        text=["Keep a one-bit register prev that stores the value of sig sampled at the "
              "previous clock edge. rise is combinational: it is 1 when sig is 1 and prev is 0.",
              "count is a 6-bit counter that increments (wrapping from 63 to 0) at each clock "
              "edge at which rise is 1. reset is active high and synchronous and clears both "
              "prev and count to 0."],
        ref="""    reg prev;
    assign rise = sig & ~prev;
    always @(posedge clk) begin
        if (reset) begin
            prev <= 1'b0;
            count <= 6'd0;
        end else begin
            prev <= sig;
            if (rise)
                count <= count + 6'd1;
        end
    end""",
        init="reset = 1; sig = 0;",
        stim="reset = ($random & 255) == 0; sig = $random;", n=600),
    dict(
        task="Prob019_debounce3", kind="sequential",
        desc="debouncer that accepts a new level after 3 consecutive differing samples",
        ports=[("input", "clk", 1, False), ("input", "reset", 1, False), ("input", "noisy", 1, False),
               ("output", "clean", 1, True)],
        text=["clean follows noisy, but only after noisy has been different from clean at "
              "three consecutive clock edges. Use a small counter: at each clock edge, if noisy "
              "equals clean the counter is cleared; otherwise, if the counter is already 2, "
              "clean takes the value of noisy and the counter is cleared; otherwise the counter "
              "increments.",
              "reset is active high and synchronous and clears clean and the counter to 0."],
        ref="""    reg [1:0] cnt;
    always @(posedge clk) begin
        if (reset) begin
            clean <= 1'b0;
            cnt <= 2'd0;
        end else if (noisy == clean) begin
            cnt <= 2'd0;
        end else if (cnt == 2'd2) begin
            clean <= noisy;
            cnt <= 2'd0;
        end else begin
            cnt <= cnt + 2'd1;
        end
    end""",
        init="reset = 1; noisy = 0;",
        stim="reset = ($random & 255) == 0; if (($random & 7) == 0) noisy = ~noisy;", n=600),
    dict(
        task="Prob020_lfsr5", kind="sequential",
        desc="5-bit Fibonacci LFSR with enable",
        ports=[("input", "clk", 1, False), ("input", "reset", 1, False), ("input", "en", 1, False),
               ("output", "q", 5, True)],
        text=["Build a 5-bit linear feedback shift register. On each clock edge where en is 1, "
              "q shifts left by one position and the new q[0] is q[4] XOR q[2] (computed from "
              "the old value). When en is 0, q holds.",
              "reset is active high and synchronous and loads q with 5'b00001."],
        ref="""    always @(posedge clk) begin
        if (reset)
            q <= 5'b00001;
        else if (en)
            q <= {q[3:0], q[4] ^ q[2]};
    end""",
        init="reset = 1; en = 0;",
        stim="reset = ($random & 127) == 0; en = ($random & 7) != 0;", n=400),
    dict(
        task="Prob021_pulse_stretch4", kind="sequential",
        desc="retriggerable pulse stretcher holding the output for 4 cycles",
        ports=[("input", "clk", 1, False), ("input", "reset", 1, False), ("input", "trig", 1, False),
               ("output", "busy", 1, False)],
        text=["When trig is 1 at a clock edge, busy should become 1 and stay 1 for exactly four "
              "clock cycles. If trig is 1 again while busy is 1, the four-cycle period starts "
              "again from that edge. Implement it with a 3-bit down-counter that is loaded "
              "with 4 when trig is 1, otherwise decrements while it is not zero; busy is 1 "
              "whenever the counter is not zero.",
              "reset is active high and synchronous and clears the counter."],
        ref="""    reg [2:0] cnt;
    always @(posedge clk) begin
        if (reset)
            cnt <= 3'd0;
        else if (trig)
            cnt <= 3'd4;
        else if (cnt != 3'd0)
            cnt <= cnt - 3'd1;
    end
    assign busy = (cnt != 3'd0);""",
        init="reset = 1; trig = 0;",
        stim="reset = ($random & 127) == 0; trig = ($random & 15) == 0;", n=500),
    dict(
        task="Prob022_serial_adder", kind="sequential",
        desc="bit-serial adder with a carry register",
        ports=[("input", "clk", 1, False), ("input", "reset", 1, False), ("input", "a", 1, False),
               ("input", "b", 1, False), ("output", "s", 1, False), ("output", "c", 1, True)],
        text=["Two numbers arrive one bit per clock cycle, least significant bit first, on a "
              "and b. c is a register that holds the carry from the previous bit position. "
              "The sum bit s is combinational: s = a XOR b XOR c. At each clock edge c is "
              "updated to the carry out of a + b + c.",
              "reset is active high and synchronous and clears c."],
        ref="""    assign s = a ^ b ^ c;
    always @(posedge clk) begin
        if (reset)
            c <= 1'b0;
        else
            c <= (a & b) | (a & c) | (b & c);
    end""",
        init="reset = 1; a = 0; b = 0;",
        stim="reset = (cycle % 16) == 15; a = $random; b = $random;", n=400),
    dict(
        task="Prob023_ones_run_length", kind="sequential",
        desc="saturating length of the current run of 1s on a serial input",
        ports=[("input", "clk", 1, False), ("input", "reset", 1, False), ("input", "in", 1, False),
               ("output", "run", 4, True)],
        text=["run counts how many consecutive clock edges have sampled in as 1. At each clock "
              "edge, if in is 0 run becomes 0; if in is 1 run increments, but it stays at 15 "
              "instead of wrapping.",
              "reset is active high and synchronous and clears run."],
        ref="""    always @(posedge clk) begin
        if (reset || !in)
            run <= 4'd0;
        else if (run != 4'd15)
            run <= run + 4'd1;
    end""",
        init="reset = 1; in = 0;",
        stim="reset = ($random & 255) == 0; in = ($random & 7) != 0; if ((cycle / 50) % 3 == 1) in = 1;",
        n=500),
    dict(
        task="Prob024_fifo4x8", kind="sequential",
        desc="4-entry, 8-bit first-word-fall-through FIFO with count",
        ports=[("input", "clk", 1, False), ("input", "reset", 1, False), ("input", "push", 1, False),
               ("input", "pop", 1, False), ("input", "din", 8, False), ("output", "dout", 8, False),
               ("output", "count", 3, True), ("output", "full", 1, False),
               ("output", "empty", 1, False)],
        text=["Build a synchronous FIFO that stores up to 4 bytes. count is the number of "
              "stored bytes (0 to 4), full is 1 when count is 4 and empty is 1 when count is 0.",
              "At a clock edge a push (push = 1) is accepted only if the FIFO is not full, and "
              "a pop (pop = 1) is accepted only if it is not empty; both checks use the state "
              "before the edge, so a push into a full FIFO is ignored even when pop is also 1. "
              "An accepted push stores din; an accepted pop removes the oldest byte. Both may "
              "be accepted at the same edge.",
              "dout is combinational: it shows the oldest stored byte, or 0 when the FIFO is "
              "empty. reset is active high and synchronous and empties the FIFO."],
        ref="""    reg [7:0] mem [0:3];
    reg [1:0] rd_ptr, wr_ptr;
    wire do_push = push && (count != 3'd4);
    wire do_pop  = pop && (count != 3'd0);
    assign full  = (count == 3'd4);
    assign empty = (count == 3'd0);
    assign dout  = empty ? 8'd0 : mem[rd_ptr];
    always @(posedge clk) begin
        if (reset) begin
            rd_ptr <= 2'd0;
            wr_ptr <= 2'd0;
            count <= 3'd0;
        end else begin
            if (do_push) begin
                mem[wr_ptr] <= din;
                wr_ptr <= wr_ptr + 2'd1;
            end
            if (do_pop)
                rd_ptr <= rd_ptr + 2'd1;
            count <= count + do_push - do_pop;
        end
    end""",
        init="reset = 1; push = 0; pop = 0; din = 0;",
        stim="""reset = ($random & 255) == 0;
din = $random;
if ((cycle / 40) % 2 == 0) begin  // mostly filling
    push = ($random & 3) != 0;
    pop = ($random & 3) == 0;
end else begin                    // mostly draining
    push = ($random & 3) == 0;
    pop = ($random & 3) != 0;
end""",
        n=500),
    dict(
        task="Prob025_tick_div5", kind="sequential",
        desc="enable-gated tick generator firing once every 5 counted cycles",
        ports=[("input", "clk", 1, False), ("input", "reset", 1, False), ("input", "en", 1, False),
               ("output", "tick", 1, False)],
        text=["An internal counter steps through 0, 1, 2, 3, 4, 0, 1, ... advancing by one at "
              "each clock edge where en is 1 and holding when en is 0. tick is 1 while the "
              "counter value is 4 (whether or not en is 1).",
              "reset is active high and synchronous and sets the counter to 0."],
        ref="""    reg [2:0] cnt;
    always @(posedge clk) begin
        if (reset)
            cnt <= 3'd0;
        else if (en)
            cnt <= (cnt == 3'd4) ? 3'd0 : cnt + 3'd1;
    end
    assign tick = (cnt == 3'd4);""",
        init="reset = 1; en = 0;",
        stim="reset = ($random & 127) == 0; en = ($random & 3) != 0;", n=400),
    dict(
        task="Prob026_regfile4x8_r0zero", kind="sequential",
        desc="4x8 register file with a hard-wired zero register and two read ports",
        ports=[("input", "clk", 1, False), ("input", "reset", 1, False), ("input", "we", 1, False),
               ("input", "waddr", 2, False), ("input", "wdata", 8, False), ("input", "raddr0", 2, False),
               ("input", "raddr1", 2, False), ("output", "rdata0", 8, False),
               ("output", "rdata1", 8, False)],
        text=["The register file holds four 8-bit registers, numbered 0 to 3. At a clock edge "
              "where we is 1, wdata is written into register waddr, except that writes to "
              "register 0 are ignored: register 0 always reads as 0.",
              "The two read ports are combinational: rdata0 shows register raddr0 and rdata1 "
              "shows register raddr1 (during a write they show the old value until the clock "
              "edge). reset is active high and synchronous and clears all registers to 0."],
        ref="""    reg [7:0] r1, r2, r3;
    always @(posedge clk) begin
        if (reset) begin
            r1 <= 8'd0;
            r2 <= 8'd0;
            r3 <= 8'd0;
        end else if (we) begin
            case (waddr)
                2'd1: r1 <= wdata;
                2'd2: r2 <= wdata;
                2'd3: r3 <= wdata;
                default: ;
            endcase
        end
    end
    assign rdata0 = (raddr0 == 2'd1) ? r1 : (raddr0 == 2'd2) ? r2 : (raddr0 == 2'd3) ? r3 : 8'd0;
    assign rdata1 = (raddr1 == 2'd1) ? r1 : (raddr1 == 2'd2) ? r2 : (raddr1 == 2'd3) ? r3 : 8'd0;""",
        init="reset = 1; we = 0; waddr = 0; wdata = 0; raddr0 = 0; raddr1 = 0;",
        stim=("reset = ($random & 255) == 0; we = $random; waddr = $random; wdata = $random; "
              "raddr0 = $random; raddr1 = $random;"),
        n=400),
    dict(
        task="Prob027_running_parity", kind="sequential",
        desc="running odd-parity flag of a serial stream with a clear input",
        ports=[("input", "clk", 1, False), ("input", "reset", 1, False), ("input", "clear", 1, False),
               ("input", "in", 1, False), ("output", "odd", 1, True)],
        text=["odd should be 1 when an odd number of 1s has been sampled on in since the last "
              "reset or clear. At each clock edge: if reset or clear is 1, odd becomes 0; "
              "otherwise odd becomes odd XOR in. Both reset and clear are active high and "
              "synchronous."],
        ref="""    always @(posedge clk) begin
        if (reset || clear)
            odd <= 1'b0;
        else
            odd <= odd ^ in;
    end""",
        init="reset = 1; clear = 0; in = 0;",
        stim="reset = ($random & 255) == 0; clear = ($random & 31) == 0; in = $random;", n=400),
    dict(
        task="Prob028_load_down_timer", kind="sequential",
        desc="loadable 6-bit down-counting timer with a done flag",
        ports=[("input", "clk", 1, False), ("input", "reset", 1, False), ("input", "load", 1, False),
               ("input", "value", 6, False), ("output", "count", 6, True), ("output", "done", 1, False)],
        text=["At each clock edge: if load is 1, count is loaded with value; otherwise, if "
              "count is not 0 it decrements by one (it stops at 0). done is 1 whenever count is "
              "0.",
              "reset is active high and synchronous, has priority over load, and clears count."],
        ref="""    always @(posedge clk) begin
        if (reset)
            count <= 6'd0;
        else if (load)
            count <= value;
        else if (count != 6'd0)
            count <= count - 6'd1;
    end
    assign done = (count == 6'd0);""",
        init="reset = 1; load = 0; value = 0;",
        stim="reset = ($random & 127) == 0; load = reset ? $random : (($random & 31) == 0); value = $random;",
        n=600),
]


def interface_lines(ports):
    lines = []
    for direction, name, width, _ in ports:
        size = f" ({width} bits)" if width > 1 else ""
        lines.append(f" - {direction:<6} {name}{size}")
    return "\n".join(lines)


def make_eval_prompt(p):
    parts = ["I would like you to implement a module named TopModule with the following\n"
             "interface. All input and output ports are one bit unless otherwise\nspecified.",
             interface_lines(p["ports"])]
    parts += [textwrap.fill(t, width=78) for t in p["text"]]
    if p["kind"] == "sequential":
        parts.append("Assume all sequential logic is triggered on the positive edge of the clock.")
    return "\n\n".join(parts) + "\n"


def make_eval_ref(p):
    decls = []
    for direction, name, width, is_reg in p["ports"]:
        kind = " reg" if is_reg else ""
        decls.append(f"    {direction}{kind} {vec(width)}{name}")
    return ("module RefModule (\n" + ",\n".join(decls) + "\n);\n\n" + p["ref"] +
            "\n\nendmodule\n")


def make_eval_test(p):
    ins = [(n, w) for d, n, w, _ in p["ports"] if d == "input" and n != "clk"]
    outs = [(n, w) for d, n, w, _ in p["ports"] if d == "output"]
    conn_ref = ", ".join([f".{n}({n})" for d, n, w, _ in p["ports"] if d == "input"] +
                         [f".{n}({n}_ref)" for n, _ in outs])
    conn_dut = ", ".join([f".{n}({n})" for d, n, w, _ in p["ports"] if d == "input"] +
                         [f".{n}({n}_dut)" for n, _ in outs])
    refs = "{" + ", ".join(f"{n}_ref" for n, _ in outs) + "}"
    duts = "{" + ", ".join(f"{n}_dut" for n, _ in outs) + "}"
    stim = "\n".join("            " + line for line in p["stim"].splitlines())
    lines = [
        f"// Testbench for {p['task']}: drives TopModule and RefModule with the same",
        "// stimulus and counts the samples where their outputs differ.",
        "`timescale 1ns/1ps",
        "",
        "module tb();",
        "    reg clk = 1'b0;",
        "    always #5 clk = ~clk;",
        "",
    ]
    lines += [f"    reg {vec(w)}{n};" for n, w in ins]
    lines += [f"    wire {vec(w)}{n}_ref, {n}_dut;" for n, w in outs]
    lines += [
        "",
        "    integer errors = 0;",
        "    integer samples = 0;",
        "    integer cycle;",
        "",
        f"    RefModule good1 ({conn_ref});",
        f"    TopModule top_module1 ({conn_dut});",
        "",
        "    // An X in the reference matches anything; an X from TopModule matches only X.",
        "    task check;",
        "        begin",
        "            samples = samples + 1;",
        f"            if ({refs} !== ({refs} ^ {duts} ^ {refs}))",
        "                errors = errors + 1;",
        "        end",
        "    endtask",
        "",
        "    initial begin",
        f"        {p['init']}",
        "        @(negedge clk);",
        "        @(negedge clk);",
        f"        for (cycle = 0; cycle < {p['n']}; cycle = cycle + 1) begin",
        stim,
        "            #2 check;",
        "            @(negedge clk);",
        "            check;",
        "        end",
        '        $display("Mismatches: %1d in %1d samples", errors, samples);',
        "        $finish;",
        "    end",
        "",
        "    initial begin",
        '        #1000000 $display("TIMEOUT");',
        "        $finish;",
        "    end",
        "endmodule",
    ]
    return "\n".join(lines) + "\n"


README = """\
# Shipped Verilog data

Small, self-written data for the Verilog fine-tuning walkthrough. Every item
was produced by `tools/make_verilog_data.py` from hand-written, parameterised
templates; nothing is copied from CodeV-R1, VerilogEval or any other dataset.
The files are under the same licence as the rest of this project.

## `verilog_sft.jsonl`

{rows} instruction/response pairs in the CodeV-R1 SFT schema (`system`,
`prompt`, `response`, the three columns of the real `codev_r1_sft.jsonl`), one
JSON object per line:

- `system`: the same self-written R1-style system prompt on every row (reason
  in `<think>`, answer in `<answer>`). What the real field holds is not
  published; the training profiles do not send it (`DataSpec.system`).
- `prompt`: a natural-language request for one Verilog module, naming the
  module and its ports.
- `response`: in the real form, a `<think>...</think>` reasoning paragraph,
  then `<answer>...</answer>` around a short explanation and exactly one
  fenced ```` ```verilog ```` block holding a complete, synthesizable module.
  Every tenth row ({no_answer_rows} rows) has the reasoning but no `<answer>`
  tags.
- `id`: unique row id, e.g. `counter_up_w8_003`.
- `family`: the template family ({families} families: {family_list}).

## `codev_r1_replica/`

A replica of the layout of the Hugging Face dataset repository
`zhuyaoyu/CodeV-R1-dataset`, so that the loader's real call,
`datasets.load_dataset(<repo>, "sft", split="train")`, runs offline:

- `README.md`: a YAML header declaring the configs `sft` (split `train`:
  `codev_r1_sft.jsonl`) and `rl` (splits `train` and `validation`: the two
  parquet files), with no default config, as the real one does.
- `codev_r1_sft.jsonl`: the same {rows} rows as `verilog_sft.jsonl`.
- `codev_r1_rl_train.parquet` ({rl_train} rows) and `codev_r1_rl_val.parquet`
  ({rl_val} rows): RL rows in the verl schema of the real files
  (`data_source`, `prompt` as chat messages, `ability`, `reward_model` with the
  reference Verilog as `ground_truth`, `extra_info`), from the same templates
  with their own seed.

## `eval/`

{problems} held-out spec-to-RTL problems in the VerilogEval v2 layout, with
different widths and behaviours from the training templates:

- `<task_id>_prompt.txt`: the spec; the answer must be `module TopModule`.
- `<task_id>_ref.sv`: the reference solution, `module RefModule`.
- `<task_id>_test.sv`: testbench `tb` comparing `TopModule` with `RefModule`;
  it ends by printing `Mismatches: N in M samples`.
- `problems.jsonl`: `task_id`, `kind` (combinational/sequential) and a
  one-line `description` per problem.

A sample passes when

    iverilog -Wall -Winfloop -Wno-timescale -g2012 -s tb -o bin sample.sv test.sv ref.sv
    vvp bin

prints `Mismatches: 0 in M samples` with M > 0.

## Regenerating

    python tools/make_verilog_data.py            # writes gemma_tpu_helpers/data
    python tools/make_verilog_data.py --out DIR  # writes somewhere else

The generator uses a fixed seed, so its output is reproducible: byte for byte
for the text files, row for row for the parquet files (pyarrow writes its own
version into them). `tests/fast/test_shipped_data.py` checks that the shipped files
match it.
"""

REPLICA_README = """\
---
license: cc-by-sa-4.0
configs:
- config_name: sft
  data_files:
  - split: train
    path: codev_r1_sft.jsonl
- config_name: rl
  data_files:
  - split: train
    path: codev_r1_rl_train.parquet
  - split: validation
    path: codev_r1_rl_val.parquet
---

# CodeV-R1 dataset layout (replica)

A small, self-written stand-in for `zhuyaoyu/CodeV-R1-dataset` with the same
files, configs and columns, written by `tools/make_verilog_data.py`. None of
its rows come from the real dataset. Load it as the real one:

    datasets.load_dataset("<this directory>", "sft", split="train")
    datasets.load_dataset("<this directory>", "rl", split="validation")

Without a config name, `datasets` raises "Config name is missing", as it does
for the real repository.
"""


def write_all(out_dir):
    out_dir = Path(out_dir)
    eval_dir = out_dir / "eval"
    eval_dir.mkdir(parents=True, exist_ok=True)

    rows = make_sft_rows()
    write_jsonl(out_dir / "verilog_sft.jsonl", rows)

    index = []
    for p in EVAL_PROBLEMS:
        files = {"_prompt.txt": make_eval_prompt(p), "_ref.sv": make_eval_ref(p),
                 "_test.sv": make_eval_test(p)}
        for suffix, text in files.items():
            (eval_dir / f"{p['task']}{suffix}").write_text(text, encoding="utf-8", newline="\n")
        index.append({"task_id": p["task"], "kind": p["kind"], "description": p["desc"]})
    with open(eval_dir / "problems.jsonl", "w", encoding="utf-8", newline="\n") as f:
        for item in index:
            f.write(json.dumps(item) + "\n")

    rl = write_replica(out_dir / REPLICA, rows)

    families = [name for name, _ in FAMILIES]
    readme = README.format(rows=len(rows), families=len(families),
                           family_list=", ".join(families), problems=len(EVAL_PROBLEMS),
                           no_answer_rows=sum("<answer>" not in r["response"] for r in rows),
                           rl_train=len(rl["train"]), rl_val=len(rl["validation"]))
    (out_dir / "README.md").write_text(readme, encoding="utf-8", newline="\n")
    return len(rows), len(EVAL_PROBLEMS)


def write_jsonl(path, rows):
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def write_replica(replica_dir, sft_rows):
    """The CodeV-R1 repository layout: README with the two configs, the SFT jsonl, the RL parquet files."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    replica_dir.mkdir(parents=True, exist_ok=True)
    (replica_dir / "README.md").write_text(REPLICA_README, encoding="utf-8", newline="\n")
    write_jsonl(replica_dir / "codev_r1_sft.jsonl", sft_rows)
    rl = make_rl_rows(sft_rows)
    for split, name in (("train", "codev_r1_rl_train.parquet"), ("validation", "codev_r1_rl_val.parquet")):
        pq.write_table(pa.Table.from_pylist(rl[split]), replica_dir / name)
    return rl


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(DEFAULT_OUT),
                        help="output directory (default: gemma_tpu_helpers/data)")
    args = parser.parse_args()
    rows, problems = write_all(args.out)
    print(f"wrote {rows} SFT rows and {problems} eval problems to {args.out}")


if __name__ == "__main__":
    main()
