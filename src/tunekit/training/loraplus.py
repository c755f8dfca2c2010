"""LoRA+ (lora.lr_ratio): the optimizer of every tunekit trainer built by peft with the B matrices at a higher
learning rate."""

from __future__ import annotations

from transformers import Trainer


class LoraPlusOptimizer:
    """Mixin for transformers.Trainer and its subclasses (TRL's trainers): LoRA+ through peft's optimizer builder."""

    loraplus_lr_ratio: float | None = None  # lora.lr_ratio (LoRA+); set by the runner on every method's trainer

    def create_optimizer(self, model=None):
        """The recipe's optimizer; with LoRA+, built by peft with the B matrices at lr x ratio, for every
        method's trainer (none of TRL's overrides this). The Trainer calls this under DeepSpeed too, unless the
        DeepSpeed config brings its own optimizer (refused with LoRA+ when the recipe is loaded)."""
        if self.loraplus_lr_ratio is None or self.optimizer is not None:
            return super().create_optimizer(model)
        from peft.optimizers import create_loraplus_optimizer

        optimizer_cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(self.args, self.model)
        kwargs = dict(kwargs)
        self.optimizer = create_loraplus_optimizer(self.model, optimizer_cls, lr=kwargs.pop("lr"),
                                                   loraplus_lr_ratio=self.loraplus_lr_ratio,
                                                   loraplus_weight_decay=self.args.weight_decay, **kwargs)
        return self.optimizer
