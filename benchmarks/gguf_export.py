"""GGUF export of a SmolLM2 run: export time, file size, and CPU decode speed in llama.cpp
against transformers (issue 42).

A 1-step SmolLM2 run (tests/smollm2_common.py's settings, transformers sampler) is trained once
into `--work`; then `ebpo-lite export RUN --gguf --gguf-type T` is timed for f16 and q8_0
(each a fresh export: the merge, the conversion and the Modelfile; the process's imports are
warm after the first call, which is excluded as a warm-up export). Decode speed: greedy, batch
1, `--new` tokens after each of the chat prompts of tests/test_llamacpp.py, `--threads`
threads, best of `--repeats`; llama.cpp (llama-cpp-python, the f16 and q8_0 files) against
transformers' `generate` on the merged fp32 folder (the weights `--merge` writes for this fp32
base). Prompt tokens are not counted: tokens/s is new tokens over the decode time after the
prompt was evaluated (llama.cpp: `eval` of the prompt timed apart; transformers: the time of
`generate` with 1 new token subtracted).

    .venv-llamacpp/bin/python benchmarks/gguf_export.py   # writes results/gguf_export.json
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks._machine import command, machine, write_results  # noqa: E402

PROMPTS = [
    "What is 35-8?",
    "Sam has 12 apples and eats 5. How many are left?",
    "What is the capital of France?",
    "Write one word that rhymes with cat.",
]


def main() -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--work", default="/tmp/ebpo_gguf_bench")
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default="benchmarks/results/gguf_export.json")
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    import llama_cpp
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ebpo_lite import config
    from ebpo_lite.commands.export import export_run
    from ebpo_lite.train import train
    from tests import smollm2_common as common

    work = Path(args.work)
    run = work / "run"
    if not (run / "checkpoints").is_dir():
        work.mkdir(parents=True, exist_ok=True)
        data = common.questions(work)
        train(config.load(None, common.overrides(run, data, "hf", **{"train.steps": 1})))
    results = {"machine": machine(), "command": command(), "model": "smollm2 + 1-step adapter"}
    export_run(run, work / "warm", gguf="f16")  # imports and caches warm: not timed
    exports = {}
    for qtype in ("f16", "q8_0"):
        t0 = time.perf_counter()
        out = export_run(run, work / f"export_{qtype}", merge=True, gguf=qtype)
        secs = time.perf_counter() - t0
        file = out / f"model-{qtype}.gguf"
        exports[qtype] = {"dir": out, "file": file}
        results[f"export_{qtype}"] = {
            "seconds_with_merge": round(secs, 2),
            "file_mib": round(file.stat().st_size / 2**20, 1),
        }
        print(qtype, results[f"export_{qtype}"])
    merged_dir = exports["f16"]["dir"] / "merged"
    tok = AutoTokenizer.from_pretrained(merged_dir)
    prompts = [
        tok(
            tok.apply_chat_template(
                [{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True
            ),
            add_special_tokens=False,
        )["input_ids"]
        for q in PROMPTS
    ]
    results["merged_safetensors_mib"] = round(
        sum(f.stat().st_size for f in merged_dir.glob("*.safetensors")) / 2**20, 1
    )

    def llama_speed(file: Path) -> float:
        llm = llama_cpp.Llama(
            model_path=str(file), n_ctx=512, n_threads=args.threads, verbose=False
        )
        best = 0.0
        for _ in range(args.repeats):
            tokens = decode_s = 0.0
            for ids in prompts:
                llm.reset()
                llm.eval(ids)
                t0 = time.perf_counter()
                for _ in range(args.new):
                    nxt = int(llm.scores[llm.n_tokens - 1].argmax())
                    llm.eval([nxt])
                decode_s += time.perf_counter() - t0
                tokens += args.new
            best = max(best, tokens / decode_s)
        return best

    def hf_speed() -> float:
        model = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32).eval()

        def gen(ids, n):
            x = torch.tensor([ids])
            t0 = time.perf_counter()
            with torch.no_grad():
                model.generate(
                    x,
                    attention_mask=torch.ones_like(x),
                    max_new_tokens=n,
                    min_new_tokens=n,
                    do_sample=False,
                    pad_token_id=tok.eos_token_id,
                )
            return time.perf_counter() - t0

        best = 0.0
        for _ in range(args.repeats):
            decode_s = sum(gen(ids, args.new) - gen(ids, 1) for ids in prompts)
            best = max(best, len(prompts) * (args.new - 1) / decode_s)
        return best

    speeds = {
        "transformers_fp32": hf_speed(),
        "llama_cpp_f16": llama_speed(exports["f16"]["file"]),
        "llama_cpp_q8_0": llama_speed(exports["q8_0"]["file"]),
    }
    results["decode_tokens_per_s"] = {k: round(v, 1) for k, v in speeds.items()}
    results["settings"] = vars(args)
    print(results["decode_tokens_per_s"])
    write_results(results, args.out)
    lines = [
        "| | transformers fp32 (merged/) | llama.cpp f16 | llama.cpp q8_0 |",
        "|---|---|---|---|",
        "| decode tokens/s (batch 1, {} threads) | {transformers_fp32} | {llama_cpp_f16} | "
        "{llama_cpp_q8_0} |".format(args.threads, **results["decode_tokens_per_s"]),
        "| size (MiB) | {} | {} | {} |".format(
            results["merged_safetensors_mib"],
            results["export_f16"]["file_mib"],
            results["export_q8_0"]["file_mib"],
        ),
        "| export seconds (merge + GGUF) | | {} | {} |".format(
            results["export_f16"]["seconds_with_merge"],
            results["export_q8_0"]["seconds_with_merge"],
        ),
    ]
    Path(args.out).with_suffix(".md").write_text(
        f"`{results['command']}` on {results['machine']['cpu']}\n\n" + "\n".join(lines) + "\n"
    )
    return results


if __name__ == "__main__":
    main()
