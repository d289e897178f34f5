"""`ebpo-lite export RUN_DIR [--out DIR] [--checkpoint step_N] [--merge] [--gguf [--gguf-type T]]
[--push-to-hub REPO_ID]`: what a user takes away from a run.

The export folder (default `RUN_DIR/export`) holds
- `adapter_model.safetensors` + `adapter_config.json`: the final (or `--checkpoint`) adapter,
  complete: LoRA plus any other trained tensors (`model.trainable_extra`, e.g. the tiny recipe's
  norms) as peft `modules_to_save` (`extra_weights.add_extra_weights`), so
  `PeftModel.from_pretrained(base, out)` reproduces the trained model (tests/test_export.py
  compares logits). `base_model_name_or_path` names the base the run loaded: a hub id, or for
  `model.name: tiny` the warmed model's folder in the cache; the tiny base (about 2 MB) is also
  copied to `base/`, so the export loads without that cache;
- the tokenizer's files, `training_config.yaml` (the run's resolved config), `export.json`
  (where it came from) and a model card `README.md` (base, recipe, data, steps, final eval
  metrics, the commands to load it with peft and to serve it with vLLM);
- with `--merge`, `merged/`: base + adapter as full weights in 16-bit (in fp32 for a base stored
  in fp32, such as the tiny one). An NF4 run's base is first dequantized exactly as the trainer
  computed with it (the NF4 codes times their scales, in the compute dtype), never merged into
  4-bit weights, so the merged model is the trained one up to 16-bit rounding;
- with `--gguf`, `model-<type>.gguf` (`--gguf-type`, default f16; `model.gguf_export`): those
  merged weights (written to a scratch folder when `--merge` is not given) as one llama.cpp file
  with the tokenizer and chat template, and an Ollama `Modelfile` beside it.

vLLM: its LoRA loader accepts LoRA tensors only (a norm weight is an "unsupported LoRA weight"),
so an adapter with trained extras cannot be served by `--enable-lora`; the card then says to serve
`merged/` instead (ebpo_lite's own vLLM sampler reloads the trained norms into its base weights
after each step, `rollout/vllm.py`). `--push-to-hub REPO_ID` uploads the finished folder with
huggingface_hub (`HfApi.create_repo` + `upload_folder`); the folder is complete before the
upload starts, so a failed upload loses nothing. The folder is built beside `--out`
(`.NAME.partial`) and renamed into place only when complete: a failure leaves no half export,
and an earlier export there stays until the new one is whole.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path
from typing import Any

from ebpo_lite import cli
from ebpo_lite.errors import UserError

MARKER = "export.json"  # identifies a folder this command wrote (and may replace)
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
)


def export_run(
    run_dir: str | Path,
    out_dir: str | Path | None = None,
    checkpoint: str | None = None,
    merge: bool = False,
    push_to_hub: str | None = None,
    gguf: str | None = None,
) -> Path:
    """Write the export folder of a training run (see the module docstring); returns it.
    `gguf`: also a GGUF file of that type (`model.gguf_export.TYPES`)."""
    from ebpo_lite import config
    from ebpo_lite.engine.checkpoint import read_tensors
    from ebpo_lite.model.extra_weights import unsaveable_extra

    run = Path(run_dir)
    if not (run / "config.yaml").is_file():
        raise UserError(f"{run}: no config.yaml; not a training output_dir")
    cfg = config.load(run / "config.yaml")
    ckpt = _checkpoint(run, checkpoint)
    out = _check_out(Path(out_dir) if out_dir else run / "export", run)
    if push_to_hub:
        _check_repo_id(push_to_hub)
    if gguf is not None:
        _check_gguf(ckpt, gguf)
    then = "export an earlier one with --checkpoint step_N"
    trained = read_tensors(ckpt / "trainable.safetensors", then)
    read_tensors(ckpt / "adapter_model.safetensors", then)  # copied as it is: refuse a cut one
    if (bad := unsaveable_extra(trained)) and not merge:
        raise UserError(
            f"{ckpt}: {bad[0]} was trained inside a LoRA layer and a peft adapter cannot hold "
            "it; export with --merge"
        )
    # built beside `out` and renamed over it at the end: a failure leaves no half export
    tmp = out.resolve().with_name(f".{out.resolve().name}.partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        _write_export(cfg, run, ckpt, tmp, trained, bad, merge, gguf)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if out.exists():
        shutil.rmtree(out)  # an earlier export (`_check_out`)
    tmp.rename(out)
    if push_to_hub:
        push(out, push_to_hub)
    return out


def _write_export(cfg, run: Path, ckpt: Path, out: Path, trained, bad, merge: bool, gguf) -> None:
    """The export folder's files, into `out` (see the module docstring)."""
    from ebpo_lite.engine.checkpoint import step_of
    from ebpo_lite.model.extra_weights import add_extra_weights

    for name in ("adapter_model.safetensors", "adapter_config.json"):
        shutil.copy2(ckpt / name, out / name)
    extra = [] if bad else add_extra_weights(out, trained)
    base = json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"]
    base_dir = _local_dir(base)
    _copy_tokenizer(base_dir, out)
    if cfg.model.name == "tiny" and base_dir is not None:
        shutil.copytree(base_dir, out / "base")
    shutil.copy2(run / "config.yaml", out / "training_config.yaml")
    if merge or gguf:
        merged = merge_adapter(cfg.model, out, out / ("merged" if merge else ".merged-for-gguf"))
    step = step_of(ckpt)
    info = {"run_dir": str(run.resolve()), "checkpoint": ckpt.name, "step": step, "base": base}
    info.update(extra_modules=extra, merged=merge)
    if gguf:
        info["gguf"] = write_gguf_files(merged, out, gguf, base_dir, run.name)
        if not merge:
            shutil.rmtree(merged)
    (out / MARKER).write_text(json.dumps(info, indent=2) + "\n")
    (out / "README.md").write_text(model_card(cfg, run, out, info, _final_eval(run, step)))


