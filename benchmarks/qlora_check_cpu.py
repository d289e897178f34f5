"""The NF4 gradient check at the size the GPU smoke test uses, on the CPU: the reference numbers
a GPU result (scripts/gpu_smoke.py, variant nf4_grads) is read against.

    .venv/bin/python benchmarks/qlora_check_cpu.py

Runs `ebpo_lite.commands.qlora_check.check` on a random Qwen3 of `qlora_check.LARGE_SHAPE` (4 layers,
hidden 1024, GQA 16/8, head size 64) and single layers of `LARGE_LAYERS` in fp32, bf16 and fp16,
and writes benchmarks/results/qlora_check_cpu.json with the command and the machine. What each
number means and its bound: ebpo_lite/commands/qlora_check.py. Exit status 1 if any is out of bounds.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

from _machine import command, machine

from ebpo_lite.cli import quiet_libraries
from ebpo_lite.commands import qlora_check
from ebpo_lite.model.tiny import save_random_qwen3

OUT = Path(__file__).resolve().parent / "results" / "qlora_check_cpu.json"
DTYPES = ["float32", "bfloat16", "float16"]


def main() -> int:
    quiet_libraries()
    import bitsandbytes
    import peft
    import transformers

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="ebpo_qlora_bench_") as tmp:
        model = save_random_qwen3(Path(tmp) / "model", **qlora_check.LARGE_SHAPE)
        result = qlora_check.check("cpu", DTYPES, model, qlora_check.LARGE_LAYERS)
    result["model"] = {"random Qwen3 with the tiny tokenizer": qlora_check.LARGE_SHAPE}
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    result = {
        "command": command(),
        "machine": machine(
            transformers=transformers.__version__,
            peft=peft.__version__,
            bitsandbytes=bitsandbytes.__version__,
        ),
        **qlora_check.json_ready(result),
    }
    OUT.write_text(json.dumps(result, indent=2, allow_nan=False) + "\n")
    for line in qlora_check.summary_lines(result):
        print(line)
    print(f"wrote {OUT.relative_to(OUT.parents[2])} ({result['wall_s']} s)")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
