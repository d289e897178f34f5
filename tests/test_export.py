"""`ebpo_lite.commands.export`: the complete adapter, the merged weights, the model card, the hub upload.

One real tiny run (norms trained, `model.trainable_extra: [norm]`) is exported; the trained
policy's logits (the run's policy with its checkpoint loaded, as `ebpo_lite.eval` builds it) are
compared with those of what a user loads from the export folder.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from ebpo_lite import config
from ebpo_lite.commands.export import export_run, main
from ebpo_lite.errors import UserError
from ebpo_lite.eval import load_policy
from ebpo_lite.train import train
from tests.conftest import REPO, TINY_RECIPE, fast_overrides

PROMPTS = ["12+7=", "305-18=", "9*8=", "47+85="]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """3 steps whose norms really move: 16 prompts and a length penalty give every step
    groups with unequal rewards, so a gradient."""
    out = tmp_path_factory.mktemp("export") / "tiny_run"
    extra = {
        "train.prompts_per_step": 16,
        "reward.length_penalty": 0.5,
        "reward.length_penalty_start": 0.25,
        "train.checkpoint_every": 2,
    }
    train(config.load(TINY_RECIPE, fast_overrides(out, **extra)))
    return out


def _trained(run):
    cfg = config.load(run / "config.yaml")
    policy = load_policy(cfg, run / "checkpoints" / "step_3", log=lambda *_: None)
    return policy


def _logits(model, tokenizer) -> torch.Tensor:
    """Logits of a left-padded batch of prompts: [N, P, V]."""
    enc = tokenizer(PROMPTS, return_tensors="pt", padding=True)
    model.eval()
    with torch.no_grad():
        return model(**enc).logits.float()


def _base(out):
    from transformers import AutoModelForCausalLM

    path = json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"]
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def test_exported_adapter_is_the_trained_model(run, tmp_path):
    from peft import PeftModel

    out = export_run(run, tmp_path / "export")
    policy = _trained(run)
    want = _logits(policy.model, policy.tokenizer)  # [N, P, V]
    got = _logits(PeftModel.from_pretrained(_base(out), out), policy.tokenizer)
    assert (got - want).abs().max().item() < 1e-5  # fp32 round-off
    # the norms did train, and without them the loaded model is another one: this is what the
    # modules_to_save entries fix (a LoRA-only adapter, as checkpoints used to hold)
    trained = load_file(run / "checkpoints" / "step_3" / "trainable.safetensors")
    base_sd = _base(out).state_dict()
    norms = {k: v for k, v in trained.items() if "norm" in k}
    assert (
        norms
        and max(
            (v - base_sd[k.removeprefix("base_model.model.")]).abs().max().item()
            for k, v in norms.items()
        )
        > 1e-4
    )
    lora_only = tmp_path / "lora_only"
    shutil.copytree(out, lora_only)
    cfg = json.loads((lora_only / "adapter_config.json").read_text())
    cfg["modules_to_save"] = None
    (lora_only / "adapter_config.json").write_text(json.dumps(cfg))
    weights = load_file(lora_only / "adapter_model.safetensors")
    save_file(
        {k: v for k, v in weights.items() if "lora_" in k}, lora_only / "adapter_model.safetensors"
    )
    dropped = _logits(PeftModel.from_pretrained(_base(out), lora_only), policy.tokenizer)
    assert (dropped - want).abs().max().item() > 1e-3
    # the checkpoint's own adapter folder is complete too (what the README's loading line reads)
    ckpt = PeftModel.from_pretrained(_base(out), run / "checkpoints" / "step_3")
    assert (_logits(ckpt, policy.tokenizer) - want).abs().max().item() < 1e-5
    # the tiny base travels with the export: loading needs no cache
    from transformers import AutoModelForCausalLM

    local = AutoModelForCausalLM.from_pretrained(out / "base", dtype=torch.float32)
    got_local = _logits(PeftModel.from_pretrained(local, out), policy.tokenizer)
    assert (got_local - want).abs().max().item() < 1e-5


def test_merged_weights_are_the_trained_model(run, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = export_run(run, tmp_path / "export", checkpoint="step_3", merge=True)
    merged = AutoModelForCausalLM.from_pretrained(out / "merged")
    assert not any("lora" in k or "modules_to_save" in k for k in merged.state_dict())
    assert merged.dtype == torch.float32  # the tiny base is stored in fp32
    policy = _trained(run)
    want = _logits(policy.model, policy.tokenizer)
    tokenizer = AutoTokenizer.from_pretrained(out / "merged")
    assert (_logits(merged, tokenizer) - want).abs().max().item() < 1e-5


def test_model_card_and_files(run, tmp_path):
    out = export_run(run, tmp_path / "export", checkpoint="2")
    card = (out / "README.md").read_text()
    info = json.loads((out / "export.json").read_text())
    assert info["checkpoint"] == "step_2" and info["step"] == 2
    cfg = json.loads((out / "adapter_config.json").read_text())
    assert cfg["base_model_name_or_path"] in card  # the base, by the path that loads it
    assert len(cfg["modules_to_save"]) == 9  # 2 layers x 4 norms + the final norm
    assert "estimator `ebpo`" in card and "Steps: 2 of 3" in card
    # final metrics: the last eval at or before step 2 is the one before training (step 0)
    first_eval = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    assert first_eval["step"] == 0
    assert f"| `eval/accuracy` | {first_eval['eval/accuracy']:.4f} |" in card
    assert "PeftModel.from_pretrained(base" in card and "vllm serve merged" in card
    assert "unsupported LoRA weight" in card  # the norm caveat for vLLM
    assert (out / "training_config.yaml").read_text() == (run / "config.yaml").read_text()
    assert (out / "tokenizer.json").is_file()
    # an earlier export is replaced; any other non-empty folder is refused
    export_run(run, out)
    assert json.loads((out / "export.json").read_text())["step"] == 3
    with pytest.raises(UserError, match="not an earlier export"):
        export_run(run, run / "checkpoints" / "step_3")


def test_push_to_hub_offline_fails_after_a_complete_export(run, tmp_path):
    out = tmp_path / "export"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    args = [str(run), "--out", str(out), "--push-to-hub", "someone/ebpo-tiny"]
    proc = subprocess.run(
        [sys.executable, "-m", "ebpo_lite.commands.export", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert "someone/ebpo-tiny" in lines[0] and "HF_HUB_OFFLINE=1" in lines[0]
    names = {p.name for p in out.iterdir()}
    assert {"adapter_model.safetensors", "adapter_config.json", "README.md", "export.json"} <= names
    assert "base" in names and "training_config.yaml" in names


@pytest.mark.parametrize(
    "args, message",
    [
        (["{tmp}"], "no config.yaml; not a training output_dir"),
        (["{run}", "--checkpoint", "step_9"], "--checkpoint: step_9 is not in"),
        (["{run}", "--out", "{run}"], "is the run's own folder"),
        (["{run}", "--out", "{tmp}/x", "--push-to-hub", "bad id"], "'bad id' is not a repo id"),
    ],
)
def test_mistakes_are_one_line(run, tmp_path, capsys, args, message):
    argv = [a.format(tmp=tmp_path, run=run) for a in args]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert not (tmp_path / "x").exists()  # refused before anything is written


def test_a_failure_midway_keeps_the_earlier_export_and_leaves_no_partial(
    run, tmp_path, capsys, monkeypatch
):
    """The export is built beside --out and renamed over it only when whole: a failure while
    writing (here the model card's final-eval read) leaves the earlier export as it was."""
    from ebpo_lite.commands import export

    out = tmp_path / "x"
    assert main([str(run), "--out", str(out)]) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}

    def fail(*args):
        raise UserError("the disk went away")

    monkeypatch.setattr(export, "_final_eval", fail)
    capsys.readouterr()
    assert main([str(run), "--out", str(out), "--checkpoint", "step_2"]) == 2
    assert "the disk went away" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x"]  # no .x.partial


