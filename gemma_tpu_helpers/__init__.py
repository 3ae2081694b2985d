"""gemma_tpu_helpers: the course's helpers, in two tiers and twelve stage folders you can see in the file tree.

``fixes/``: the porting fixes, each a module that travels alone: plain arguments in (a model, a config dict, a path,
the spec dataclass beside it: ``LoraSpec``, ``TrainSpec``, ``DataSpec``, ``ServeSpec``), plain results out. No fix
reads the course's profiles, run directories, caches or environment (``course/config/paths.py`` does, and passes them
down). Stages: ``core`` (errors, files, HTTP), ``model``, ``train``, ``export`` (the merge), ``serve``, ``eval``.
Copy a fix with what it imports from ``fixes/``, keeping the folders: each notebook's "Copy into your project" line
names the files.

``course/``: the course on top. Stages: ``config`` (paths, profiles, runs, the Hub, the tiny replica, the base
checkpoint), ``views`` (the notebooks' tables and plots), ``budget`` (memory, the AOT plan, predictions, cost),
``training`` (training runs, the learning check, equivalence), ``front`` (logbook, Colab, preflight, site, workshop,
exercises) and ``commands`` (the CLI, run by ``__main__``).

The course imports the fixes, never the other way round; a module imports from its own folder or a folder before it
in ``TIERS``. ``tests/fast/test_architecture.py`` checks both, and that there is no import cycle and no private
import.
"""

# (tier, its folders), lowest first: the layers are these folders, in this order, and a module is in the layer of the
# folder it sits in. A module imports from its own folder or from a folder before it (every fix folder comes before
# the course's); the CLI (``__main__``) sits on top. JAX, torch and vLLM are imported inside functions (heavy or in
# another venv); everything else at the top of a module, so the import graph is what the file says.
TIERS = (
    ("fixes", ("core", "model", "train", "export", "serve", "eval")),
    ("course", ("config", "views", "budget", "training", "front", "commands")),
)
