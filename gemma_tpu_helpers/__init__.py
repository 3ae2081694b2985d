"""gemma_tpu_helpers: the course's helpers, in two tiers you can see in the file tree.

``fixes/``: the porting fixes, each a module that travels alone: plain arguments in (a model, a config dict, a path,
the spec dataclass beside it: ``LoraSpec``, ``TrainSpec``, ``DataSpec``, ``ServeSpec``), plain results out. No fix
reads the course's profiles, run directories, caches or environment (``course/paths.py`` does, and passes them down).
Copy a fix with what it imports from ``fixes/``: each notebook's "Copy into your project" line names the files.

``course/``: the course on top: profiles, run directories, the Hub and the base checkpoint, the tiny replica, caching,
training runs, the AOT plan, benchmarks and cost, preflight, the site, the workshop, the exercises and the CLI
(``cli`` and ``commands_*``, run by ``__main__``).

The course imports the fixes, never the other way round; inside a tier a module imports only from its own layer or
below. ``tests/fast/test_architecture.py`` checks both, and that there is no import cycle and no private import.
"""

# (tier, ((layer, modules), ...)), lowest first. JAX, torch and vLLM are imported inside functions (heavy or in
# another venv); everything else at the top of a module, so the import graph is what the file says.
TIERS = (
    ("fixes", (
        ("core", ("errors", "file_io", "process_groups", "http_client", "compat", "chat_format", "forward_inputs",
                  "partition_specs", "hf_checkpoint", "model_size")),
        ("models", ("gemma4", "layout", "chat_tokens", "packing", "data", "mesh", "multihost", "preemption")),
        ("step", ("expert_lora", "lora", "sharding", "parity", "remat", "sft", "step")),
        ("workflows", ("lora_checkpoint", "merge_plan", "safetensors_io", "merge", "weight_check", "verify",
                       "peft_export", "vllm_command", "vllm_client", "vllm_server", "greedy", "adapters",
                       "eval_problems", "eval_simulate", "eval_score", "eval_sample")),
    )),
    ("course", (
        ("config", ("paths", "profiles")),
        ("models", ("hub", "tiny", "base_model")),
        ("workflows", ("model_views", "data_views", "eval_views", "profile_steps", "train", "launch",
                       "learning_check", "param_memory", "plan", "predictions", "helper_overhead", "equivalence",
                       "serving_bench", "cost")),
        ("front", ("logbook", "colab", "preflight", "hardware_report", "site", "workshop", "exercises", "cli",
                   "commands_model", "commands_train", "commands_serve", "commands_course")),
    )),
)
# Every module as "<tier>.<module>" in its layer, lowest layer first; the CLI (``python -m gemma_tpu_helpers``) last.
LAYERS = tuple((f"{tier}.{layer}", tuple(f"{tier}.{m}" for m in mods)) for tier, layers in TIERS
               for layer, mods in layers) + (("cli", ("__main__",)),)
