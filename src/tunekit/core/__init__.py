"""Shared ground: errors, output directories, state files, processes, hardware, hidden noise, progress."""