def _check_gguf(ckpt: Path, qtype: str) -> None:
    """`--gguf`'s mistakes (no gguf package, a type or base it does not write), before any work."""
    from ebpo_lite.model.gguf_export import check_ready

    base = json.loads((ckpt / "adapter_config.json").read_text())["base_model_name_or_path"]
    base_dir = _local_dir(base)
    conf = base_dir / "config.json" if base_dir is not None else None
    check_ready(json.loads(conf.read_text()) if conf and conf.is_file() else None, qtype)


def write_gguf_files(merged: Path, out: Path, qtype: str, base_dir: Path | None, name: str) -> str:
    """`model-<qtype>.gguf` from the merged folder, and an Ollama Modelfile; returns the file's
    name. A base converted from a GGUF file (`base_model`) lends its pre-tokenizer name."""
    from ebpo_lite.model.gguf_export import write_gguf

    source = None
    if base_dir is not None and (base_dir / "ebpo_lite_source.json").is_file():
        source = json.loads((base_dir / "ebpo_lite_source.json").read_text()).get("gguf")
    file = write_gguf(merged, out / f"model-{qtype}.gguf", qtype, source, name, log=print)
    (out / "Modelfile").write_text(modelfile(file.name, merged))
    return file.name


def modelfile(gguf_name: str, merged: Path) -> str:
    """An Ollama Modelfile: the file, and for a ChatML template (Qwen, SmolLM2) that template in
    Ollama's Go syntax with its stop token; other templates are left to Ollama, which reads the
    GGUF's `tokenizer.chat_template`."""
    template = ""
    if (merged / "chat_template.jinja").is_file():
        template = (merged / "chat_template.jinja").read_text()
    elif (merged / "tokenizer_config.json").is_file():
        template = (
            json.loads((merged / "tokenizer_config.json").read_text()).get("chat_template") or ""
        )
    lines = [f"FROM ./{gguf_name}"]
    if "<|im_start|>" in str(template):
        lines += [
            'TEMPLATE """{{- range .Messages }}<|im_start|>{{ .Role }}',
            "{{ .Content }}<|im_end|>",
            "{{ end }}<|im_start|>assistant",
            '"""',
            'PARAMETER stop "<|im_end|>"',
        ]
    return "\n".join(lines) + "\n"


