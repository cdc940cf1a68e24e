"""Downstream multiple-choice tasks: lm-evaluation-harness's texts and tokens, the scores of a tiny
model on the committed rows (tests/fixtures/tasks, from scripts/fixtures/make_task_fixtures.py), and the
commands' bad inputs.

The reference for a score is computed here by hand: the request's tokens made as lm-eval makes
them, one forward of the model over the unpadded window, a float64 log-softmax, the continuation's
log-probabilities summed. Tolerance: rtol 1e-5 (float32 model). The layouts: one device against
dp=2,tp=2, every item's log-likelihoods at rtol 1e-5 and the accuracies equal.
"""

import json
from pathlib import Path
from types import SimpleNamespace

import jax
import numpy as np
import pytest
from conftest import tiny_config
from helpers import exits_with_one_line, save_random_gpt2

from jaxpar.data.loader import load_dataset, read_text
from jaxpar.data.prepare import prepare
from jaxpar.data.task_files import find_task_files, read_rows
from jaxpar.data.tasks import TASKS, to_items
from jaxpar.eval import main as eval_main
from jaxpar.inference import sample
from jaxpar.models.transformer import abstract_model
from jaxpar.training.run.task_scoring import encode_pair, encode_requests

TASKS_DIR = Path(__file__).parent / "fixtures" / "tasks"
RTOL = 1e-5
BLOCK = 64


def items_of(name: str):
    files = find_task_files(str(TASKS_DIR), TASKS[name])
    return to_items(TASKS[name], read_rows(files), str(files[0]))


def test_the_texts_are_lm_evals():
    hella = TASKS["hellaswag"].to_item({
        "activity_label": "Home and Garden", "ctx_a": "[header] How to grow basil. [title] Pick a pot.",
        "ctx_b": "you", "endings": [" water it [step] daily.", "eat it."], "label": "1"})
    assert hella.pairs[0] == ("Home and Garden: How to grow basil.. Pick a pot. You", " water it daily.")
    assert hella.gold == 1 and hella.norm_chars == (len("water it daily."), len("eat it."))
    arc = TASKS["arc_easy"].to_item({"question": "Q?", "answerKey": "3",
                                     "choices": {"text": ["a", "b", "c"], "label": ["1", "2", "3"]}})
    assert arc.pairs[2] == ("Question: Q?\nAnswer:", " c") and arc.gold == 2
    piqa = TASKS["piqa"].to_item({"goal": "G", "sol1": "x", "sol2": "y", "label": 1})
    assert piqa.pairs == (("Question: G\nAnswer:", " x"), ("Question: G\nAnswer:", " y")) and piqa.gold == 1
    wino = TASKS["winogrande"].to_item({"sentence": "Ann beat Bo so _ won  it.", "option1": "Ann",
                                        "option2": "Bo", "answer": "1"})
    assert wino.pairs == (("Ann beat Bo so Ann", " won  it."), ("Ann beat Bo so Bo", " won  it."))
    assert wino.gold == 0 and wino.norm_chars is None


def test_every_fixture_task_reads(tmp_path):
    counts = {name: len(items_of(name)) for name in TASKS}
    assert counts == dict.fromkeys(TASKS, 24)
    assert {len(item.pairs) for item in items_of("hellaswag")} == {4}
    # llm.c's hellaswag_val.jsonl (label an int) reads as the Arrow folder does.
    rows = read_rows(find_task_files(str(TASKS_DIR), TASKS["hellaswag"]))
    (tmp_path / "hellaswag_val.jsonl").write_text("".join(json.dumps(r | {"label": int(r["label"])}) + "\n"
                                                          for r in rows))
    found = find_task_files(str(tmp_path), TASKS["hellaswag"])
    assert to_items(TASKS["hellaswag"], read_rows(found), "x") == items_of("hellaswag")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny random GPT-2 (block 64) with a byte-level BPE of 400 tokens learnt from 30 KB of
    Tiny Shakespeare, saved as a checkpoint."""
    root = tmp_path_factory.mktemp("tasks")
    text = root / "text.txt"
    text.write_text(read_text("")[:30_000], encoding="utf-8")
    prepare([str(text)], root / "bpe", "bpe", vocab_size=400)
    cfg = tiny_config(**{"data.path": str(root / "bpe"), "model.block_size": BLOCK})
    tokenizer = load_dataset(cfg.data, BLOCK).tokenizer
    save_random_gpt2(root / "run", cfg, tokenizer, 3, scale=0.3)
    return SimpleNamespace(run=root / "run", tokenizer=tokenizer)


def run_eval(capsys, saved, tmp_path, spec: str, tasks: str = ",".join(TASKS)):
    samples = tmp_path / f"samples_{spec}.jsonl"
    eval_main(["--ckpt", str(saved.run), "--mesh", spec, "--tasks", tasks, "--tasks-dir", str(TASKS_DIR),
               "--rows", "24", "--samples", str(samples)])
    results = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    return results, [json.loads(line) for line in samples.read_text().splitlines()]


def hand_loglikelihood(model, tokenizer, context: str, continuation: str, drop_first: bool = False):
    """lm-eval's tokens and score, by hand: float64 log-softmax of one unpadded forward."""
    context_ids = tokenizer.encode(context)
    continuation_ids = tokenizer.encode(context + continuation)[len(context_ids):]
    window = np.concatenate([context_ids, continuation_ids])[-(BLOCK + 1):]
    net, _, _ = abstract_model(model.cfg, model.vocab_size)
    with jax.set_mesh(model.mesh):
        logits = np.asarray(jax.jit(net)(model.params, window[None, :-1].astype(np.int32)), np.float64)[0]
    top = logits.max(-1, keepdims=True)
    logp = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
    picked = logp[np.arange(len(window) - 1), window[1:]]
    n = min(len(continuation_ids), len(window) - 1) - drop_first
    return picked[len(picked) - n:].sum()


