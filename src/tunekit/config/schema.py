"""The typed recipe: every section with its defaults and descriptions, the rules within a section beside its
fields, and the rules across sections run in one order (config.rules). The sections by topic: the model, its
adapter and quantization, the data and its sources, evaluation and vision here, the training section in
config.trainingschema, each method's in config.methodsettings. The choices come from the declarations beside this
module (config.dataformats, config.metrickinds, config.methods); loading a recipe file, overrides and the one-line
errors live in config.recipefile."""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import Discriminator, Field, Tag, create_model, field_serializer, model_validator

from tunekit.config import dataformats, methods, metrickinds, plugins, rules
from tunekit.config.section import Section
from tunekit.config.trainingschema import PrecisionName, TrainingConfig

DATA_SUFFIXES = (".jsonl", ".json", ".csv", ".parquet")
# the names data.format and eval.metrics take (read inside annotations, where a field named metrics would hide
# the module)
plugins.run("declare")  # installed plugins' names, before the choices below are fixed
FORMAT_NAMES = tuple(dataformats.DECLARED)
METRIC_NAMES = tuple(metrickinds.DECLARED)

# examples one epoch of a mixture may ask for: its positions are held in memory (about 40 bytes each), and more
# than this is a typo or a misread weight, not a data set
MAX_EPOCH_EXAMPLES = 100_000_000


class ModelConfig(Section):
    name_or_path: str = Field(
        description="Hub id, local Hugging Face directory, GGUF file, or 'package/file.gguf' "
        "inside an installed package."
    )
    tokenizer: str | None = Field(None, description="Tokenizer source if it differs from the model "
                                  "(hub id or directory).")
    revision: str | None = Field(None, description="Hub revision (branch, tag or commit) of a hub model.")
    trust_remote_code: bool = Field(False, description="Run modelling code shipped with a hub model. "
                                    "Off unless you trust it.")
    attn_implementation: Literal["eager", "sdpa", "flash_attention_2", "varlen"] | None = Field(
        None, description="Attention kernel. null: torch's variable-length flash kernel (varlen) for packed batches "
        "where it runs (a CUDA GPU, bf16/fp16), else what transformers chooses. varlen: that kernel, refused where it "
        "cannot run (docs/precision-and-speed.md)."
    )
    adapter_from: str | None = Field(
        None, description="A completed tunekit LoRA/QLoRA run directory whose adapter training starts from (an SFT "
        "run before DPO, say); its base must be name_or_path. To start from a merged model, set name_or_path to it.")


class LoraConfig(Section):
    r: int = Field(16, gt=0, description="LoRA rank.")
    alpha: int = Field(32, gt=0, description="LoRA scaling numerator (scale = alpha / r).")
    dropout: float = Field(0.05, ge=0.0, lt=1.0, description="Dropout on the LoRA input.")
    target_modules: Union[Literal["all-linear"], list[str]] = Field(
        "all-linear", description="'all-linear' (every linear layer but the output head) or a list of module names."
    )
    modules_to_save: list[str] = Field(default_factory=list, description="Modules trained fully and saved "
                                       "with the adapter.")
    bias: Literal["none", "all", "lora_only"] = Field("none", description="Which biases to train.")
    use_dora: bool = Field(False, description="DoRA: train each weight's magnitude and direction separately "
                           "(better at low rank, slower steps; merges like LoRA).")
    use_rslora: bool = Field(False, description="rsLoRA: scale by alpha/sqrt(r) instead of alpha/r, so that higher "
                             "ranks keep learning (4x the update at r16: a rate set for alpha/r is then too strong); "
                             "false: peft's alpha/r. How the default was chosen: docs/recipes.md, Which defaults, "
                             "measured.")
    init: Literal["default", "pissa", "olora"] = Field(
        "default", description="Adapter initialisation: default (B = 0), pissa (the weights' principal singular "
        "vectors, fast SVD) or olora (QR). pissa and olora move part of each base weight into the adapter; the "
        "saved adapter is converted back to apply to the original base.")
    lr_ratio: float | None = Field(None, ge=1.0, description="LoRA+: the B matrices learn at learning_rate x lr_ratio "
                                   "(16 in the LoRA+ paper); null trains A and B at one rate.")


