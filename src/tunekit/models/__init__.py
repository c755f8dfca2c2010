"""Models: where they come from, the Hub, loading for training/merging/inference, model facts."""
