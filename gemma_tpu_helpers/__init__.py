"""gemma_tpu_helpers: the course's helpers, in layers. A module imports only from its own layer or the ones
below it (``tests/test_architecture.py`` checks it, and that there is no import cycle and no private name imported
from another module). To copy a helper into your project, take its module and what it imports from the layers
below; the notebooks' "Use it in your project" cells name those files.

1. ``core``: no imports from this package. The error base class, atomic writes / log tails / hashes / the HTTP
   client / process supervision, library compatibility checks, the Gemma 4 chat format as plain data.
2. ``config``: the profiles (every hyperparameter).
3. ``models``: Gemma 4 configs and the loader, the tiny replica, the Hub, the base checkpoint a profile uses,
   meshes, multi-host, the data pipeline, the LoRA layout table (tunix <-> HF).
4. ``step``: LoRA application, sharding, logits parity, remat policies and the one train step.
5. ``workflows``: train, plan (AOT), overhead, equivalence, merge (+ the LoRA checkpoint reader, the merge plan,
   safetensors streaming, the streamed weight check, verify, PEFT
   export), serve (+ its greedy parity check and LoRA
   adapter tools), evaluate, bench, cost.
6. ``course``: the notebooks' glue, preflight, the site, the workshop, the exercises, the CLI.
"""

# (layer, modules), lowest first. JAX, torch and vLLM are imported inside functions (heavy or in another venv);
# everything else at the top of a module, so the import graph is what the file says.
LAYERS = (
    ("core", ("errors", "infra", "compat", "chat_format")),
    ("config", ("profiles",)),
    ("models", ("gemma4", "tiny", "hub", "base_model", "mesh", "multihost", "data", "layout")),
    ("step", ("lora", "sharding", "parity", "remat", "step")),
    ("workflows", ("train", "plan", "overhead", "equivalence", "lora_checkpoint", "merge_plan", "safetensors_io",
                   "merge", "weight_check", "verify", "peft_export", "serve", "greedy", "adapters",
                   "evaluate", "bench", "cost")),
    ("course", ("course", "preflight", "site", "workshop", "exercises", "__main__")),
)