def _check_repo_id(repo_id: str) -> None:
    """A malformed hub repo id, refused before the export is written."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError as e:
        raise UserError(
            f"--push-to-hub: {repo_id!r} is not a repo id ({e}); write owner/name"
        ) from None


def _checkpoint(run: Path, name: str | None) -> Path:
    from ebpo_lite.engine import checkpoint

    found = checkpoint.list_checkpoints(run)
    if not found:
        raise UserError(f"{run}: no checkpoint in {run / 'checkpoints'}; train first")
    if name is None:
        return found[-1]
    name = name if name.startswith("step_") else f"step_{name}"
    for p in found:
        if p.name == name:
            return p
    have = ", ".join(p.name for p in found)
    raise UserError(f"--checkpoint: {name} is not in {run / 'checkpoints'} (there: {have})")


def _check_out(out: Path, run: Path) -> Path:
    """`out`, if it is new, empty or an earlier export (replaced at the end); else refused."""
    if out.resolve() in (run.resolve(), (run / "checkpoints").resolve()):
        raise UserError(f"--out: {out} is the run's own folder; choose a new one")
    if out.exists():
        if not out.is_dir() or (any(out.iterdir()) and not (out / MARKER).is_file()):
            raise UserError(f"--out: {out} exists and is not an earlier export; choose a new one")
    return out


def _local_dir(base: str) -> Path | None:
    """The base model's folder on this machine, or None (a hub id not in the local cache)."""
    from ebpo_lite.model.policy import _local_model_dir

    try:
        return _local_model_dir(base)
    except Exception:  # not downloaded here: the card still names it
        return None


def _copy_tokenizer(base_dir: Path | None, out: Path) -> None:
    for name in TOKENIZER_FILES:
        if base_dir is not None and (base_dir / name).is_file():
            shutil.copy2(base_dir / name, out / name)


def merge_adapter(m: Any, adapter_dir: Path, out: Path) -> Path:
    """base + the complete adapter in `adapter_dir` as full weights in `out` (never 4-bit).

    The base loads as the run loaded it; an NF4 base is then dequantized (transformers'
    `dequantize`: each weight becomes its NF4 codes times their scales in the compute dtype, the
    values the trainer's forward used) before peft adds the LoRA products and swaps in the
    trained extra modules (`merge_and_unload`).
    """
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from ebpo_lite.model.policy import _nf4_config

    base = json.loads((adapter_dir / "adapter_config.json").read_text())["base_model_name_or_path"]
    dtype = merge_dtype(m.dtype, _local_dir(base))
    kwargs: dict[str, Any] = dict(dtype=dtype, trust_remote_code=m.trust_remote_code)
    if m.load_in_4bit:
        kwargs["quantization_config"] = _nf4_config(dtype)
    try:
        model = AutoModelForCausalLM.from_pretrained(base, **kwargs)
    except (OSError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"--merge: cannot load the base model {base!r} ({first})") from None
    if m.load_in_4bit:
        model = model.dequantize()
    model = PeftModel.from_pretrained(model, adapter_dir).merge_and_unload()
    with torch.no_grad():
        model.to(dtype)
    model.save_pretrained(out, safe_serialization=True)
    _copy_tokenizer(_local_dir(base), out)
    return out


def merge_dtype(run_dtype: str, base_dir: Path | None):
    """The merged weights' dtype: the run's `model.dtype`, or with `auto` the base's stored
    dtype (bf16 for current hub models, fp32 for the tiny one); fp16 / bf16 / fp32 only."""
    import torch

    names = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if run_dtype in names:
        return names[run_dtype]
    stored = None
    if base_dir is not None and (base_dir / "config.json").is_file():
        hf_cfg = json.loads((base_dir / "config.json").read_text())
        stored = hf_cfg.get("dtype") or hf_cfg.get("torch_dtype")
    return names.get(str(stored), torch.bfloat16)


