"""gemma_tpu_helpers: the course's helpers, in two tiers you can see in the file tree.

``fixes/``: the porting fixes, each one a module that travels alone. A fix takes plain arguments (a model, a config
dict, a path, the small spec dataclass that lives beside it: ``LoraSpec`` in ``lora.py``, ``TrainSpec`` in
``step.py``, ``DataSpec`` in ``data.py``, ``ServeSpec`` in ``serve.py``) and returns plain results. No fix reads a
profile, a run directory, a cache or an environment variable of the course, downloads anything or builds the replica.
To copy a fix into your project, take its module and what it imports from ``fixes/`` (the notebooks' "Copy into your
project" lines name those files; ``tests/e2e/test_copy_fix.py`` copies them into an empty folder and runs them there).

``course/``: the course on top of the fixes. Profiles (composed of the fixes' spec dataclasses), run directories, the
Hub and the base checkpoint, the tiny replica, the ``ensure_*`` caching, training runs, the AOT plan, benchmarks and
cost, preflight, the site, the workshop, the exercises and the CLI's steps (``cli`` and ``commands_*``, run by
``__main__``).

The course imports the fixes, never the other way round. Inside each tier a module imports only from its own layer or
the ones below it. ``tests/fast/test_architecture.py`` checks both, and that there is no import cycle and no private name
imported from another module.
"""

# (tier, ((layer, modules), ...)), lowest first. JAX, torch and vLLM are imported inside functions (heavy or in
# another venv); everything else at the top of a module, so the import graph is what the file says.
TIERS = (
    ("fixes", (
        ("core", ("errors", "file_io", "process_groups", "http_client", "compat", "chat_format", "forward_inputs",
                  "partition_specs")),
        ("models", ("gemma4", "layout", "data", "mesh", "multihost", "preemption")),
        ("step", ("lora", "sharding", "parity", "remat", "step")),
        ("workflows", ("lora_checkpoint", "merge_plan", "safetensors_io", "merge", "weight_check", "verify",
                       "peft_export", "vllm_command", "vllm_client", "vllm_server", "greedy", "adapters",
                       "eval_problems", "eval_simulate", "eval_score", "eval_sample")),
    )),
    ("course", (
        ("config", ("paths", "profiles")),
        ("models", ("hub", "tiny", "base_model")),
        ("workflows", ("profile_steps", "train", "launch", "learning_check", "plan", "helper_overhead", "equivalence",
                       "serving_bench", "cost")),
        ("front", ("logbook", "preflight", "site", "workshop", "exercises", "cli", "commands_model",
                   "commands_train", "commands_serve", "commands_course")),
    )),
)
# Every module as "<tier>.<module>" in its layer, lowest layer first; the CLI (``python -m gemma_tpu_helpers``) last.
LAYERS = tuple((f"{tier}.{layer}", tuple(f"{tier}.{m}" for m in mods)) for tier, layers in TIERS
               for layer, mods in layers) + (("cli", ("__main__",)),)