class QuantizationConfig(Section):
    bits: Literal[4, 8] = Field(4, description="Load the frozen base in 4-bit (QLoRA) or 8-bit.")
    quant_type: Literal["nf4", "fp4"] = Field("nf4", description="4-bit data type.")
    double_quant: bool = Field(True, description="Quantize the quantization constants too (saves ~0.4 bit/param).")
    compute_dtype: PrecisionName = Field("auto", description="dtype of 4-bit matmuls; 'auto' follows "
                                         "training.precision.")


class FieldMap(Section):
    instruction: str = Field("instruction", description="alpaca: instruction column.")
    input: str = Field("input", description="alpaca: optional input column.")
    output: str = Field("output", description="alpaca: answer column.")
    messages: str = Field("messages", description="chat: column holding the list of messages.")
    role: str = Field("role", description="chat: role key inside each message.")
    content: str = Field("content", description="chat: text key inside each message.")
    prompt: str = Field("prompt", description="prompt_completion, preference, unpaired_preference, prompt: prompt "
                        "column.")
    completion: str = Field("completion", description="prompt_completion, unpaired_preference: completion column.")
    text: str = Field("text", description="text: column of raw text.")
    answer: str = Field("answer", description="prompt: the optional reference answer column (GRPO's rewards score "
                        "completions against it).")
    chosen: str = Field("chosen", description="preference: the preferred answer's column.")
    rejected: str = Field("rejected", description="preference: the dispreferred answer's column.")
    label: str = Field("label", description="unpaired_preference: column saying whether the completion is "
                       "desirable (true/false or 1/0).")
    images: str = Field("images", description="chat: column holding the example's images in the LLaVA shape (a list of "
                        "paths, URLs or base64 data URLs, one per `<image>` placeholder in the messages' text).")
    tools: str = Field("tools", description="chat: column holding the example's tool (function) schemas, a list or "
                       "a JSON text; passed to the chat template.")
    tool_calls: str = Field("tool_calls", description="chat: key of an assistant message's tool calls "
                            "(OpenAI layout: function name and JSON arguments).")
    reasoning: str = Field("reasoning_content", description="chat: key of an assistant message's reasoning; "
                           "`thinking` is read too while this is left at its default.")
    train: str = Field("train", description="chat: key of a message's own switch; `train: false` on an assistant "
                       "message keeps it out of the loss.")


class DataSource(Section):
    """One source of a mixture: data.train (or data.eval) given as a list of these."""

    path: str = Field(description="A .jsonl/.json/.csv/.parquet file or a `datasets` hub name.")
    split: str | None = Field(None, description="Split to read from a hub dataset; null: data.train_split "
                              "(data.eval_split for a data.eval source).")
    format: Literal[FORMAT_NAMES] | None = Field(  # type: ignore[valid-type]  # names from the declarations
        None, description="This source's record layout; null: data.format.")
    fields: FieldMap | None = Field(None, description="This source's column names; the keys given here replace "
                                    "data.fields' for this source.")
    weight: float | None = Field(None, gt=0, description="data.train: this source's share of each epoch's training "
                                 "examples (see docs/data.md, mixtures); sampled with repetition when it asks for "
                                 "more than the source holds.")
    count: int | None = Field(None, gt=0, le=MAX_EPOCH_EXAMPLES, description="data.train: a fixed number of "
                              "examples from this source per epoch (repeated when the source holds fewer). With "
                              "neither weight nor count: all of its records.")

    @field_serializer("fields")
    def _only_given(self, fields: FieldMap | None):
        """The keys this source gives, not every default: they replace data.fields' keys when read back."""
        return None if fields is None else fields.model_dump(exclude_unset=True)

    @model_validator(mode="after")
    def _one_size(self) -> "DataSource":
        if self.weight is not None and self.count is not None:
            raise ValueError("weight and count are both set; keep one")
        return self


def _file_or_sources(value: Any) -> str:
    return "[sources]" if isinstance(value, list) else "[file]"


# A file or hub name, or a list of sources. The tags hold "[" so that a one-line error's key leaves them out
# (config.recipefile): data.train[1].weight, not data.train.[sources].1.weight.
DataSpec = Annotated[Union[Annotated[str, Tag("[file]")],
                           Annotated[list[DataSource], Field(min_length=1), Tag("[sources]")]],
                     Discriminator(_file_or_sources)]


