"""mathdata: presets over the real schemas, local files, bad rows, labels, prompts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ebpo_lite.config import DataConfig
from ebpo_lite.data import mathdata, prompts
from ebpo_lite.data.loader import Example
from ebpo_lite.errors import UserError
from ebpo_lite.rewards import math_answer
from tests.conftest import DATA

needs_data = pytest.mark.skipif(
    not DATA.is_dir(), reason=f"{DATA} absent: set EBPO_LITE_DATA to the math data folder"
)


@pytest.fixture(autouse=True)
def _data_root(monkeypatch):
    monkeypatch.setenv("EBPO_LITE_DATA", str(DATA))


def _write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


# ----------------------------------------------------------------------------- shared data


@needs_data
def test_benchmarks_load_with_normalised_answers():
    counts = {
        "math500": 500,
        "aime24": 30,
        "aime25": 30,
        "amc23": 40,
        "olympiadbench": 675,
        "gsm8k": 1319,
    }
    loaded = {name: mathdata.load_benchmark(name) for name in counts}
    assert {k: len(v) for k, v in loaded.items()} == counts
    m = loaded["math500"][0]
    assert m.answer == r"\left( 3, \frac{\pi}{2} \right)"
    assert (m.topic, m.difficulty, m.meta["unique_id"]) == (
        "Precalculus",
        2.0,
        "test/precalculus/807.json",
    )
    raw_aime = [json.loads(x) for x in (DATA / "aime24/test.jsonl").read_text().splitlines()]
    assert [e.answer for e in loaded["aime24"]] == [str(int(r["answer"])) for r in raw_aime]
    assert loaded["aime25"][0].answer == "70"
    assert not loaded["aime25"][0].prompt.endswith("\\boxed{}.")  # QwQ instruction removed
    assert loaded["amc23"][0].answer == "27"
    ob = loaded["olympiadbench"]
    assert ob[0].topic == "Combinatorics" and all("$" not in e.answer for e in ob)
    gsm = loaded["gsm8k"]
    raw = [json.loads(x) for x in (DATA / "gsm8k/test.jsonl").read_text().splitlines()]
    commas = [i for i, r in enumerate(raw) if "," in r["answer"].split("####")[-1]]
    assert commas and all(gsm[i].answer.lstrip("-").isdigit() for i in commas)
    # every integer gold round-trips through the reward
    ints = gsm + loaded["aime24"] + loaded["aime25"] + loaded["amc23"]
    assert math_answer([f"\\boxed{{{e.answer}}}" for e in ints], [e.answer for e in ints]) == [
        1.0
    ] * len(ints)


@needs_data
def test_training_presets_and_held_out_sets():
    gsm = mathdata.load_examples(DataConfig(name="gsm8k"))
    assert len(gsm) == 7473 and gsm[0].answer == "72" and gsm.skipped == 0
    math = mathdata.load_examples(DataConfig(name="math"))
    assert (len(math), math.unscorable) == (7470, 4)  # 2 null + 2 empty answers dropped
    assert math[0].topic == "Algebra" and math[0].difficulty == 5.0
    aime = mathdata.load_examples(DataConfig(name="aime"))
    assert len(aime) == 975 and aime[0].meta["year"] >= 1983
    assert len(mathdata.load_eval_examples(DataConfig(name="gsm8k"))) == 1319
    assert len(mathdata.load_eval_examples(DataConfig(name="math"))) == 500
    assert mathdata.load_eval_examples(DataConfig(path=str(DATA / "gsm8k/train.jsonl"))) == []


@needs_data
def test_auto_preset_from_path_and_from_fields(tmp_path):
    ex = mathdata.load_examples(DataConfig(path=str(DATA / "aime24/qwq_aime24.jsonl")))
    assert len(ex) == 30 and ex[0].answer == "204"
    rows = [json.loads(x) for x in (DATA / "gsm8k/test.jsonl").read_text().splitlines()[:5]]
    anon = _write_jsonl(tmp_path / "mystery.jsonl", rows)  # no hint in the name
    ex = mathdata.load_examples(DataConfig(path=str(anon)))
    assert [e.answer for e in ex] == [r["answer"].split("####")[-1].strip() for r in rows]


def test_unknown_benchmark_and_missing_root(tmp_path, monkeypatch):
    with pytest.raises(UserError, match="unknown"):
        mathdata.load_benchmark("mmlu")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # not in the folder: the hub, here switched off
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    for module in ("huggingface_hub.constants", "datasets.config"):
        monkeypatch.setattr(f"{module}.HF_HUB_OFFLINE", True)
    with pytest.raises(UserError, match="HuggingFaceH4/MATH-500.*EBPO_LITE_DATA"):
        mathdata.load_benchmark("math500", data_root=tmp_path)


# ----------------------------------------------------------------------------- other schemas

DAPO_ROW = {
    "data_source": "math_dapo",
    "prompt": [
        {
            "role": "user",
            "content": (
                "Solve the following math problem step by step. The last line of your response should "
                "be of the form Answer: $Answer (without quotes) where $Answer is the answer to the "
                "problem.\n\nFind $x$ if $2x = 10$.\n\nRemember to put your answer on its own line "
                'after "Answer:".'
            ),
        }
    ],
    "ability": "MATH",
    "reward_model": {"ground_truth": "5", "style": "rule-lighteval/MATH_v2"},
    "extra_info": {"index": "a1"},
}


def test_dapo_math_jsonl_and_parquet(tmp_path):
    path = _write_jsonl(tmp_path / "dapo-math-17k.jsonl", [DAPO_ROW])
    (ex,) = mathdata.load_examples(DataConfig(path=str(path)))
    assert ex.prompt == "Find $x$ if $2x = 10$." and ex.answer == "5"
    assert ex.meta == {"data_source": "math_dapo", "ability": "MATH"}
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    pq.write_table(pa.Table.from_pylist([DAPO_ROW, DAPO_ROW]), tmp_path / "train.parquet")
    ex = mathdata.load_examples(DataConfig(path=str(tmp_path / "train.parquet"), preset="auto"))
    assert [e.answer for e in ex] == ["5", "5"]  # guessed from fields (prompt + reward_model)


def test_deepscaler_and_generic_mapping(tmp_path):
    path = _write_jsonl(
        tmp_path / "deepscaler.jsonl",
        [{"problem": "p", "answer": "\\frac{1}{2}", "solution": "long..."}],
    )
    (ex,) = mathdata.load_examples(DataConfig(path=str(path)))
    assert (ex.prompt, ex.answer, ex.meta) == ("p", "\\frac{1}{2}", {})
    rows = [{"q": {"text": "2+2?"}, "sol": {"final": 4}, "area": "arith", "hard": "Level 2"}]
    path = _write_jsonl(tmp_path / "custom.jsonl", rows)
    cfg = DataConfig(
        path=str(path),
        prompt_field="q.text",
        answer_field="sol.final",
        topic_field="area",
        difficulty_field="hard",
    )
    (ex,) = mathdata.load_examples(cfg)
    assert (ex.prompt, ex.answer, ex.topic, ex.difficulty) == ("2+2?", "4", "arith", 2.0)


def test_question_answer_fields_load_without_settings(tmp_path):
    # the most common schema there is: it used to stop with "cannot guess the schema"
    plain = _write_jsonl(tmp_path / "mine.jsonl", [{"question": "12 + 35?", "answer": "47"}])
    (ex,) = mathdata.load_examples(DataConfig(path=str(plain)))
    assert (ex.prompt, ex.answer) == ("12 + 35?", "47")
    # GSM8K's answers carry their working and end in "#### n": only n is the answer
    gsm = [{"question": "3 + 4?", "answer": "3 + 4 = <<3+4=7>>7\n#### 7"}]
    (ex,) = mathdata.load_examples(DataConfig(path=str(_write_jsonl(tmp_path / "q.jsonl", gsm))))
    assert (ex.prompt, ex.answer) == ("3 + 4?", "7")


def test_cannot_guess_schema(tmp_path):
    path = _write_jsonl(tmp_path / "x.jsonl", [{"foo": 1, "bar": 2}])
    with pytest.raises(UserError, match=r"cannot guess the schema \(fields: foo, bar\)"):
        mathdata.load_examples(DataConfig(path=str(path)))


# ----------------------------------------------------------------------------- bad rows


def test_bad_rows_name_file_line_and_field(tmp_path):
    good = {"problem": "p", "answer": "1"}
    bad_json = _write_jsonl(tmp_path / "a.jsonl", [good, good, '{"problem": "p", "answer": '])
    with pytest.raises(UserError, match=r"a\.jsonl:3: invalid JSON"):
        mathdata.load_examples(DataConfig(path=str(bad_json), preset="math"))
    missing = _write_jsonl(tmp_path / "b.jsonl", [good, {"problem": "p"}])
    with pytest.raises(UserError, match=r"b\.jsonl:2: answer: missing field"):
        mathdata.load_examples(DataConfig(path=str(missing), preset="math"))
    wrong = _write_jsonl(tmp_path / "c.jsonl", [{"problem": ["x", 1], "answer": "1"}])
    with pytest.raises(UserError, match=r"c\.jsonl:1: problem: expected a string"):
        mathdata.load_examples(DataConfig(path=str(wrong), preset="math"))
    wrong = _write_jsonl(tmp_path / "d.jsonl", [good, {"problem": "p", "answer": {"v": 1}}])
    with pytest.raises(UserError, match=r"d\.jsonl:2: answer: expected a string, number"):
        mathdata.load_examples(DataConfig(path=str(wrong), preset="math"))


def test_skip_bad_rows_reports_count(tmp_path, caplog):
    rows = [
        {"problem": "p1", "answer": "1"},
        "not json",
        {"problem": "p2"},
        [1, 2],
        {"problem": "p3", "answer": None},
        {"problem": "p4", "answer": 4},
    ]
    path = _write_jsonl(tmp_path / "mix.jsonl", rows)
    ex = mathdata.load_examples(DataConfig(path=str(path), preset="math", skip_bad_rows=True))
    assert [e.answer for e in ex] == ["1", "4"]
    assert (ex.skipped, ex.unscorable) == (3, 1)
    assert ex.first_error.startswith(f"{path}:2: invalid JSON")
    assert "skipped 3 bad rows" in caplog.text


def test_json_array_errors_give_the_line(tmp_path):
    text = '[\n  {"problem": "p", "answer": "1"},\n  {"problem": "q"},\n  {"problem": "r"}\n]'
    (tmp_path / "arr.json").write_text(text)
    with pytest.raises(UserError, match=r"arr\.json:3: answer: missing field"):
        mathdata.load_examples(DataConfig(path=str(tmp_path / "arr.json"), preset="math"))
    (tmp_path / "broken.json").write_text('[\n {"problem": "p", "answer": "1"},\n {"problem": }\n]')
    with pytest.raises(UserError, match=r"broken\.json:3: invalid JSON"):
        mathdata.load_examples(DataConfig(path=str(tmp_path / "broken.json"), preset="math"))
    with pytest.raises(UserError, match="data file not found"):
        mathdata.load_examples(DataConfig(path=str(tmp_path / "nope.jsonl")))


def test_hub_offline_is_a_user_error():
    code = (
        "from ebpo_lite.data import mathdata\nfrom ebpo_lite.config import DataConfig\n"
        "from ebpo_lite.errors import UserError\n"
        "try:\n    mathdata.load_examples(DataConfig(name='someone/some-math-set'))\n"
        "except UserError as e:\n    print('USERERROR', e)\n"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert "USERERROR data.name: the hub dataset someone/some-math-set is not in" in out.stdout
    assert "set data.path" in out.stdout


# ----------------------------------------------------------------------------- labels


def test_apply_labels(tmp_path):
    exs = [Example(prompt=f"p{i}", answer=str(i), topic=None, difficulty=None) for i in range(3)]
    labels = _write_jsonl(
        tmp_path / "labels.jsonl",
        [
            {"index": 0, "topic": "algebra", "pass_rate": 0.25},
            {"index": 2, "difficulty": 4, "prompt_sha1": prompts.prompt_digest("p2")},
        ],
    )
    out = mathdata.apply_labels(exs, labels)
    assert (out[0].topic, out[0].difficulty, out[0].meta) == ("algebra", 0.75, {"pass_rate": 0.25})
    assert out[1] == exs[1]
    assert out[2].difficulty == 4.0 and exs[2].difficulty is None  # inputs not mutated
    for rows, pattern in [
        ([{"index": 3}], r"labels2\.jsonl:1: index: 3 out of range \(3 examples\)"),
        ([{"index": 0}, {"index": 1, "pass_rate": 1.5}], r":2: pass_rate: expected a number"),
        ([{"index": 0, "prompt_sha1": "deadbeef"}], r":1: prompt_sha1: does not match"),
        ([{"topic": "x"}], r":1: index: missing field"),
    ]:
        with pytest.raises(UserError, match=pattern):
            mathdata.apply_labels(exs, _write_jsonl(tmp_path / "labels2.jsonl", rows))


# ----------------------------------------------------------------------------- prompts

TINY_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n{% endif %}"
    "{% endif %}"
)


def test_format_prompt_plain_and_chat_with_thinking_switch():
    from ebpo_lite.model.tiny import build_tokenizer

    tok = build_tokenizer()
    ex = Example(prompt="What is 1+1?", answer="2")
    assert prompts.format_prompt(tok, ex) == (
        "Please reason step by step, and put your final answer within \\boxed{}.\n\n"
        "Question: What is 1+1?\nAnswer:"
    )
    tok.chat_template = TINY_TEMPLATE
    no_think = prompts.format_prompt(tok, ex, system_prompt="Box it.")
    assert no_think == "<system>Box it.\n<user>What is 1+1?\n<assistant><think>\n\n</think>\n"
    think = prompts.format_prompt(tok, ex, system_prompt="Box it.", thinking=True)
    assert think == "<system>Box it.\n<user>What is 1+1?\n<assistant>"
    assert (
        prompts.format_prompt(tok, "Q", system_prompt="", thinking=True) == "<user>Q\n<assistant>"
    )
    tok.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'system' %}"
        "{{ raise_exception('System role not supported') }}{% endif %}"
        "[{{ m['content'] }}]{% endfor %}"
    )
    assert prompts.format_prompt(tok, ex, system_prompt="S") == "[S\n\nWhat is 1+1?]"