def test_scores_equal_a_hand_computation_and_every_layout(capsys, saved, tmp_path):
    one, one_samples = run_eval(capsys, saved, tmp_path, "dp=1")
    assert [r["task"] for r in one] == list(TASKS) and all(r["items"] == 24 for r in one)
    assert any(r["truncated"] for r in one), "some continuation must outgrow the 64-token block"
    model = sample.load(saved.run)
    for name, item_index, choice in (("hellaswag", 3, 2), ("winogrande", 5, 1), ("arc_easy", 0, 0)):
        context, continuation = items_of(name)[item_index].pairs[choice]
        logged = next(s for s in one_samples if s["task"] == name and s["item"] == item_index)
        by_hand = hand_loglikelihood(model, saved.tokenizer, context, continuation)
        np.testing.assert_allclose(logged["loglikelihoods"][choice], by_hand, rtol=RTOL)
        # Control: a continuation scored without its first token is not within the tolerance.
        dropped = hand_loglikelihood(model, saved.tokenizer, context, continuation, drop_first=True)
        assert not np.isclose(logged["loglikelihoods"][choice], dropped, rtol=RTOL)
    four, four_samples = run_eval(capsys, saved, tmp_path, "dp=2,tp=2")
    for a, b in zip(one, four):
        assert {k: v for k, v in a.items() if k != "tokens_per_s"} == \
            {k: v for k, v in b.items() if k != "tokens_per_s"}
    np.testing.assert_allclose([ll for s in one_samples for ll in s["loglikelihoods"]],
                               [ll for s in four_samples for ll in s["loglikelihoods"]], rtol=RTOL)


def test_lm_eval_tokens_move_trailing_spaces():
    encode = lambda text: np.array([ord(c) for c in text])  # noqa: E731
    context, continuation = encode_pair(encode, "Answer: ", "yes")
    assert context.tolist() == encode("Answer:").tolist() and continuation.tolist() == encode(" yes").tolist()


def test_a_character_model_scores_what_it_can(capsys, tmp_path):
    from jaxpar.data.tokenizer import CharTokenizer
    tokenizer = CharTokenizer.from_text("abcdefghijklmnopqrstuvwxyz ")
    req = encode_requests(items_of("piqa")[:2], tokenizer, block=16)
    assert req.dropped_chars > 0 and req.inputs.shape == (4, 16) and req.truncated > 0
    assert (req.inputs < tokenizer.vocab_size).all()


