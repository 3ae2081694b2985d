"""VerilogEval: the problems, the simulator, sampling, pass@k."""