class DataConfig(Section):
    train: DataSpec = Field(description="Training data: a .jsonl/.json/.csv/.parquet file or a `datasets` hub name, "
                            "or a list of sources mixed by weight or count (a mixture, docs/data.md).")
    train_split: str = Field("train", description="Split to read from a hub dataset.")
    eval: DataSpec | None = Field(None, description="Eval data file or hub name, or a list of sources (held out "
                                  "whole, one after another); otherwise see eval_fraction.")
    eval_split: str = Field("validation", description="Split to read when `eval` is a hub dataset.")
    eval_fraction: float = Field(0.0, ge=0.0, lt=1.0, description="Hold out this seeded fraction of train (of "
                                 "each source of a mixture) for eval.")
    format: Literal[FORMAT_NAMES] = Field(  # type: ignore[valid-type]  # names from the declarations
        "alpaca", description="Record layout: " + ", ".join(FORMAT_NAMES) + " (tunekit.data.formats).")
    fields: FieldMap = Field(default_factory=FieldMap, description="Column names, when they differ from the defaults.")
    template: Literal["auto", "chat", "alpaca", "raw"] = Field(
        "auto",
        description="How prompts are rendered: the tokenizer's chat template, the Alpaca prompt, or raw "
        "concatenation. 'auto' uses the chat template when the tokenizer has one.",
    )
    system_prompt: str | None = Field(None, description="System message added to chat-rendered prompts.")
    max_length: int = Field(1024, ge=8, description="Tokens per example; longer examples are truncated and counted.")
    train_on: Literal["all_assistant", "last_assistant"] = Field(
        "all_assistant", description="chat: which assistant messages train: every one (tool calls included) or only "
        "the conversation's last. System, user and tool messages never train.")
    train_reasoning: bool = Field(True, description="chat: train on assistant reasoning (reasoning_content); empty "
                                  "reasoning blocks a template writes never train.")
    mask_prompt: bool = Field(True, description="Train only on completion/assistant tokens (prompt labels = -100).")
    max_examples: int | None = Field(None, gt=0, description="Use only the first N records of data.train (of "
                                     "each source of a mixture); data.eval_fraction then holds out its share of "
                                     "those N.")
    dedup: bool = Field(False, description="Drop training examples whose prompt and answer repeat an earlier one "
                        "(after Unicode, case and whitespace normalisation); counted in the contamination report.")
    decontaminate: bool = Field(False, description="Drop training examples that share a prompt, an answer or a "
                                "13-word span with a held-out example; counted in the contamination report.")
    packing: Union[Literal["auto"], bool] = Field(
        "auto",
        description="Padding-free packing: each micro-batch becomes one row of concatenated examples with position ids "
        "restarting per example and attention kept inside each example. auto: on where the model keeps packed "
        "examples apart (transformers' attention interface), else padded batches.",
    )

    @model_validator(mode="after")
    def _rules(self) -> "DataConfig":
        if self.eval is not None and self.eval_fraction > 0:
            raise ValueError("data.eval and data.eval_fraction are both set; keep one")
        named = [(f" ({key}.format)", s.format) for key, s in self.sources() + self.sources("eval") if s.format]
        for key, fmt in [("", self.format)] + named:
            if dataformats.DECLARED[fmt].needs_chat and self.template in ("alpaca", "raw"):
                raise ValueError(f"data.template={self.template} cannot render format {fmt}{key}; "
                                 "use template: chat or auto")
        for key, s in self.sources("eval"):
            if s.weight is not None or s.count is not None:
                raise ValueError(f"{key}: data.eval sources are held out whole; remove weight and count")
        self._weights_fit()
        return self

    def formats(self) -> list[str]:
        """Every data format the recipe reads: data.format and each source's own."""
        named = [s.format for _, s in self.sources() + self.sources("eval") if s.format]
        return list(dict.fromkeys([self.format] + named))

    def _weights_fit(self) -> None:
        """Beside sources of a fixed size (a count, or all records), weights are shares of the whole epoch."""
        given = self.sources("train")
        total = sum(s.weight for _, s in given if s.weight is not None)
        if total >= 1 and any(s.weight is None for _, s in given) and any(s.weight is not None for _, s in given):
            raise ValueError(f"data.train: the weights sum to {total:g} beside sources of a fixed size (a count, or "
                             "all records); there they are shares of the whole epoch and must sum to less than 1 "
                             "(or give every source a weight)")

    def sources(self, which: str = "train") -> list[tuple[str, DataSource]]:
        """(key, source) of each source of a mixture given as a list (data.train[0], ...); empty for a file."""
        value = getattr(self, which)
        return [(f"data.{which}[{i}]", s) for i, s in enumerate(value)] if isinstance(value, list) else []


