"""Training runs: a profile's training, launching hosts, the learning check, the profile's steps, the GPU-recipe
equivalence, the helpers' overhead."""
