"""The training runner, the Trainer subclass, the loss path, checkpoints, trackers, methods/."""