def test_a_truncated_adapter_leaves_no_half_export(run, tmp_path, capsys):
    """A checkpoint whose adapter file was cut short: one line naming it, and no export folder
    (the export is built beside --out and renamed over it only when complete)."""
    import shutil

    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    newest = sorted((copy / "checkpoints").iterdir())[-1]
    adapter = newest / "adapter_model.safetensors"
    adapter.write_bytes(adapter.read_bytes()[:100])
    assert main([str(copy), "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{adapter}: unreadable checkpoint" in err[0], err
    assert "--checkpoint step_N" in err[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # no x, no .x.partial


@pytest.mark.slow
def test_nf4_run_merges_dequantized(tmp_path):
    """An NF4 run's merge is its dequantized base + adapter: the trained model itself (the
    unquantised base + adapter is not: on the tiny model its logits were 0.18 away)."""
    pytest.importorskip("bitsandbytes")
    from transformers import AutoModelForCausalLM

    run = tmp_path / "nf4_run"
    extra = {"model.load_in_4bit": "true", "train.steps": 2, "eval.num_examples": 0}
    train(config.load(TINY_RECIPE, fast_overrides(run, **extra)))
    out = export_run(run, merge=True)
    assert out == run / "export"
    policy = load_policy(config.load(run / "config.yaml"), run / "checkpoints" / "step_2")
    want = _logits(policy.model, policy.tokenizer)
    merged = AutoModelForCausalLM.from_pretrained(out / "merged")
    assert not any("quant" in k or "absmax" in k for k in merged.state_dict())  # plain weights
    assert (_logits(merged, policy.tokenizer) - want).abs().max().item() < 1e-5
    assert "NF4-quantised base" in (out / "README.md").read_text()
