"""A mixture-of-experts model's routers while it trains: their load-balancing loss logged beside the loss, and at
each evaluation the tokens each layer's router sent to each expert, so that a collapsed router shows.

The loss itself is the model's own (`output_router_logits`, models.experts.balance_router): it is in the logged
loss; `aux_loss` is logged beside it, unweighted, as TRL's preference and GRPO trainers log theirs. The expert load
is counted by hooks on the routers over the evaluation's loss pass (the held-out batches), written one line per
evaluation to the run's expert-load file, and summed up as `eval_expert_imbalance`: the busiest expert's tokens over
the mean, the worst layer's (1: every expert as busy; experts / top-k: every token sent to the same few)."""

from __future__ import annotations

import contextlib
import json

import torch

from tunekit.models import experts
from tunekit.models.unwrap import base_of


class ExpertLoad:
    """Tokens per expert, per sparse layer, counted while active (padding positions left out)."""

    def __init__(self, model):
        base = base_of(model)
        found = experts.layout(base)
        self.routers = {} if found is None else {
            name: module for name, module in base.named_modules()
            if any(name == r or name.endswith(f".{r}") for r in found.routers)}
        self.count = found.count if found else 0
        self.top_k = found.top_k if found else 0
        self.tokens = {name: torch.zeros(self.count, dtype=torch.long) for name in self.routers}
        self._mask = None
        self._base = base

    def __bool__(self) -> bool:
        return bool(self.routers)

    @contextlib.contextmanager
    def counting(self):
        def keep_mask(_module, _args, kwargs):
            self._mask = kwargs.get("attention_mask")

        def counter(name):
            def hook(_module, _args, output):
                picked = output[2]  # (tokens, top_k): transformers' routers return (logits, scores, indices)
                mask = self._mask
                if mask is not None and mask.dim() == 2 and mask.numel() == picked.shape[0]:
                    picked = picked[mask.reshape(-1).bool()]
                self.tokens[name] += torch.bincount(picked.reshape(-1).cpu(), minlength=self.count)
            return hook

        handles = [self._base.register_forward_pre_hook(keep_mask, with_kwargs=True)]
        handles += [module.register_forward_hook(counter(name)) for name, module in self.routers.items()]
        try:
            yield self
        finally:
            for handle in handles:
                handle.remove()
            self._mask = None

    def imbalance(self) -> float:
        """The busiest expert's tokens over the mean tokens per expert, in the worst layer."""
        worst = 0.0
        for tokens in self.tokens.values():
            if tokens.sum() > 0:
                worst = max(worst, float(tokens.max()) / float(tokens.float().mean()))
        return worst

    def line(self, step: int) -> str:
        """One line of the expert-load file: the step, experts per token and each layer's tokens per expert."""
        return json.dumps({"step": step, "top_k": self.top_k,
                           "layers": {name: t.tolist() for name, t in self.tokens.items()}}) + "\n"


class RouterBalance:
    """Mixin for transformers.Trainer and its subclasses (TRL's trainers): the expert load at every evaluation
    of a mixture-of-experts model, and (for the trainers whose loss goes through `keep_aux_loss`) the router's
    auxiliary loss in the logs."""

    expert_load_file = None  # where each evaluation's expert load is appended (the run's file), set by the runner

    def keep_aux_loss(self, outputs, loss, num_items_in_batch):
        """The loss with the router's term at its coefficient, kept for the log. transformers adds coefficient x
        auxiliary loss to a loss normalized by the whole step's token count, which is then not divided by the
        accumulation steps and, tokens averaged across devices, is multiplied by the process count: the router's
        term would weigh accumulation x processes times its coefficient. It is scaled back here, so that a step
        weighs the mean of its micro-batches' auxiliary losses at the coefficient, however they are spread."""
        aux = outputs.get("aux_loss") if hasattr(outputs, "get") else None
        if aux is None:
            return loss
        if self.model.training:
            self.__dict__.setdefault("_aux_losses", []).append(aux.detach().float())
        if self.model_accepts_loss_kwargs and num_items_in_batch is not None:
            coef = self.accelerator.unwrap_model(self.model).config.get_text_config().router_aux_loss_coef
            spread, args = 1, self.args  # what Trainer.compute_loss multiplied the loss by
            if args.average_tokens_across_devices:
                spread = args.n_gpu if args.n_gpu > 1 else self.accelerator.num_processes // self.get_tp_size()
            steps = getattr(self, "current_gradient_accumulation_steps", self.args.gradient_accumulation_steps)
            loss = loss + coef * aux.to(loss.dtype) * (1 / steps - spread)
        return loss

    def log(self, logs: dict, *args, **kwargs) -> None:
        kept = self.__dict__.pop("_aux_losses", None)
        if kept and "loss" in logs:
            mean = torch.stack(kept).mean().to(self.args.device)
            logs["aux_loss"] = round(float(self.accelerator.gather_for_metrics(mean[None]).mean()), 4)
        super().log(logs, *args, **kwargs)

    def evaluation_loop(self, dataloader, description, prediction_loss_only=None, ignore_keys=None,
                        metric_key_prefix="eval"):
        load = ExpertLoad(self.model)
        if not load:
            return super().evaluation_loop(dataloader, description, prediction_loss_only, ignore_keys,
                                           metric_key_prefix)
        with load.counting():
            output = super().evaluation_loop(dataloader, description, prediction_loss_only, ignore_keys,
                                             metric_key_prefix)
        for name, tokens in load.tokens.items():  # every process's share of the held-out batches
            load.tokens[name] = self.accelerator.reduce(tokens.to(self.args.device), "sum").cpu()
        output.metrics[f"{metric_key_prefix}_expert_imbalance"] = round(load.imbalance(), 4)
        if self.expert_load_file is not None and self.is_world_process_zero():
            with open(self.expert_load_file, "a", encoding="utf-8") as f:
                f.write(load.line(self.state.global_step))
        return output
