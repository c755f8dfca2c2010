"""Rendering records: a record, parsed under its data format, as text plus the character spans that are
trained, through the chat template (data.chattemplate), the Alpaca prompt or the bare text."""

from __future__ import annotations

from dataclasses import dataclass

from tunekit.config.schema import DataConfig
from tunekit.core.errors import TunekitError
from tunekit.data import images
from tunekit.data.chattemplate import Chat
from tunekit.data.formats import FORMATS, Record


@dataclass
class Rendered:
    text: str
    spans: list[tuple[int, int]]  # character spans whose tokens are trained
    add_special_tokens: bool  # False when a chat template already wrote BOS etc.
    prompt: str | None = None  # what generation starts from (everything before the last answer)
    reference: str | None = None  # the last answer
    desirable: bool | None = None  # unpaired preference data: whether that answer is wanted
    where: str | None = None  # the record it came from (file and line)
    roles: list[tuple[int, int, str]] | None = None  # character ranges by message role (Renderer(roles=True))
    images: tuple = ()  # the record's images (data.images.Image) the text marks, in order (vision-language models)


class Renderer:
    """Turns one record into text plus the character spans that are trained: `examples` for training (one per
    record, more where a chat template rewrites earlier turns), `render` for generation and scoring (the
    conversation through its last assistant message, with that message's prompt and reference)."""

    def __init__(self, cfg: DataConfig, tokenizer, roles: bool = False, tools: list[dict] | None = None,
                 image_tokens=None):
        self.cfg = cfg
        self.image_tokens = image_tokens  # data.imagetokens.ImageTokens of a vision-language model, else None
        self.tools = tools  # tool schemas offered where a record offers none (grpo.tools, grpo.environment)
        self.tok = tokenizer
        self.format = FORMATS[cfg.format]
        self.with_roles = roles
        has_chat = bool(getattr(tokenizer, "chat_template", None))
        template = cfg.template
        if template == "auto":
            template = "chat" if has_chat or self.format.needs_chat else ("alpaca" if self.format.alpaca else "raw")
        if template == "chat" and not has_chat:
            raise TunekitError("data.template: the tokenizer has no chat template; use template: alpaca or raw")
        if template == "alpaca" and not self.format.alpaca:
            raise TunekitError(f"data.template=alpaca only renders format alpaca, not {cfg.format}; use chat or raw")
        self.template = template
        marker = image_tokens.marker if image_tokens is not None else None
        self.chat = Chat(tokenizer, cfg.train_on, cfg.train_reasoning, marker) if template == "chat" else None

    @property
    def notes(self) -> set[str]:
        """One line per default rendering used so far (templates without tool or reasoning support)."""
        return self.chat.notes if self.chat else set()

    def _conversation(self, parsed, where: str, observation: str | None = None
                      ) -> tuple[list[dict], list | None, list[dict]]:
        messages = parsed.messages
        if self.image_tokens is None:
            # data.precheck refuses these before anything loads; here for a caller that skips it
            images.refuse_text_only(parsed.images, getattr(self.tok, "name_or_path", None) or "the model")
        elif parsed.images:  # each image where the model's chat template puts one
            marker = self.image_tokens.marker
            messages = [dict(m, content=m["content"].replace(images.PLACEHOLDER, marker)) for m in messages]
        if self.cfg.system_prompt and messages[0]["role"] != "system":
            messages = [{"role": "system", "content": self.cfg.system_prompt}] + messages
        if observation:  # an environment's reset() text, added to the last user message before the answer
            last = max(i for i, m in enumerate(messages) if m["role"] == "user")
            messages = [dict(m, content=m["content"] + observation) if i == last else m
                        for i, m in enumerate(messages)]
        return self.chat.adapt(messages, parsed.tools or self.tools, where)

    def examples(self, record: Record) -> list[Rendered]:
        parsed = self.format.parse(record, self.cfg.fields)
        if self.chat is None or parsed.text is not None:
            return [self._finish(self._plain(parsed), parsed, record.where)]
        messages, tools, meta = self._conversation(parsed, record.where)
        out = []
        for piece in self.chat.pieces(messages, tools, meta, record.where):
            rendered = Rendered(piece.text, piece.spans, False, images=self._images(parsed, piece.text))
            if self.with_roles:
                rendered.roles = self.chat.roles(messages, tools, piece.text, record.where)
            out.append(self._finish(rendered, parsed, record.where))
        return out

    def render(self, record: Record, observation: str | None = None) -> Rendered:
        """`observation`: text added to the last user message (an environment's reset(); chat templates only)."""
        parsed = self.format.parse(record, self.cfg.fields)
        if self.chat is None or parsed.text is not None:
            if self.tools or observation:
                raise TunekitError("tools and environments need a chat template (data.template: chat); the "
                                   f"{self.template} template has no place for tools or their results")
            return self._finish(self._plain(parsed), parsed, record.where)
        messages, tools, meta = self._conversation(parsed, record.where, observation)
        last = max(i for i, info in enumerate(meta) if info["role"] == "assistant")
        turn = self.chat.turn(messages, tools, last, record.where)
        spans = self.chat.spans(messages, tools, turn, meta[last], record.where) if meta[last]["train"] else []
        rendered = Rendered(turn.through, spans, False, prompt=turn.before,
                            reference=self.chat.reference(messages, tools, turn, meta[last], record.where),
                            images=self._images(parsed, turn.through))
        return self._finish(rendered, parsed, record.where)

    def _images(self, parsed, text: str) -> tuple:
        """The images of a rendered piece: as many of the record's, in order, as its text has markers for."""
        if not parsed.images or self.image_tokens is None:
            return ()
        return tuple(parsed.images[:text.count(self.image_tokens.marker)])

    @staticmethod
    def _finish(rendered: Rendered, parsed, where: str) -> Rendered:
        rendered.desirable, rendered.where = parsed.desirable, where
        return rendered

    def _plain(self, parsed) -> Rendered:
        eos = self.tok.eos_token or ""
        if parsed.text is not None:
            return Rendered(parsed.text + eos, [(0, len(parsed.text) + len(eos))], True)
        # one turn without a chat template: the Alpaca prompt or the bare prompt, then the answer
        user, answer = parsed.messages[0]["content"], parsed.messages[-1]["content"]
        plain = parsed.alpaca_prompt if self.template == "alpaca" else user
        completion = answer + eos
        return Rendered(plain + completion, [(len(plain), len(plain) + len(completion))], True, prompt=plain,
                        reference=answer)