def _final_eval(run: Path, step: int) -> dict[str, Any]:
    """The last eval record at or before `step` in metrics.jsonl ({} when there is none)."""
    path = run / "metrics.jsonl"
    last: dict[str, Any] = {}
    if not path.is_file():
        return last
    for line in path.read_text(errors="replace").splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and rec.get("step", 0) <= step and "eval/accuracy" in rec:
            last = rec
    return last


def model_card(cfg: Any, run: Path, out: Path, info: dict[str, Any], final: dict) -> str:
    """The export's README.md: what the model is, how it was made, how to load and serve it."""
    m, a = cfg.model, cfg.algo
    base, step = info["base"], info["step"]
    data = cfg.data.path or cfg.data.name
    hub_base = not Path(base).exists()
    front = ["---", "library_name: peft", "tags: [ebpo_lite, lora, reinforcement-learning]"]
    front += [f"base_model: {base}"] if hub_base else []
    lines = [*front, "---", "", f"# {run.name}: LoRA adapter trained with ebpo_lite", ""]
    lines += [
        f"- Base model: `{base}`"
        + ("" if hub_base else " (a local folder)")
        + (", loaded in NF4 (4-bit) for training" if m.load_in_4bit else ""),
        f"- Method: RL from verifiable rewards, estimator `{a.estimator}`; LoRA rank {m.lora_rank},"
        f" alpha {m.lora_alpha}, on `{', '.join(m.lora_target_modules)}`",
        f"- Data: `{data}`; {cfg.rollout.group_size} completions per prompt, "
        f"{cfg.train.prompts_per_step} prompts per step, lr {cfg.train.lr:g}",
        f"- Steps: {step} of {cfg.train.steps} (checkpoint `{info['checkpoint']}`); the full "
        "resolved recipe is `training_config.yaml`",
    ]
    if info["extra_modules"]:
        lines.append(
            f"- Also trained (not LoRA): {len(info['extra_modules'])} modules matching "
            f"`{', '.join(m.trainable_extra)}`, saved in the adapter as peft `modules_to_save`"
        )
    lines += ["", "## Final evaluation", ""]
    lines += _metric_lines(final) or ["No eval record in the run's metrics.jsonl."]
    lines += ["", "## Load with peft", "", "```python", *_peft_snippet(base, hub_base), "```"]
    lines += ["", "## Serve with vLLM", "", *_vllm_lines(base, info, hub_base)]
    if info.get("gguf"):
        lines += ["", *_gguf_lines(info["gguf"], run.name, m.load_in_4bit)]
    if m.load_in_4bit:
        lines += [
            "",
            "The adapter was trained on the NF4-quantised base. On the unquantised base it is "
            "not quite the trained model (the difference is the base's quantisation error); to "
            "get the trained model itself, load the base in NF4 as training did "
            "(`BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type='nf4', "
            "bnb_4bit_use_double_quant=True)`), or use `merged/` (`--merge`): the base "
            "dequantized, plus the adapter.",
        ]
    lines += ["", f"Made by `ebpo-lite export {run}`.", ""]
    return "\n".join(lines)


def _metric_lines(final: dict) -> list[str]:
    """A markdown table of the eval record's numbers (overall first, then per type)."""
    keys = [k for k in final if k.startswith("eval/") and isinstance(final[k], (int, float))]
    if not keys:
        return []
    keys.sort(key=lambda k: ("=" in k, k))
    rows = [f"| `{k}` | {final[k]:.4f} |" for k in keys]
    return [f"At step {final['step']}:", "", "| metric | value |", "|---|---|", *rows]


def _peft_snippet(base: str, hub_base: bool) -> list[str]:
    load_base = (
        f'base = AutoModelForCausalLM.from_pretrained("{base}")'
        if hub_base
        else 'base = AutoModelForCausalLM.from_pretrained("base")  # the local base, copied here'
    )
    return [
        "from peft import PeftModel",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        "",
        load_base,
        'model = PeftModel.from_pretrained(base, ".")  # this folder',
        'tokenizer = AutoTokenizer.from_pretrained(".")',
    ]


