"""tunekit's trainers: one top-level class per training method, each a subclass of TRL's trainer for the method
(or of tunekit's own Trainer) with tunekit's checkpoints and evaluations mixed in. They import torch and TRL at
their top, so the method modules (training.methods) import them inside `Method.trainer_class`, when a run starts."""
