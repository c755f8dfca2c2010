"""`tunekit chat`: talk to a trained run, a merged directory or a base model, as `tunekit eval` generates.

The target is loaded as eval does (runs.layout.resolve_target, runs.trained.load_trained), prompts rendered by the
run's own renderer and answers decoded as eval decodes (evaluation.evaluator.generate_batch), so an answer is the
one `tunekit eval` writes for that prompt. How the conversation is kept: docs/evaluation.md, "`tunekit chat`"."""

from __future__ import annotations

import contextlib
import logging
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, TextIO

from tunekit.config.modelsource import looks_like_path
from tunekit.config.schema import EvalConfig, Recipe
from tunekit.core.errors import TunekitError
from tunekit.data.formats import ALPACA_PROMPT
from tunekit.runs.layout import ADAPTER_DIR, Target, resolve_target

log = logging.getLogger("tunekit")

WHERE = "chat"  # how a refused conversation is named in errors (records name their file and line)
NO_DATA = "tunekit-chat-reads-no-data"  # data.train of a base model's stand-in recipe: never read
COMMANDS = {"/image PATH": "attach an image to your next message (vision-language models)",
            "/reset": "clear the conversation", "/exit": "end (as does Ctrl-D)", "/help": "these commands"}


def target_for(spec: str, recipe_path: str | None = None) -> Target:
    """What to talk to, as `tunekit eval` resolves it; a base model needs no recipe (without one, prompts are
    rendered by its chat template, or bare without one). Imports no torch: a missing path is one line first."""
    path = Path(spec).expanduser()
    if recipe_path is not None and not Path(recipe_path).is_file():
        raise TunekitError(f"--recipe {recipe_path}: " + ("is a directory; give a file" if Path(recipe_path).is_dir()
                                                         else "file not found"))
    if not path.exists() and not spec.endswith(".gguf") and (looks_like_path(spec) or path.parent.is_dir()
                                                             and path.parent != Path(".")):
        raise TunekitError(f"{spec}: no such directory; give a run directory (the output_dir `tunekit train` "
                           "wrote, e.g. runs/NAME), a merged directory (`tunekit merge`) or a model (directory, "
                           "GGUF file or hub id)")
    target = resolve_target(spec, recipe_path, None if recipe_path else NO_DATA)
    refuse_score_head(target)
    if target.kind == "base" and recipe_path is None:  # a stand-in recipe: its data is never read
        data = target.recipe.data.model_copy(update={"format": "prompt_completion"})
        target = Target("base", spec, target.recipe.model_copy(update={"data": data}))
    return target


def refuse_score_head(target: Target) -> None:
    """A reward model's run (or its merge) ends in a score head: one number per sequence, no next token to
    generate. Said from its recipe, before anything loads, with what it is for and what to chat with instead."""
    from tunekit.config import methods

    if target.kind == "base" or not methods.spec_of(target.recipe).score_head:
        return
    spec, method = target.spec, target.recipe.training.method
    run = spec if target.kind == "run" else "RUN (the run it was merged from)"
    raise TunekitError(f"{spec}: a reward model (training.method: {method}) scores text with one number and "
                       f"generates none, so it cannot chat; use it as a model reward (grpo.rewards: [{{reward: "
                       f"model, run: {run}}}]) or score pairs with `tunekit eval {spec}`; to chat, give its base "
                       f"model ({target.recipe.model.name_or_path}) or an SFT run")


def check_before_loading(target: Target) -> None:
    """The base model a base target or a LoRA run loads can be had here (a merged directory or a full
    fine-tuning run holds its own weights and tokenizer)."""
    from tunekit.data import precheck

    lora_run = target.kind == "run" and (target.location / ADAPTER_DIR).is_dir()
    if target.kind == "base" or lora_run:
        precheck.check_model(target.recipe.model)


def image_for(path: str, target: Target):
    """An --image, read and checked before any weights load: there, readable as an image, within Pillow's
    decompression-bomb limit, and sent to a model that reads images."""
    from tunekit.data import images
    from tunekit.models import vision

    image = images.source(path, f"--image {path}")
    if not vision.reads_images(target.recipe.model):
        raise TunekitError(f"--image {path}: {target.recipe.model.name_or_path} is a text-only language model (its "
                           "config has no vision_config); leave --image out or chat with a vision-language model")
    image.load()
    return image


def generation_settings(recipe: Recipe, max_new_tokens: int | None = None) -> EvalConfig:
    """The run's eval settings (its recipe's eval section, else eval's defaults), --max-new-tokens applied."""
    cfg = recipe.eval or EvalConfig()
    return cfg.model_copy(update={"max_new_tokens": max_new_tokens}) if max_new_tokens else cfg


