"""Merged weights and export formats."""
