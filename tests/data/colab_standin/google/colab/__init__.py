"""A stand-in for Colab's ``google.colab`` package, for tests/e2e/test_colab_first_cells.py: the two parts the
notebooks' first cells use (Secrets and Drive), with the real names, signatures and errors. Never installed; the test
puts it on PYTHONPATH of the process that runs the cells. Its state comes from environment variables the test sets."""