@dataclass
class Prompter:
    """Renders a conversation into the text generation continues, with the renderer eval renders with."""

    renderer: object  # the Renderer of the recipe's data settings (data.mixture.Renderers.base)
    system: str | None = None  # --system, else data.system_prompt (chat templates only)
    eos: str = ""

    @classmethod
    def of(cls, recipe: Recipe, tokenizer, system: str | None = None) -> Prompter:
        from tunekit.data import mixture

        renderer = mixture.Renderers(recipe.data, tokenizer).base  # data.format's renderer, as eval's for --data
        if renderer.chat is None and system is not None:
            raise TunekitError(f"--system: the run renders prompts without a chat template (data.template: "
                               f"{renderer.template}), so there is no system message to write; leave --system out")
        return cls(renderer, system if system is not None else recipe.data.system_prompt, tokenizer.eos_token or "")

    @property
    def add_special_tokens(self) -> bool:
        return self.renderer.chat is None  # a chat template writes BOS itself, as in eval and training

    def render(self, history: list[dict], text: str) -> str:
        """The prompt for the user's `text` after `history` (user and assistant messages, in turn)."""
        chat = self.renderer.chat
        if chat is not None:
            messages = ([{"role": "system", "content": self.system}] if self.system else []) + history
            messages, tools, _ = chat.adapt(messages + [{"role": "user", "content": text}], None, WHERE)
            return chat.apply(messages, tools, WHERE, gen=True)
        earlier = "".join(self._single(m["content"]) + a["content"] + self.eos
                          for m, a in zip(history[::2], history[1::2]))
        return earlier + self._single(text)

    def _single(self, text: str) -> str:
        return ALPACA_PROMPT.format(instruction=text) if self.renderer.template == "alpaca" else text


@dataclass
class Conversation:
    """One conversation with a loaded model: `reply` answers a user turn and keeps both in `history`."""

    model: object
    tokenizer: object
    prompter: Prompter
    max_new_tokens: int
    history: list[dict] = field(default_factory=list)
    image_tokens: object = None  # a vision-language model's (data.imagetokens.ImageTokens), else None
    images: list = field(default_factory=list)  # the images of the history's user messages, in order
    pending: list = field(default_factory=list)  # images attached to the next message

    def attach(self, path) -> int:
        """An image for the next message (a path, read and checked now, or an Image `image_for` checked);
        returns its token count."""
        from tunekit.data import images

        image = path if isinstance(path, images.Image) else images.source(path, f"{WHERE}: /image {path}")
        if self.image_tokens is None:
            images.refuse_text_only((image,), self.prompter.renderer.tok.name_or_path)
        image.load()
        self.pending.append(image)
        return len(self.image_tokens.ids(image))

    def prompt(self, text: str) -> str:
        """The text generation continues for `text`, the oldest turns left out where it would not fit."""
        config = self.model.config
        # a vision-language model's window is its language model's
        limit = getattr(getattr(config, "text_config", None) or config, "max_position_embeddings", None)
        while True:
            prompt = self.prompter.render(self.history, text)
            if not limit or self._length(prompt) + self.max_new_tokens <= limit:
                return prompt
            if not self.history:
                raise TunekitError(f"{WHERE}: the message is {self._length(prompt)} tokens with the template, and "
                                   f"{self.max_new_tokens} new tokens would not fit the model's {limit}; "
                                   "send a shorter one or lower --max-new-tokens")
            log.info("chat: the conversation outgrew the model's %d tokens; its oldest turn is left out", limit)
            self._forget_oldest_turn()

    def _length(self, prompt: str) -> int:
        n = len(self.tokenizer(prompt, add_special_tokens=self.prompter.add_special_tokens)["input_ids"])
        if self.image_tokens is not None:  # each image's marker stands for its image tokens
            n += sum(len(self.image_tokens.ids(i)) - len(self.image_tokens.marker_ids)
                     for i in self.images + self.pending)
        return n

    def _forget_oldest_turn(self) -> None:
        dropped = sum(m["content"].count(self.image_tokens.marker) for m in self.history[:2]) \
            if self.image_tokens is not None else 0
        self.history, self.images = self.history[2:], self.images[dropped:]

    def reply(self, text: str, streamer=None) -> str:
        from tunekit.evaluation.evaluator import generate_batch

        if self.pending:  # the images first, then the text, as image chat records usually put them
            text = self.image_tokens.marker * len(self.pending) + text
        prompt = self.prompt(text)
        self.model.eval()
        found = tuple(self.images + self.pending)
        answer = generate_batch(self.model, self.tokenizer, [prompt], self.prompter.add_special_tokens,
                                self.max_new_tokens, streamer, images=[found] if found else None,
                                image_tokens=self.image_tokens)[0]
        self.history += [{"role": "user", "content": text}, {"role": "assistant", "content": answer}]
        self.images, self.pending = list(found), []
        return answer

    def reset(self) -> None:
        self.history, self.images, self.pending = [], [], []


