"""Labels are the answers to their questions: every shipped example's train and validation rows, regenerated here,
pass an exact audit (fractions, not floats, written independently of reasoning-gym); the audit catches reasoning-gym
0.1.25's mislabelled divisions; `hf data check` reports a config's rows, duplicates, lengths and failing labels; and
`hf run` refuses failing labels before any work. Real reasoning-gym, real files, the real CLI and tiny model."""

import json
from fractions import Fraction
from pathlib import Path

import pytest
from typer.testing import CliRunner

from hybridflow.cli.main import app
from hybridflow.engine.audit import arithmetic_audit, audit_rows, exact_value, question_expression
from hybridflow.engine.config import load_config
from hybridflow.engine.data import build_prompt_rows, reasoning_gym_rows
from hybridflow.flows.store.run_store import RunStore

ROOT = Path(__file__).resolve().parent.parent
RL_EXAMPLES = sorted(  # hf rm train's, hf dpo train's and hf sft train's configs have no RL prompts to audit
    p for p in (ROOT / "examples").glob("*.yaml") if not p.name.startswith(("rm_", "dpo_")) and "_sft_" not in p.name
)
# The main job's task before issue 29: reasoning-gym's generator without parentheses, all four operators.
OLD_MAIN_JOB = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1, "allow_parentheses": False,
                "allow_negation": False}  # fmt: skip


def _row(question: str, label, source: str = "arithmetic") -> dict:
    return {"data_source": source, "prompt": [{"role": "user", "content": question}], "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": label}, "extra_info": {}}  # fmt: skip


def test_exact_value_is_exact_and_refuses_what_is_not_arithmetic():
    assert exact_value("7 / 2") == Fraction(7, 2)
    assert exact_value("2 + 3 * 4") == 14 and exact_value("( 2 + 3 ) * 4") == 20
    assert exact_value("-( -9 / 9 ) - -4") == 5
    assert exact_value("1 / 3 * 3") == 1  # no float rounding
    assert exact_value("0.1 + 0.2") == Fraction(3, 10)
    with pytest.raises(ZeroDivisionError, match="division by zero in '9 / 0'"):
        exact_value("9 / 0")
    with pytest.raises(ZeroDivisionError):
        exact_value("1 / ( 2 - 2 )")
    for bad in ("2 ** 3", "7 // 2", "x + 1", "__import__('os')", "1 +"):
        with pytest.raises(ValueError, match="not an arithmetic expression"):
            exact_value(bad)


def test_question_expression_reads_each_phrasing():
    assert question_expression("Calculate 4 / 1.\nGive only the final answer.") == "4 / 1"
    assert question_expression("What is -3 * 2?") == "-3 * 2"
    assert question_expression("Evaluate: ( 2 + -8 ).") == "( 2 + -8 )"
    with pytest.raises(ValueError, match="no arithmetic expression"):
        question_expression("Name a colour.")


def test_arithmetic_audit_names_each_kind_of_problem():
    assert arithmetic_audit(_row("Calculate 4 / 1.", "4")) is None
    assert arithmetic_audit(_row("Calculate 6 / 4.", "3/2")) is None
    assert arithmetic_audit(_row("Calculate 4 / 1.", "2")) == "'4 / 1' = 4, labelled '2'"
    assert "division by zero" in arithmetic_audit(_row("Calculate 9 / 0.", "3"))
    assert "not a number" in arithmetic_audit(_row("Calculate 2 + 2.", "four"))
    assert "no label" in arithmetic_audit(_row("Calculate 2 + 2.", None))
    result = audit_rows([_row("2 + 2", "4"), _row("2 + 2", "5"), _row("hi", "x", source="openai/gsm8k")])
    assert (result.audited, result.unaudited) == (2, {"openai/gsm8k": 1})
    assert [f[0] for f in result.failures] == [1]


def test_the_audit_catches_reasoning_gyms_mislabelled_divisions():
    """The main job's configuration before issue 29: a fifth of its rows label another question than they print."""
    rows = reasoning_gym_rows("basic_arithmetic", 2200, 0, OLD_MAIN_JOB)
    result = audit_rows(rows)
    assert result.audited == 2200
    assert len(result.failures) == 494  # 461 of the first 2,000 rows and 33 of the last 200
    first = {question: problem for _, _, question, problem in result.failures[:2]}
    assert first["Calculate 4 / 1."] == "'4 / 1' = 4, labelled '2'"
    assert all(" / " in question for _, _, question, _ in result.failures)
    # without "/" (what the examples use now) the same generator is exact
    fixed = reasoning_gym_rows("basic_arithmetic", 2200, 0, {**OLD_MAIN_JOB, "operators": ["+", "-", "*"]})
    assert audit_rows(fixed).failures == []