def word_level(words: list[str]):
    """A tokenizer.json that splits on whitespace and drops it: " " alone gives no token."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from jaxpar.data.tokenizer import HFTokenizer
    hf = Tokenizer(models.WordLevel({w: i for i, w in enumerate(["[UNK]", "<|endoftext|>"] + words)},
                                    unk_token="[UNK]"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    return HFTokenizer(hf, "words.json")


def test_an_item_with_a_choice_that_has_nothing_to_score_is_left_out():
    """Spaces give the word-level tokenizer no token (a score of 0 would win); an empty choice
    has a token, " ", for characters, but acc_norm would divide by its 0 characters."""
    from jaxpar.data.tokenizer import CharTokenizer
    rows = [{"goal": "the cat", "sol1": "   ", "sol2": "a cat", "label": 0},
            {"goal": "the cat", "sol1": "the", "sol2": "a cat", "label": 1},
            {"goal": "the cat", "sol1": "a", "sol2": "", "label": 1}]
    items = to_items(TASKS["piqa"], rows, "x")
    req = encode_requests(items, word_level(["the", "a", "cat"]), block=16)
    assert (req.unscored, req.indices, len(req.inputs)) == (2, [1], 2)
    assert req.scored.sum(axis=1).tolist() == [1, 2]
    req = encode_requests(items, CharTokenizer.from_text("Question: \nAnswertheca"), block=64)
    assert (req.unscored, req.indices, len(req.inputs)) == (1, [0, 1], 4)


def test_a_task_with_no_item_left_to_score_is_one_line(capsys, saved, tmp_path):
    (tmp_path / "piqa.jsonl").write_text("".join(json.dumps({"goal": "G", "sol1": "", "sol2": s, "label": 0}) + "\n"
                                                 for s in ("", "x")))
    exits_with_one_line(capsys, "jaxpar.eval", lambda: eval_main(
        ["--ckpt", str(saved.run), "--tasks", "piqa", "--tasks-dir", str(tmp_path)]),
        "piqa.jsonl: none of the 2 piqa items can be scored", "nothing to score")


@pytest.mark.parametrize("argv, expected", [
    (["--tasks", "hellaswag", "--tasks-dir", "/nonexistent"], ["tasks directory '/nonexistent' does not exist"]),
    (["--tasks", "hellaswag,mmlu", "--tasks-dir", str(TASKS_DIR)], ["unknown task 'mmlu'", "arc_easy"]),
    (["--tasks", "piqa", "--tasks-dir", str(TASKS_DIR), "--limit", "0"], ["--limit must be at least 1"]),
    (["--tasks-dir", str(TASKS_DIR)], ["--tasks-dir is for --tasks"]),
    (["--tasks", "piqa"], ["--tasks needs --tasks-dir"]),
])
def test_bad_task_arguments_are_one_line(capsys, saved, argv, expected):
    exits_with_one_line(capsys, "jaxpar.eval", lambda: eval_main(["--ckpt", str(saved.run)] + argv), *expected)


def test_rows_that_do_not_fit_the_task_are_one_line(capsys, saved, tmp_path):
    (tmp_path / "piqa.jsonl").write_text(json.dumps({"goal": "G", "sol1": "x", "label": 0}) + "\n")
    (tmp_path / "arc_easy.jsonl").write_text("{not json\n")
    for task, expected in (("piqa", ["piqa.jsonl: row 0 is not a piqa row", "sol2"]),
                           ("arc_easy", ["arc_easy.jsonl: line 1 is not JSON"])):
        exits_with_one_line(capsys, "jaxpar.eval", lambda: eval_main(
            ["--ckpt", str(saved.run), "--tasks", task, "--tasks-dir", str(tmp_path)]), *expected)


def test_tasks_are_scored_during_training(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from jaxpar.train import run
    out = tmp_path / "run"
    cfg = tiny_config(**{"mesh.dp": 2, "eval.tasks": "hellaswag,winogrande", "eval.tasks_dir": TASKS_DIR,
                         "eval.tasks_limit": 4, "eval.tasks_every": 4})
    run(cfg, out, devices=jax.devices()[:2], progress=False)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    scored = {r["step"]: r for r in records if "hellaswag/acc" in r}
    assert sorted(scored) == [0, 4, 8, 10]
    assert set(scored[10]) == {"step", "hellaswag/acc", "hellaswag/acc_norm", "winogrande/acc"}
    assert all(0 <= v <= 1 for r in scored.values() for k, v in r.items() if k != "step")
    events = EventAccumulator(str(out / "tensorboard")).Reload()
    assert [e.step for e in events.Scalars("eval/hellaswag/acc")] == [0, 4, 8, 10]
    from jaxpar.training.run.loss_plots import plot_after_training
    plot_after_training(out)
    width = int.from_bytes((out / "loss.png").read_bytes()[16:20], "big")
    assert width == 1400, "the accuracies get a second panel beside the losses"


@pytest.mark.parametrize("flags, expected", [
    (["--eval.tasks=hellaswag,mmlu", f"--eval.tasks_dir={TASKS_DIR}"], ["unknown task 'mmlu'"]),
    (["--eval.tasks=hellaswag"], ["eval.tasks needs eval.tasks_dir"]),
])
def test_bad_task_settings_stop_training_before_it_writes(capsys, tmp_path, flags, expected):
    from helpers import fails_with
    fails_with(capsys, tmp_path, ["--config", "tiny", "--mesh", "dp=8"] + flags, *expected)