def load(target: Target, max_new_tokens: int | None = None, system: str | None = None,
         dtype: str = "auto") -> Conversation:
    """The target's model and tokenizer loaded as `tunekit eval` loads them, and a conversation with them."""
    from tunekit.data import imagetokens
    from tunekit.evaluation.evaluator import eval_dtype
    from tunekit.models import loader
    from tunekit.runs.trained import load_trained

    tokenizer = loader.load_tokenizer(target.recipe.model, target.tokenizer_dir)
    prompter = Prompter.of(target.recipe, tokenizer, system)
    torch_dtype = eval_dtype(dtype)
    model = load_trained(target, torch_dtype)
    cfg = generation_settings(target.recipe, max_new_tokens)
    log.info("chat with %s: greedy, max %d new tokens, %s, prompts rendered with %s", target.label,
             cfg.max_new_tokens, str(torch_dtype).removeprefix("torch."), prompter.renderer.template)
    return Conversation(model, tokenizer, prompter, cfg.max_new_tokens,
                        image_tokens=imagetokens.of(target.recipe.model))


def streamer(tokenizer, out: TextIO):
    """A transformers streamer writing the answer to `out` as it is generated, leading whitespace dropped (the
    answer `reply` returns is stripped)."""
    from transformers import TextStreamer

    class Shown(TextStreamer):
        started = False

        def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
            if not self.started:
                text = text.lstrip()
                self.started = bool(text)
            out.write(text)
            out.flush()

    return Shown(tokenizer, skip_prompt=True, skip_special_tokens=True)


def talk(conversation: Conversation, read: Callable[[str], str] = input, out: TextIO = sys.stdout,
         stream: bool = True) -> None:
    """The interactive loop: a prompt per turn, the answer shown as it is generated; /reset, /exit, /help;
    end of input ends it. A refused turn is one line, and the conversation goes on."""
    out.write(f"chat: {', '.join(f'{c} {h}' for c, h in COMMANDS.items())}\n")
    while True:
        try:
            text = read("you> ")
        except EOFError:
            out.write("\n")
            return
        command = text.strip()
        if command == "/exit":
            return
        if command == "/reset":
            conversation.reset()
            out.write("(conversation cleared)\n")
            continue
        if command.startswith("/image"):
            try:
                path = command.removeprefix("/image").strip()
                if not path:
                    raise TunekitError("/image: give the image's path, e.g. /image photos/cat.png")
                out.write(f"(image attached: {path}, {conversation.attach(path)} tokens)\n")
            except TunekitError as e:
                out.write(f"tunekit: error: {e}\n")
            continue
        if command.startswith("/") and " " not in command and command not in ("/reset", "/exit"):
            said = "" if command == "/help" else f"unknown command {command}; "
            out.write(said + ", ".join(f"{c}: {h}" for c, h in COMMANDS.items()) + "\n")
            continue
        if not command:
            continue
        out.write("model> ")
        out.flush()
        try:
            answer = conversation.reply(text, streamer(conversation.tokenizer, out) if stream else None)
        except TunekitError as e:
            out.write(f"\ntunekit: error: {e}\n")
            continue
        out.write("\n" if stream else answer + "\n")


def chat(spec: str, recipe_path: str | None = None, once: str | None = None, system: str | None = None,
         max_new_tokens: int | None = None, dtype: str = "auto", out: TextIO | None = None,
         images: list[str] | None = None) -> str | None:
    """`tunekit chat`: with `once`, one turn whose answer is printed and returned (with `images` attached to it);
    else the interactive loop."""
    out = out or sys.stdout
    if once is not None and not once.strip():
        raise TunekitError("--once: the text is empty; give the message to send, e.g. --once 'Hello'")
    if images and once is None:
        raise TunekitError("--image goes with --once; in the conversation, attach one with /image PATH")
    target = target_for(spec, recipe_path)
    check_before_loading(target)  # before torch
    attached = [image_for(path, target) for path in images or ()]  # before the weights too
    conversation = load(target, max_new_tokens, system, dtype)
    for image in attached:
        conversation.attach(image)
    if once is not None:
        answer = conversation.reply(once)
        out.write(answer + "\n")
        return answer
    if sys.stdin.isatty():
        with contextlib.suppress(ImportError):  # line editing and recall of earlier lines where the platform has it
            import readline  # noqa: F401
    talk(conversation, out=out)
    return None
