"""Reading and placing the model: the checkpoint's config and layout, the tunix Gemma 4 loader, the mesh, the sharding
audit, the parity check, the chat template."""
