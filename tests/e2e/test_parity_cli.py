"""The parity step as a user runs it: `python -m gemma_tpu_helpers parity` on the tiny checkpoint (per layer, a failing
bound, an unknown profile), about 20 s of CLI runs. The parity arithmetic: tests/fast/test_load_and_parity.py."""

from support import run_cli


def test_cli_parity(tiny_dir):
    r = run_cli("parity", tiny_dir, "--layers", "--seq-len", "24")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "parity: OK" in r.stdout and "layer 5 (global)" in r.stdout
    r = run_cli("parity", tiny_dir, "--bound", "1e-12")
    assert r.returncode == 1 and "parity: FAILED" in r.stdout
    r = run_cli("parity", tiny_dir, "--profile", "nope")
    assert r.returncode == 2 and "smoke" in r.stderr
