"""Episodes with tools in GRPO's rollouts (grpo.tools, grpo.environment): what tunekit's GRPO trainer adds to
TRL's so that a sampled completion is an episode (tooluse.episodes): an episode per completion, its
environment reset from the record, played with tunekit's seeded sampling, the tool results' tokens masked out of
the loss (TRL's tool_mask), tool calls, failures and turns logged. TRL's own tool loop needs a chat template
that parses tool calls itself and runs tools without a timeout; this one reads calls as tunekit's metrics do and
renders results with the template tunekit trains with."""

from __future__ import annotations

import json


class ToolUse:
    """Mixed into training.trainers.rollouts.Rollouts; `toolkit` None leaves everything as TRL does it."""

    toolkit = None  # tooluse.episodes.Toolkit
    renderer = None  # data.mixture.Renderers that rendered the prompts
    episodes: list | None = None  # the batch being sampled

    def start_episodes(self, inputs: list[dict]) -> list[dict]:
        """An episode per completion, its environment reset from the record; a reset's text re-renders the
        prompt. Each input carries its episode to the rewards (TRL passes input columns to them)."""
        from tunekit.data.formats import Record

        self.episodes, out = [], []
        for x in inputs:
            values = json.loads(x["record"])
            episode = self.toolkit.start(values, x["where"])
            if episode.observation:
                x = dict(x, prompt=self.renderer.render(Record(values, x["where"]), episode.observation).prompt)
            self.episodes.append(episode)
            out.append(dict(x, episode=episode))
        return out

    def play(self, prompt_ids: list[list[int]]) -> list[list[int]]:
        """The episodes played to their end (tooluse.episodes.run) with tunekit's seeded sampling; their
        completion ids, tool results included."""
        from tunekit.tooluse import episodes
        from tunekit.training import sampling

        eps = self.episodes
        base = self.accelerator.process_index * len(eps)

        def generate(ids, idx, turn, max_new):
            return sampling.generate(self, ids, [base + i for i in idx], turn, max_new)

        continuation = episodes.Continuation(self.renderer.base.chat, self.processing_class)
        episodes.run(prompt_ids, eps, generate, continuation, self.max_completion_length, set(self.eos_token_ids))
        return [ep.ids for ep in eps]

    def tool_mask(self, completion_ids):
        """1 on tokens the model sampled, 0 on tool results' (TRL's tool_mask: no loss on them)."""
        import torch

        width = completion_ids.shape[1]
        rows = [ep.mask[:width] + [1] * (width - len(ep.mask)) for ep in self.episodes]
        return torch.tensor(rows, dtype=completion_ids.dtype, device=completion_ids.device)

    def log_episodes(self) -> None:
        """Tool calls, failed calls and turns per episode, averaged over every process's episodes."""
        import torch

        mode = "train" if self.model.training else "eval"
        counts = torch.tensor([[len(e.calls), e.failures, e.turns] for e in self.episodes], dtype=torch.float,
                              device=self.accelerator.device)
        means = self.accelerator.gather(counts).mean(0).tolist()
        for key, value in zip(("tools/calls", "tools/failures", "tools/turns"), means):
            self._metrics[mode][key].append(value)


class MaskedLogps:
    """For TRL's RLOOTrainer, whose one completion mask serves both attention and loss: the tool results' log
    probabilities are zeroed where its sequence sums take them (the old, reference and current policy's), so they
    count in neither the loss nor the KL while the model still attends to them. Mixed in after ToolUse."""

    loss_tool_mask = None  # the micro-batch's tool_mask while _compute_loss runs

    def _compute_loss(self, model, inputs):
        self.loss_tool_mask = inputs.get("tool_mask")
        try:
            return super()._compute_loss(model, inputs)
        finally:
            self.loss_tool_mask = None

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
        logps, entropies, *rest = super()._get_per_token_logps_and_entropies(model, input_ids, attention_mask,
                                                                             logits_to_keep, *args, **kwargs)
        mask = self.loss_tool_mask
        if mask is None and self.episodes is not None and input_ids.shape[0] == len(self.episodes):
            mask = self.tool_mask(input_ids[:, -logits_to_keep:])  # the whole batch, while it is scored
        if mask is not None:
            logps = logps * mask
            entropies = entropies * mask if entropies is not None else None
        return (logps, entropies, *rest)