class BenchmarksConfig(Section):
    """Standard benchmarks before and after training, through lm-evaluation-harness (evaluation.benchmarks)."""

    tasks: list[str] = Field(..., min_length=1, description="lm-eval task names (arc_easy, hellaswag, mmlu, ...; "
                             "their data from the Hub or its cache) or paths to local task YAML files (relative to "
                             "the recipe; their data files relative to the YAML).")
    num_fewshot: int | None = Field(None, ge=0, description="Examples shown before each question; null: each "
                                    "task's own count (its YAML's num_fewshot, 0 where it names none).")
    limit: int | None = Field(None, gt=0, description="Score only the first N examples of each task.")
    seed: int = Field(0, ge=0, lt=2**32, description="lm-eval's seeds (few-shot sampling and the rest).")
    batch_size: int | None = Field(None, gt=0, description="Requests per forward pass; null: the largest that fits "
                                   "on a GPU (lm-eval's search), 8 on a CPU.")
    compare_base: bool = Field(True, description="Also score the base model (the run's model with its adapter "
                               "switched off, so a QLoRA base is the same 4-bit model; the base weights for full "
                               "fine-tuning) on the same tasks: before and after, with the change.")


class EvalConfig(Section):
    data: str | None = Field(None, description="Eval file; null uses the recipe's eval split.")
    limit: int | None = Field(None, gt=0, description="Score only the first N examples.")
    batch_size: int = Field(8, gt=0, description="Prompts per generate() call.")
    max_new_tokens: int = Field(64, gt=0, description="Generation length cap.")
    metrics: list[Literal[METRIC_NAMES]] = Field(  # type: ignore[valid-type]  # names from the declarations
        default_factory=metrickinds.defaults, description="Built-in metrics: "
        + ", ".join(METRIC_NAMES) + "; left out, every one but "
        + ", ".join(n for n, m in metrickinds.DECLARED.items() if not m.default) + "."
    )
    extra_metrics: list[str] = Field(
        default_factory=list, description="`evaluate` metrics by Hub name or local script path (needs `evaluate`)."
    )
    during_training: bool = Field(
        True, description="Also generate and score at every evaluation during training (training.eval_steps, or "
        "once per epoch), on the first `limit` examples, logged beside eval_loss.")
    benchmarks: BenchmarksConfig | None = Field(
        None, description="Standard benchmarks (lm-evaluation-harness) at the end of training, before and after "
        "(needs pip install 'tunekit[benchmarks]').")


class VisionConfig(Section):
    """What trains in a vision-language model (one AutoModelForImageTextToText loads): the language model always
    (LoRA, QLoRA or full, as the recipe's adapter says), the projector and the vision tower only when asked."""

    train_projector: bool = Field(False, description="Train the projector that maps image features into the "
                                  "language model (in full, saved beside a LoRA adapter): on for a projector "
                                  "newly made, as when composing a model as LLaVA composes one.")
    train_tower: bool = Field(False, description="Train the vision tower too (LoRA on its linear layers with an "
                              "adapter, in full without one): for images far from what the tower saw.")


class MoeConfig(Section):
    """What trains in a mixture-of-experts model beside attention, and its router's balancing loss
    (models.experts)."""

    experts: bool = Field(True, description="LoRA on the experts' weights too (one low-rank pair per expert, peft's "
                          "target_parameters); false: attention (the lora.target_modules) alone.")
    router: Literal["frozen", "trained"] = Field("frozen", description="trained: the routers train in full and are "
                                                 "saved beside the adapter.")
    aux_loss: bool = Field(True, description="Add the router's load-balancing loss to the loss (logged as aux_loss), "
                           "as the model was pre-trained with.")
    aux_loss_coef: float | None = Field(None, ge=0.0, description="Its weight; null: the model config's "
                                        "router_aux_loss_coef.")
    aux_loss_scope: Literal["model", "layer"] = Field(
        "model", description="model: transformers' loss, every layer's tokens counted together (as the model was "
        "pre-trained); layer: the same loss on each sparse layer alone, averaged (Switch Transformer's), so that no "
        "layer can send its tokens to a few experts while others balance it out.")
    kernel: Literal["auto", "grouped_mm", "batched_mm", "eager"] = Field(
        "auto", description="How the experts compute (transformers' experts implementations): auto: grouped_mm (one "
        "grouped matmul over the experts a batch reaches) wherever torch can dispatch it, CPU included, else eager "
        "(a loop over those experts); or one by name. The run log says which ran.")