@pytest.mark.parametrize("example", RL_EXAMPLES, ids=lambda p: p.stem)
def test_every_example_trains_and_validates_on_true_labels(example):
    cfg = load_config(example, ["reward_model.path=unused"])  # ppo_rm_smollm2 names its RM on the command line
    train, val = build_prompt_rows(cfg.data)
    for split, rows in (("train", train), ("val", val)):
        result = audit_rows(rows)
        assert result.unaudited == {}, f"{example.name} {split}: no audit for {result.unaudited}"
        assert result.audited == len(rows) > 0
        assert result.failures == [], f"{example.name} {split}: {result.failures[:3]}"


def _jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_hf_data_check_reports_rows_duplicates_lengths_and_labels(tmp_path, tiny_model_dir):
    train = _jsonl(
        tmp_path / "train.jsonl",
        [
            _row("Calculate 2 + 3.", "5"),
            _row("Calculate 4 / 1.", "2"),
            _row("Calculate 6 * 7.", "42"),
            _row("Calculate 1 - 9.", "-8"),
        ],
    )
    long_question = "Calculate " + " + ".join(["1"] * 60) + "."
    val = _jsonl(tmp_path / "val.jsonl", [_row("Calculate 6 * 7.", "42"), _row(long_question, "60")])
    args = ["data", "check", str(ROOT / "examples" / "grpo_tiny.yaml"), "-o", f"model.path={tiny_model_dir}",
            "-o", "data.reasoning_gym=null", "-o", f"data.train_files={train}", "-o", f"data.val_files={val}",
            "-o", "data.max_prompt_length=64"]  # fmt: skip
    result = CliRunner().invoke(app, args)
    out = " ".join(result.output.split())
    assert result.exit_code == 1, out
    assert "train row 1 (arithmetic) Calculate 4 / 1.: '4 / 1' = 4, labelled '2'" in out
    assert "1 of 4 audited train labels are not the value of their question" in out
    assert "validation prompts also in the training set: 1" in out
    assert "train: prompt tokens" in out and "val: label characters" in out
    over = [line for line in result.output.splitlines() if line.startswith("│ val")]
    assert over and over[0].split("│")[5].strip() == "1", result.output  # the 60-term question is over 64 tokens

    good = _jsonl(tmp_path / "good.jsonl", [_row("Calculate 2 + 3.", "5"), _row("Calculate 1 - 9.", "-8")])
    args[args.index(f"data.train_files={train}")] = f"data.train_files={good}"
    args[args.index(f"data.val_files={val}")] = "data.val_files=[]"
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "data check passed" in result.output


def test_hf_run_refuses_false_labels_before_any_work(tmp_path, tiny_model_dir):
    db = f"sqlite:///{tmp_path / 'runs.db'}"
    old = json.dumps({**OLD_MAIN_JOB, "operators": ["+", "-", "*", "/"]})
    args = ["run", str(ROOT / "examples" / "grpo_tiny.yaml"), "--db", db, "-o", f"model.path={tiny_model_dir}",
            "-o", f"trainer.output_dir={tmp_path / 'out'}", "-o", f"data.reasoning_gym.config={old}"]  # fmt: skip
    result = CliRunner().invoke(app, args)
    out = " ".join(result.output.split())
    assert result.exit_code == 2, out
    assert "training labels are not the value of their question" in out
    assert "hf data check CONFIG" in out and "data.audit_labels=false" in out
    assert RunStore(db).list_runs() == [] and not (tmp_path / "out").exists()


def test_letter_counting_audit_recounts_the_quoted_text():
    from hybridflow.engine.audit import letter_counting_audit

    question = 'How many times does the letter "h" appear in the text: "Hundred thousand names and then Mr Fritz"?'
    assert letter_counting_audit(_row(question, "3", "reasoning_gym/letter_counting")) is None
    assert "appears 3 times" in letter_counting_audit(_row(question, "2", "reasoning_gym/letter_counting"))
    assert "no letter" in letter_counting_audit(_row("Count something.", "1", "reasoning_gym/letter_counting"))
