"""DPO on the CPU with the tiny model (fp32): the trainer's loss and gradients against a direct
computation, log 2 at step 0, preference accuracy rising, exact resume, preference tokenization."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from gpu_runtime.contract.chat import ChatMessage
from gpu_runtime.contract.hparams import LoraSpec, resolve_hyperparameters
from gpu_runtime.contract.supervised_examples import tokenize_chat
from gpu_runtime.contract.training_data import TrainingDataError
from gpu_runtime.contract.training_examples import IGNORE_INDEX
from gpu_runtime.finetune.checkpoint import load_checkpoint
from gpu_runtime.finetune.dpo_trainer import DpoTrainer
from gpu_runtime.finetune.loss import training_hidden_states
from gpu_runtime.finetune.preference_data import PreferencePair, tokenize_preference_lines

# (question, preferred, other): the same answers are preferred for some prompts and not for
# others, so ranking them right needs the prompt.
TOY = [
    ("colour of the sky?", "blue", "red"),
    ("colour of blood?", "red", "blue"),
    ("the quick brown fox", "jumps over the lazy dog", "a short poem"),
    ("write about the sea", "a short poem", "jumps over the lazy dog"),
    ("hello", "world", "numbers 1 2 3"),
    ("count", "numbers 1 2 3", "world"),
    ("adapters are", "low-rank", "continuous"),
    ("batching is", "continuous", "low-rank"),
]


def preference_line(question: str, preferred: str, other: str) -> str:
    return json.dumps(
        {
            "input": {"messages": [{"role": "user", "content": question}]},
            "preferred_output": [{"role": "assistant", "content": preferred}],
            "non_preferred_output": [{"role": "assistant", "content": other}],
        }
    )


@pytest.fixture()
def pairs(tokenizer: Any) -> tuple[PreferencePair, ...]:
    lines = [preference_line(*row) for row in TOY]
    return tokenize_preference_lines(lines, tokenizer, max_seq_len=64).pairs


def hparams(n: int, **extra: Any) -> Any:
    options: dict[str, Any] = {
        "n_epochs": 1,
        "batch_size": 4,
        "learning_rate_multiplier": 10.0,
        "lora": LoraSpec(rank=4, dropout=0.0),
        "seed": 3,
        "dpo_beta": 0.1,
    }
    options.update(extra)
    return resolve_hyperparameters(n_train_examples=n, **options)


def direct_logps(model: Any, rows: list[Any], peft_tree: bool = True) -> torch.Tensor:
    """Summed completion log-probabilities per row, by plain full-vocabulary log_softmax; a
    peft tree through the training forward, a serving model through its own forward."""
    out = []
    for row in rows:
        ids = torch.tensor([row.input_ids])
        positions = torch.arange(ids.shape[1]).unsqueeze(0)
        if peft_tree:
            hidden = training_hidden_states(model, ids, positions)
        else:
            hidden = model(ids, positions)
        logits = model.compute_logits(hidden)[0]
        logps = F.log_softmax(logits.float(), dim=-1)[:-1]  # position t predicts t + 1
        targets = torch.tensor(row.labels[1:])
        mask = targets != IGNORE_INDEX
        out.append(logps[mask].gather(1, targets[mask].unsqueeze(1)).sum())
    return torch.stack(out)


def test_preference_rows_share_the_prompt_and_label_only_the_output(
    tokenizer: Any, pairs: tuple[PreferencePair, ...]
) -> None:
    pair = pairs[0]
    prompt = [ChatMessage("user", "colour of the sky?")]
    assert pair.chosen == tokenize_chat(tokenizer, [*prompt, ChatMessage("assistant", "blue")])
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "colour of the sky?"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    prompt_len = len(tokenizer(rendered, add_special_tokens=False)["input_ids"])
    for row in pair.rows:
        assert row.input_ids[:prompt_len] == pair.chosen.input_ids[:prompt_len]
        assert all(label == IGNORE_INDEX for label in row.labels[:prompt_len])
        assert all(label != IGNORE_INDEX for label in row.labels[prompt_len:])
    text = tokenizer.decode([t for t in pair.rejected.labels if t != IGNORE_INDEX])
    assert text == "red<|im_end|>\n"  # the assistant turn as the template ends it
    assert pair.num_tokens == 2 * max(pair.chosen.num_tokens, pair.rejected.num_tokens)


@pytest.mark.parametrize(
    ("record", "says"),
    [
        ({"input": {"messages": [{"role": "user", "content": "q"}], "tools": [{}]}}, "tools"),
        ({"input": {"messages": []}}, "input.messages"),
        (
            {
                "input": {"messages": [{"role": "user", "content": "q"}]},
                "preferred_output": [{"role": "user", "content": "a"}],
            },
            "preferred_output[0].role",
        ),
    ],
)
def test_malformed_preference_lines_name_the_line(
    tokenizer: Any, record: dict[str, Any], says: str
) -> None:
    with pytest.raises(TrainingDataError, match=rf"prefs, line 2: .*{re.escape(says)}"):
        tokenize_preference_lines(
            [preference_line(*TOY[0]), json.dumps(record)], tokenizer, 64, source="prefs"
        )


@pytest.mark.parametrize(("fused_forward", "chunk"), [(True, 2048), (False, 3)])
def test_dpo_loss_and_gradients_equal_a_direct_computation(
    serving_model: Any, pairs: tuple[PreferencePair, ...], fused_forward: bool, chunk: int
) -> None:
    trainer = DpoTrainer(
        serving_model,
        pairs,
        hparams(len(pairs), dpo_beta=0.5),
        fused_forward=fused_forward,
        loss_chunk_tokens=chunk,  # 3: the log-probabilities in many chunks
    )
    with torch.no_grad():
        for p in trainer.params:
            p.normal_(0, 0.2, generator=torch.Generator().manual_seed(p.numel()))  # B != 0
    result = trainer.step_quantum(max_examples=2)  # half of a 4-pair batch: grads pending
    assert not result.optimizer_step and result.examples == 2
    chosen = [trainer.pairs[i] for i in trainer.stream.order(0)[:2]]
    rows = [p.chosen for p in chosen] + [p.rejected for p in chosen]
    grads = [p.grad.clone() for p in trainer.params]  # type: ignore[union-attr]

    for p in trainer.params:
        p.grad = None
    with torch.no_grad():  # the reference: the serving model itself, its own forward
        ref = direct_logps(serving_model, rows, peft_tree=False)
    trainer.model.train()
    policy = direct_logps(trainer.model, rows)
    beta = 0.5
    logits = beta * ((policy[:2] - ref[:2]) - (policy[2:] - ref[2:]))
    losses = -F.logsigmoid(logits)
    assert result.loss == pytest.approx(float(losses.detach().mean()), abs=1e-5)
    (losses.sum() / 4).backward()  # the batch's mean: 4 pairs
    for got, want in zip(grads, [p.grad for p in trainer.params], strict=True):
        assert want is not None and want.abs().max() > 1e-4  # a real gradient
        # the fused forward's kernels round differently from the peft tree's
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3 * float(want.abs().max()))


def test_step_zero_loss_is_log_2_and_rewards_are_zero(
    serving_model: Any, pairs: tuple[PreferencePair, ...]
) -> None:
    trainer = DpoTrainer(serving_model, pairs, hparams(len(pairs), lora=LoraSpec(rank=4)))
    result = trainer.step_quantum()  # dropout on: the reference pass must not see it
    assert result.optimizer_step and result.examples == 4
    assert result.batch_loss == pytest.approx(math.log(2), abs=1e-7)
    record = trainer.preference_history[0]
    assert (record.step, record.chosen_reward, record.rejected_reward) == (1, 0.0, 0.0)
    assert record.accuracy == 0.0  # ties are not ranked right
    assert trainer.history[0].tokens == sum(
        p.chosen.num_tokens + p.rejected.num_tokens
        for p in (trainer.pairs[i] for i in trainer.stream.order(0)[:4])
    )


def test_preference_accuracy_rises_on_a_toy_set(
    serving_model: Any, pairs: tuple[PreferencePair, ...]
) -> None:
    trainer = DpoTrainer(
        serving_model, pairs, hparams(len(pairs), n_epochs=12, lora=LoraSpec(rank=8))
    )
    while not trainer.finished:
        trainer.step_quantum(max_examples=3)
    assert trainer.step == 24
    history = trainer.preference_history
    assert [r.step for r in history] == list(range(1, 25))
    assert history[0].accuracy == 0.0  # step 1: the policy is the reference, all ties
    late = history[-6:]
    assert sum(r.accuracy for r in late) / len(late) >= 0.9, history
    assert min(r.margin for r in late) > 0.1
    assert trainer.history[-1].loss < math.log(2) - 0.1


def test_resume_reproduces_the_uninterrupted_dpo_run(
    tmp_path: Path, serving_model: Any, pairs: tuple[PreferencePair, ...]
) -> None:
    settings = hparams(
        len(pairs), n_epochs=2, lora=LoraSpec(rank=4, dropout=0.2), checkpoint_every_steps=2
    )
    full = DpoTrainer(serving_model, pairs, settings, checkpoint_root=tmp_path / "a")
    while not full.finished:
        full.step_quantum(max_examples=3)
    assert full.step == 4
    resumed = DpoTrainer(serving_model, pairs, settings)
    load_checkpoint(resumed, tmp_path / "a" / "step-000002")
    assert resumed.preference_history == full.preference_history[:2]
    while not resumed.finished:
        resumed.step_quantum(max_examples=3)
    for a, b in zip(full.history, resumed.history, strict=True):
        assert (a.step, a.learning_rate) == (b.step, b.learning_rate)
        assert abs(a.loss - b.loss) < 1e-6, (a, b)
    for x, y in zip(full.preference_history, resumed.preference_history, strict=True):
        assert x.step == y.step and x.accuracy == y.accuracy
        assert abs(x.margin - y.margin) < 1e-6
    for p, q in zip(full.params, resumed.params, strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6)


def test_a_supervised_trainer_refuses_dpo_settings(
    serving_model: Any, train_examples: Any, pairs: tuple[PreferencePair, ...]
) -> None:
    from gpu_runtime.finetune.trainer import LoraTrainer

    with pytest.raises(ValueError, match="DpoTrainer"):
        LoraTrainer(serving_model, train_examples, hparams(len(train_examples)))
    with pytest.raises(ValueError, match="dpo_beta"):
        DpoTrainer(serving_model, pairs, hparams(len(pairs), dpo_beta=None))


def test_quanta_are_whole_micro_batches_within_the_token_budget(
    serving_model: Any, pairs: tuple[PreferencePair, ...]
) -> None:
    from gpu_runtime.colocation.snapshot import describe_trainer, trainer_layers

    trainer = DpoTrainer(serving_model, pairs, hparams(len(pairs)))
    assert trainer_layers(trainer) is None and trainer.replays_next(64, [0]) is None
    seq_len, longest, rank = describe_trainer(trainer)
    assert longest == max(p.num_tokens for p in pairs) and rank == 4
    with pytest.raises(ValueError, match="max_layers"):
        trainer.step_quantum(max_layers=2)
    result = trainer.step_quantum(max_tokens=longest + 8)
    assert result.examples == 1 and result.padded_tokens <= longest + 8
    assert trainer.start_quantum(max_tokens=10 * longest).result().examples == 3
