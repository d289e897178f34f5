"""The exported GGUF in a real llama.cpp (llama-cpp-python 0.3.36, built from its sdist, which
vendors llama.cpp): `llamacpp` tier, .ci/tier_llamacpp.sh.

For the tiny model and for SmolLM2 with a trained adapter, against the merged transformers
model's (fp32) greedy continuation of 8 prompts (16 new tokens): the f32 file's equals it token
for token; so does the f16 file's, except where the merged model is itself at a tie (top two
logits within TIE), where f16 rounding may take the other token (measured on SmolLM2: one of 8
prompts, a gap of 0.001 at its 13th token; at most one allowed). The q8_0 file is measured
against the same continuation: its greedy agreement, and the mean absolute difference of the
log-probability of each of the merged model's tokens, teacher-forced, with a bound.
Prompts go in as token ids, so llama.cpp runs exactly what transformers runs; separately,
llama.cpp's own tokenizer must give SmolLM2's chat prompts the ids transformers gives them.
"""

from __future__ import annotations

import json

import pytest
import torch

from ebpo_lite import config
from ebpo_lite.commands.export import export_run
from ebpo_lite.train import train
from tests import smollm2_common as common
from tests.conftest import TINY_RECIPE, fast_overrides

pytestmark = pytest.mark.llamacpp
llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python not installed")

NEW = 16
TIE = 0.02  # top-two logit gap under which f16 rounding may choose either token
QUESTIONS = [
    "What is 35-8?",
    "What is 12+79?",
    "Sam has 12 apples and eats 5. How many are left?",
    "Name a primary colour.",
    "What is the capital of France?",
    "Write one word that rhymes with cat.",
    "What is 7 times 6?",
    "Say hello in Spanish.",
]


def _greedy_hf(model, prompt: list[int], eos: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=NEW,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=eos,
        )
    return out[0, len(prompt) :].tolist()


def _logprobs_hf(model, prompt: list[int], cont: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + cont])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(cont)[:, None])[:, 0]


class LlamaCpp:
    def __init__(self, path):
        self.llm = llama_cpp.Llama(
            model_path=str(path), n_ctx=512, n_threads=2, logits_all=True, verbose=False
        )

    def greedy(self, prompt: list[int], eos: int) -> list[int]:
        self.llm.reset()
        self.llm.eval(prompt)
        out = []
        for _ in range(NEW):
            tok = int(self.llm.scores[self.llm.n_tokens - 1].argmax())
            out.append(tok)
            if tok == eos:
                break
            self.llm.eval([tok])
        return out

    def logprobs(self, prompt: list[int], cont: list[int]) -> torch.Tensor:
        self.llm.reset()
        self.llm.eval(prompt + cont)
        rows = torch.from_numpy(self.llm.scores[len(prompt) - 1 : len(prompt) + len(cont) - 1])
        return torch.log_softmax(rows.float(), -1).gather(1, torch.tensor(cont)[:, None])[:, 0]


def _first_difference(model, prompt, want, got) -> tuple[int, float] | None:
    """Where llama.cpp's continuation leaves the merged model's, and the merged model's own gap
    between its top two logits there (a tie at 16-bit precision when tiny); None if equal."""
    if got == want:
        return None
    k = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), min(len(want), len(got)))
    with torch.no_grad():
        logits = model(torch.tensor([prompt + want[:k]])).logits[0, -1].float()
    top = torch.topk(logits, 2).values
    return k, (top[0] - top[1]).item()


def _compare(run, export, prompts, eos, report):
    """f32 file: the merged model's greedy continuations exactly. f16 file: the same, except
    where the merged model itself is at a tie (its top two logits within TIE): there f16
    rounding may pick the other token, and the rest of that continuation is not compared.
    q8_0 file: greedy agreement and teacher-forced log-prob differences, measured."""
    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(export / "merged", dtype=torch.float32).eval()
    want = [_greedy_hf(merged, p, eos) for p in prompts]
    assert sum(map(len, want)) >= len(prompts) * 2  # real continuations, not all EOS at once
    files = {"f16": export / "model-f16.gguf"}
    for qtype in ("f32", "q8_0"):
        files[qtype] = export_run(run, export.parent / qtype, gguf=qtype) / f"model-{qtype}.gguf"
    f32 = LlamaCpp(files["f32"])
    assert [f32.greedy(p, eos) for p in prompts] == want
    f16 = LlamaCpp(files["f16"])
    f16_got = [f16.greedy(p, eos) for p in prompts]
    where = [_first_difference(merged, p, w, g) for p, w, g in zip(prompts, want, f16_got)]
    ties = [d for d in where if d is not None]
    assert all(gap < TIE for _, gap in ties), ties
    q8 = LlamaCpp(files["q8_0"])
    agree = sum(q8.greedy(p, eos) == w for p, w in zip(prompts, want))

    def mean_abs_diff(llm):
        diffs = [
            (llm.logprobs(p, w) - _logprobs_hf(merged, p, w)).abs()
            for p, w in zip(prompts, want)
            if w
        ]
        return torch.cat(diffs).mean().item()

    report.update(
        f32_greedy_equal=f"{len(prompts)}/{len(prompts)}",
        f16_greedy_equal=f"{len(prompts) - len(ties)}/{len(prompts)}",
        f16_ties=[{"token": k, "merged_top2_gap": round(gap, 5)} for k, gap in ties],
        f16_mean_abs_logprob_diff=round(mean_abs_diff(f16), 5),
        q8_0_greedy_agreement=f"{agree}/{len(prompts)}",
        q8_0_mean_abs_logprob_diff=round(mean_abs_diff(q8), 5),
    )
    print(json.dumps(report))
    for llm in (f32, f16, q8):
        llm.llm.close()
    return (
        len(ties),
        agree,
        report["q8_0_mean_abs_logprob_diff"],
        report["f16_mean_abs_logprob_diff"],
    )


