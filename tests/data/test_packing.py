"""Padding-free packing keeps examples apart and the loss unchanged; length grouping cuts padding."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, Trainer

from conftest import logged, tiny_recipe, write_jsonl, write_recipe
from tunekit.config import recipefile, schema
from tunekit.core.hardware import Precision
from tunekit.data import arrow, packing
from tunekit.data.collating import collator
from tunekit.models import loader
from tunekit.training import arguments, runner

# fp32 on CPU: packed and alone differ only by summation order (measured max 2e-7)
TOL = 1e-5


def mixed_rows(n: int = 48) -> list[dict]:
    words = ["cat", "dog", "bird", "fish", "lion", "wolf", "bear", "frog"]
    rows = []
    for i in range(n):
        k = 1 + (i * 7) % 12  # 1..12 words: lengths vary several-fold
        text = " ".join(words[(i + j) % len(words)] for j in range(k))
        rows.append({"instruction": "Reverse the words.", "input": text, "output": " ".join(text.split()[::-1])})
    return rows


def per_token_loss(logits, labels):
    return torch.nn.functional.cross_entropy(logits[:-1], labels[1:], ignore_index=-100, reduction="none")


def test_each_example_has_the_same_per_token_loss_packed_and_alone(tiny_model, tiny_tokenizer, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    model.config.use_cache = False  # as in training
    bundle = arrow.build(schema.DataConfig(train=str(write_jsonl(tmp_path / "d.jsonl", mixed_rows(6)))),
                            tiny_tokenizer, seed=0)
    features = [bundle.train[i] for i in range(len(bundle.train))]
    batch = collator(tiny_tokenizer, packing=True)(features)
    assert batch["input_ids"].shape[0] == 1 and "attention_mask" not in batch
    with torch.no_grad():
        packed = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits[0]
    start = 0
    for f in features:
        n = len(f["input_ids"])
        assert batch["position_ids"][0, start:start + n].tolist() == list(range(n))  # restart per example
        with torch.no_grad():
            alone = model(input_ids=torch.tensor([f["input_ids"]])).logits[0]
        labels = torch.tensor(f["labels"])
        torch.testing.assert_close(per_token_loss(packed[start:start + n], labels),
                                   per_token_loss(alone, labels), rtol=0, atol=TOL)
        # the example's first label is the separator: the previous example never predicts into it
        assert batch["labels"][0, start].item() == -100
        start += n
    assert start == batch["input_ids"].shape[1]


TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=8, n_embd=32, n_layer=2, n_head=4, vocab_size=128, pad_token_id=0, bos_token_id=1,
            eos_token_id=2, max_position_embeddings=256)


def _packed_and_alone(model, lengths):
    """Max |logit difference| between each example in a packed row and the example run alone."""
    model.config.use_cache = False  # as in training: with a cache, the mask ignores packed position ids
    features = [{"input_ids": [3 + (i * 5 + j) % 120 for j in range(n)], "labels": [0] * n}
                for i, n in enumerate(lengths)]
    batch = collator(None, packing=True)(features)
    with torch.no_grad():
        packed = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits[0]
        start, worst = 0, 0.0
        for f in features:
            n = len(f["input_ids"])
            alone = model(input_ids=torch.tensor([f["input_ids"]])).logits[0]
            worst = max(worst, (packed[start:start + n] - alone).abs().max().item())
            start += n
    return worst


def _tiny(model_type: str, **extra):
    from transformers import AutoConfig

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **TINY, **extra)).eval()


@pytest.mark.parametrize("model_type", sorted(packing.PACKABLE))
def test_packable_architectures(model_type):
    """Every architecture that data.packing: auto packs keeps packed examples apart."""
    assert _packed_and_alone(_tiny(model_type), [5, 9, 7]) < TOL


def test_a_sliding_window_stays_inside_each_packed_example():
    assert _packed_and_alone(_tiny("mistral", sliding_window=4), [3, 11, 6]) < TOL


def test_auto_packs_checked_architectures_only(tiny_model):
    llama = AutoModelForCausalLM.from_pretrained(tiny_model)
    assert packing.use(llama, "auto") and packing.use(llama, True) and not packing.use(llama, False)
    hybrid = _tiny("lfm2", layer_types=["conv", "full_attention"])  # convolutions mix neighbouring tokens
    assert _packed_and_alone(hybrid, [5, 9, 7]) > TOL  # what packing would do to it
    assert not packing.use(hybrid, "auto")
    assert packing.use(hybrid, True)  # asked for explicitly: packed, with a warning


def _run(tmp_path, tiny_model, name, **data):
    file = write_jsonl(tmp_path / "mixed.jsonl", mixed_rows())
    raw = tiny_recipe(tiny_model, file, tmp_path / name, data={"max_length": 128, **data},
                      training={"max_steps": 5, "micro_batch_size": 8})
    runner.run(recipefile.load(write_recipe(tmp_path / f"{name}.yaml", raw)))
    return logged(tmp_path / name, "loss")


@pytest.mark.slow  # seconds: make test-fast leaves it out
def test_packed_training_matches_padded_training(tmp_path, tiny_model):
    """Same examples per step, loss averaged over trained tokens: the runs coincide step by step."""
    padded = _run(tmp_path, tiny_model, "padded", packing=False)
    packed = _run(tmp_path, tiny_model, "packed", packing=True)
    assert packed == __import__("pytest").approx(padded, rel=1e-4)
    assert packed[-1] < packed[0]


def test_group_by_length_reduces_padding(tmp_path, tiny_model, tiny_tokenizer):
    # transformers sorts within mega-batches of up to 50 batches: enough data for several of them
    file = write_jsonl(tmp_path / "mixed.jsonl", mixed_rows(480))

    def padding_fraction(group: bool) -> float:
        raw = tiny_recipe(tiny_model, file, tmp_path / "run", data={"max_length": 128},
                          training={"group_by_length": group, "micro_batch_size": 8})
        recipe = recipefile.load(write_recipe(tmp_path / "g.yaml", raw))
        bundle = arrow.build(recipe.data, tiny_tokenizer, 0)
        args = arguments.training_arguments(recipe, Precision("fp32", "test"), tmp_path / "run", False)
        model = loader.load_for_training(recipe, Precision("fp32", "test"))
        trainer = Trainer(model=model, args=args, train_dataset=bundle.train,
                          data_collator=collator(tiny_tokenizer))
        real = total = 0
        for batch in trainer.get_train_dataloader():
            real += int(batch["attention_mask"].sum())
            total += batch["attention_mask"].numel()
        return 1 - real / total

    grouped, random_order = padding_fraction(True), padding_fraction(False)
    assert grouped < 0.5 * random_order, (grouped, random_order)
