"""The run directory: its layout, the record in run.json, checkpoints resume can trust."""