class RecipeBase(Section):
    """The sections every recipe has; `Recipe` adds each training method's section (tunekit.config.methods)."""

    model: ModelConfig = Field(description="Base model.")
    adapter: Literal["lora", "none"] = Field(
        "lora", description="lora: train LoRA adapters (with a quantization section: QLoRA); none: full fine-tuning. "
        "The older spelling 'qlora' reads as lora plus a default quantization section.")
    lora: LoraConfig | None = Field(None, description="LoRA settings (adapter lora).")
    quantization: QuantizationConfig | None = Field(
        None, description="Load the frozen base quantized (QLoRA when the adapter is lora).")
    data: DataConfig = Field(description="Training and eval data.")
    training: TrainingConfig = Field(default_factory=TrainingConfig, description="Optimisation settings.")
    eval: EvalConfig | None = Field(None, description="Generate and score at the end of training.")
    vision: VisionConfig | None = Field(None, description="Vision-language models only: what trains beside the "
                                        "language model; left out, the language model alone.")
    moe: MoeConfig | None = Field(None, description="Mixture-of-experts models only: whether the experts and the "
                                  "router train, the router's balancing loss; left out, the defaults below.")

    @model_validator(mode="before")
    @classmethod
    def _adapter_sections(cls, data: Any) -> Any:
        """The adapter (lora | none) and the base's quantization are separate settings; 'qlora', their old
        single spelling, is read as lora plus a quantization section. A method section written by its earlier
        name (preference: for dpo:) is read as the new one (from_dict notes it)."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        for old, new in methods.renamed_sections(data):
            if data.get(new) is not None and data[old] is not None:
                raise ValueError(f"{old} is the earlier name of the {new} section and both are set; keep {new}")
            value = data.pop(old)
            data[new] = data.get(new) if value is None else value
        if data.get("adapter") == "qlora":
            data["adapter"] = "lora"
            if data.get("quantization") is None:
                data["quantization"] = {}
        adapter = data.get("adapter", "lora")
        if adapter == "none" and data.get("lora") is not None:
            raise ValueError("lora settings given but adapter is 'none'; remove the lora section or set adapter: lora")
        if adapter == "none" and data.get("quantization") is not None:
            raise ValueError("quantization settings given but adapter is 'none': full fine-tuning trains every weight, "
                             "which cannot stay quantized; set adapter: lora (QLoRA) or remove the "
                             "quantization section")
        if adapter == "lora" and data.get("lora") is None:
            data["lora"] = {}
        lora = data.get("lora") if isinstance(data.get("lora"), dict) else {}
        init = lora.get("init", "default")
        if init != "default" and data.get("quantization") is not None:
            raise ValueError(f"lora.init={init} rewrites base weights, which a quantized base cannot hold exactly; "
                             "use lora.init: default with quantization, or drop the quantization section")
        if init != "default" and lora.get("use_dora"):
            raise ValueError(f"lora.init={init} with lora.use_dora is not supported; keep one")
        return data

    @property
    def full_finetuning(self) -> bool:
        return self.adapter == "none"

    @property
    def adapter_kind(self) -> str:
        """qlora | lora | full, for people to read (logs, run.json, plans); training.method is sft, dpo, ..."""
        return "full" if self.full_finetuning else "qlora" if self.quantization is not None else "lora"

    @model_validator(mode="after")
    def _rules(self) -> "Recipe":
        """The training method's section takes its defaults when left out; then the rules across sections
        (config.rules), in their order."""
        method = methods.spec_of(self)
        if method.section is not None and getattr(self, method.section) is None:
            object.__setattr__(self, method.section, method.settings())  # the recipe is frozen
        rules.run(self)
        return self


def _method_sections() -> dict:
    """One optional section per training method that has settings, named after the method."""
    return {m.section: (m.settings | None, Field(None, description=f"{m.name} settings (training.method: {m.name})."))
            for m in methods.DECLARED.values() if m.section is not None}


Recipe = create_model(
    "Recipe", __base__=RecipeBase, __module__=__name__, __doc__="A validated recipe (the schema above).",
    **_method_sections(),
    output_dir=(str | None, Field(None, description="Run directory; defaults to runs/<recipe name>.")),
)