def test_tiny_model_in_llama_cpp(tmp_path):
    from ebpo_lite.data.loader import arithmetic_examples
    from ebpo_lite.model.tiny import build_tokenizer

    run = tmp_path / "run"
    train(config.load(TINY_RECIPE, fast_overrides(run)))
    export = export_run(run, tmp_path / "export", merge=True, gguf="f16")
    tok = build_tokenizer()
    prompts = [tok.encode(e.prompt) for e in arithmetic_examples(8, seed=5, split="test")]
    ties, agree, q8, f16 = _compare(run, export, prompts, tok.eos_token_id, {"model": "tiny"})
    assert ties <= 1 and agree >= 4 and q8 < 0.05 and f16 < 0.01  # measured: 8/8, 0.002


def test_smollm2_with_a_trained_adapter_in_llama_cpp(tmp_path):
    from transformers import AutoTokenizer

    data = common.questions(tmp_path)
    run = tmp_path / "run"
    train(config.load(None, common.overrides(run, data, "hf", **{"train.steps": 1})))
    export = export_run(run, tmp_path / "export", merge=True, gguf="f16")
    tok = AutoTokenizer.from_pretrained(export)
    texts = [
        tok.apply_chat_template(
            [{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True
        )
        for q in QUESTIONS
    ]
    prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    eos = tok.convert_tokens_to_ids(common.IM_END)
    ties, agree, q8, f16 = _compare(run, export, prompts, eos, {"model": "smollm2"})
    # q8_0, measured: 5/8 continuations equal over 16 tokens, 0.040 nats mean difference; the
    # bounds (half agree, under 0.1 nats) were set after that measurement, with room for ISAs
    assert ties <= 1 and agree >= 4 and q8 < 0.1 and f16 < 0.02
    # llama.cpp's own tokenizer (pre-tokenizer `smollm`) on the chat prompts, specials parsed
    llm = LlamaCpp(export / "model-f16.gguf").llm
    for text, ids in zip(texts, prompts):
        assert llm.tokenize(text.encode(), add_bos=False, special=True) == ids
    llm.close()


def test_llama3_rope_scaling_reaches_llama_cpp(tmp_path, monkeypatch):
    """A random small Llama with Llama 3.1's rope scaling (short original context, so most
    pairs are scaled) and SmolLM2's byte-level tokenizer: llama.cpp's f32 greedy continuation
    equals transformers'; the same file without `rope_freqs` does not, so the tensor is what
    carries the scaling."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from ebpo_lite.model import base_model, gguf_export

    tokenizer_dir = base_model.converted(base_model.packaged_gguf(), log=lambda _: None)
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=49152, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 64},
    )  # fmt: skip
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # larger weights: a sharper, position-sensitive random model
        for p in model.parameters():
            p.mul_(4.0 if p.ndim == 2 else 1.0)
    folder = tmp_path / "llama3"
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_bytes((tokenizer_dir / name).read_bytes())
    file = gguf_export.write_gguf(folder, tmp_path / "m.gguf", "f32", log=lambda _: None)
    prompts = [[1, 100 + 37 * i, 200 + 11 * i, 300 + i] * 12 for i in range(4)]  # 48 tokens
    want = [_greedy_hf(model, p, 0) for p in prompts]
    llm = LlamaCpp(file)
    assert [llm.greedy(p, 0) for p in prompts] == want
    llm.llm.close()
    plain = tmp_path / "plain.gguf"  # the same writer, the scaling dropped
    monkeypatch.setattr(gguf_export, "rope_freqs", lambda config: None)
    gguf_export.write_gguf(folder, plain, "f32", log=lambda _: None)
    llm = LlamaCpp(plain)
    assert [llm.greedy(p, 0) for p in prompts] != want
    llm.llm.close()
