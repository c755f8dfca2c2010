"""Sequence parallelism (training.parallelism.sp, DeepSpeed's Ulysses): each process holds a piece of every row.
What the Trainer needs to resume past the pieces it trained and to average the loss over the pieces."""

from __future__ import annotations

import torch


def skip_first_batches(dataloader, num_batches: int = 0):
    """accelerate's skip_first_batches, which the Trainer calls on resuming mid-epoch, and which cannot skip
    DeepSpeed's Ulysses loader (training.parallelism.sp; it is no DataLoader): that one is told to skip its first
    `num_batches` pieces once the Trainer has set the epoch (follow_epochs)."""
    from accelerate import skip_first_batches as accelerate_skip

    if not hasattr(dataloader, "sp_world_size"):  # a DataLoader, not DeepSpeed's UlyssesSPDataLoaderAdapter
        return accelerate_skip(dataloader, num_batches)
    dataloader.skip = num_batches
    return dataloader


def follow_epochs(adapter) -> None:
    """DeepSpeed's Ulysses loader has no set_epoch, so a resumed run would read every epoch in the first epoch's
    order (the loader it wraps counts epochs only as it goes through them). Given one: the wrapped loader is set
    to the epoch and read anew, past the pieces a resumed epoch skips, every process of the group gathering the
    same batches as it goes."""
    def set_epoch(epoch: int) -> None:
        adapter.dl.set_epoch(epoch)
        adapter.iter = iter(adapter.dl)
        adapter.micro_batches.clear()
        for _ in range(adapter.__dict__.pop("skip", 0)):
            next(adapter)

    adapter.set_epoch = set_epoch


def over_sequence_pieces(total: torch.Tensor, trained: int, averaged: bool) -> torch.Tensor:
    """The mean loss over every trained token of the rows a sequence-parallel group shares, from this process's
    summed loss over its piece (`total`, `trained` tokens). Its gradient is this piece's share, scaled to what
    DeepSpeed 0.19.8 does with the group's gradients (`averaged`), measured at sp 2 against one process: ZeRO-2
    sums them (stage_1_and_2.py divides by the world over sp; ZeRO-1's too), ZeRO-3 with reduce_scatter (its
    default) averages them (reduce_scatter_coalesced divides by the whole world: the gradient norm was half one
    process's); without reduce_scatter it sums them as ZeRO-2 does. transformers' deepspeed_sp_compute_loss, a
    mean gathered differentiably, gave twice the norm under ZeRO-2. Its value is the whole mean, for the log."""
    import torch.distributed as dist
    from deepspeed.utils import groups

    group = groups._get_sequence_parallel_group()
    count = torch.tensor(float(trained), dtype=total.dtype, device=total.device)
    dist.all_reduce(count, group=group)
    scale = dist.get_world_size(group) if averaged else 1
    share = total / count.clamp(min=1) * scale
    whole = share.detach().clone()
    dist.all_reduce(whole, group=group)
    whole /= scale
    return share + (whole - share.detach())
