"""tunekit's version, as pyproject.toml gives it (tunekit.__version__ reads it here; so do the commands and cards)."""

VERSION = "0.1.0"
