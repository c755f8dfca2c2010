"""Tool use: the tool calls, tool results and schemas of chat records, the calls read back from a model's text, and
the episodes that run them, for training (GRPO, RLOO) and evaluation alike."""