def _vllm_lines(base: str, info: dict[str, Any], hub_base: bool) -> list[str]:
    merged = ["```bash", "vllm serve merged", "```"]
    if info["extra_modules"]:
        why = (
            "This adapter also holds trained non-LoRA weights (norms). vLLM's LoRA loader "
            'refuses them ("unsupported LoRA weight"), and serving the LoRA part alone would '
            "give a different model. Serve the merged model (`ebpo-lite export "
            "RUN_DIR --merge` writes `merged/`):"
        )
        return [why, "", *merged]
    name = base if hub_base else "base"
    lines = ["```bash", f"vllm serve {name} --enable-lora --lora-modules policy=.", "```"]
    if info["merged"]:
        lines += ["", "or the merged weights:", "", *merged]
    return lines


def _gguf_lines(file: str, name: str, nf4: bool) -> list[str]:
    tag = "".join(c if c.isalnum() or c in "-_." else "-" for c in name.lower()) or "model"
    lines = [
        "## Run with llama.cpp or Ollama",
        "",
        f"`{file}` holds the merged model (base + adapter as full weights"
        + (", the NF4 base dequantized as training computed it" if nf4 else "")
        + "), the tokenizer and the chat template:",
        "",
        "```bash",
        f"llama-cli -m {file} -cnv            # chat, with the file's chat template",
        f"llama-server -m {file} --port 8080  # an OpenAI-compatible server",
        f"ollama create {tag} -f Modelfile && ollama run {tag}",
        "```",
        "",
        "For a 4-bit file: `llama-quantize " + file + " model-q4_k_m.gguf Q4_K_M` (llama.cpp).",
    ]
    return lines


def push(out: Path, repo_id: str) -> str:
    """Upload the finished export folder to the hub repo `repo_id` (created if missing)."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import OfflineModeIsEnabled

    api = HfApi()
    try:
        api.create_repo(repo_id, exist_ok=True)
        info = api.upload_folder(folder_path=str(out), repo_id=repo_id)
    except OfflineModeIsEnabled:
        raise UserError(
            f"--push-to-hub {repo_id}: hub access is off (HF_HUB_OFFLINE=1); the export is "
            f"complete in {out}: unset HF_HUB_OFFLINE and run again, or upload it later with "
            f"`hf upload {repo_id} {out}`"
        ) from None
    except Exception as e:  # no token, no network, no permission on that repo
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(
            f"--push-to-hub {repo_id}: upload failed ({first}); the export is complete in {out}: "
            "log in with `hf auth login` (or set HF_TOKEN) and run again"
        ) from None
    return str(getattr(info, "commit_url", info))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog=cli.prog("python -m ebpo_lite.commands.export"),
        description="Export a run's adapter (complete), a model card, optionally merged "
        "weights, optionally to the Hugging Face hub.",
    )
    p.add_argument("run_dir", help="a training output_dir")
    p.add_argument("--out", default=None, help="export folder (default RUN_DIR/export)")
    p.add_argument("--checkpoint", default=None, help="step_N (default: the newest)")
    p.add_argument("--merge", action="store_true", help="also write merged/ full weights")
    p.add_argument("--gguf", action="store_true", help="also write one GGUF file (llama.cpp)")
    p.add_argument(
        "--gguf-type", default=None, metavar="T", help="f16 (default), q8_0, bf16 or f32"
    )
    p.add_argument("--push-to-hub", default=None, metavar="REPO_ID", help="upload to this repo")
    args = p.parse_args(argv)
    gguf = args.gguf_type or ("f16" if args.gguf else None)

    def run() -> None:
        out = export_run(
            args.run_dir, args.out, args.checkpoint, args.merge, args.push_to_hub, gguf
        )
        print(f"exported: {out}" + (f" (pushed to {args.push_to_hub})" if args.push_to_hub else ""))

    return cli.run(run)


if __name__ == "__main__":
    sys.exit(main())
