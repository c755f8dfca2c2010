"""DeepSpeed checkpoints written as safetensors (see checkpointfile for why).

DeepSpeed picks its checkpoint engine from its config, which offers no safetensors writer, and reads
its shards back with torch.load(weights_only=False). This engine replaces it on a built DeepSpeedEngine;
shard names keep DeepSpeed's pattern with .safetensors in place of .pt.
"""

from __future__ import annotations

import os

from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointEngine
from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
from deepspeed.utils.tensor_fragment import fragment_address

from tunekit.core import checkpointfile

checkpointfile.allow(LossScaler, DynamicLossScaler, fragment_address)  # in ZeRO-1/2 optimizer state


class SafetensorsCheckpointEngine(CheckpointEngine):
    def __init__(self):
        super().__init__()
        self.name = "tunekit-safetensors"

    def create(self, info):
        pass

    def save(self, state_dict, path: str):
        checkpointfile.save(state_dict, path)

    def load(self, path: str, map_location=None):
        return checkpointfile.load(path)  # tensors on CPU; DeepSpeed copies them to its partitions

    def commit(self, info):
        return True

    def preserves_storage_sharing(self):
        return False  # checkpointfile copies views itself; DeepSpeed need not clone every tensor first


def _safetensors_name(name_fn):
    def renamed(*args, **kwargs):
        root, ext = os.path.splitext(name_fn(*args, **kwargs))
        return root + ".safetensors" if ext == ".pt" else root + ext

    return renamed


def use_safetensors(engine) -> None:
    """Make a DeepSpeedEngine save and load its checkpoints through SafetensorsCheckpointEngine."""
    if isinstance(getattr(engine, "checkpoint_engine", None), SafetensorsCheckpointEngine):
        return
    engine.checkpoint_engine = SafetensorsCheckpointEngine()
    # Both the writer and the loader's glob build shard paths from these two methods.
    engine._get_ckpt_name = _safetensors_name(engine._get_ckpt_name)
    engine._get_rank_zero_ckpt_name = _safetensors_name(engine._get_rank_zero_ckpt_name)
    # zero_to_fp32.py, which DeepSpeed copies next to its shards, reads torch.save files only.
    engine._copy_recovery_script = lambda save_path: None
