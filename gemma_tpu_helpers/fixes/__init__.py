"""The fixes: each porting fix as a module that travels alone (plain arguments in, plain results out).

Copy a fix with what it imports from this folder and nothing else; ``gemma_tpu_helpers/__init__.py`` lists the
layers, and each notebook's "Copy into your project" line names the files."""
