"""The recipe: typed schema, loading and overrides; DeepSpeed config resolution."""
