"""Everything one training run holds, and the mechanics the loop in `train.py` calls.

`build_run(cfg)` loads data, policy, rollout backend, rewards, curriculum, EB prior, optimizer
and schedule. The methods are the phases of a step (sample and score, advantages, optimize,
save); the order of the phases lives in `train.train_step` only.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ebpo_lite import config, rewards
from ebpo_lite.algo import curriculum, loss
from ebpo_lite.algo.advantages import EBPrior, compute_advantages
from ebpo_lite.algo.loss_keys import AGGREGATION, loss_options, loss_type_of
from ebpo_lite.data import loader as data
from ebpo_lite.data.jsonl import write_atomic
from ebpo_lite.engine import checkpoint, checks, faults, labels, startup
from ebpo_lite.engine import tools as env_runtime
from ebpo_lite.errors import ConfigError, UserError
from ebpo_lite.model.policy import Policy, completion_logprobs, dropout_in_training
from ebpo_lite.model.scaler import LossScaler
from ebpo_lite.rollout import Rollout, RolloutBackend, make_backend


@dataclass
class Sample:
    """One step's groups: every drawn one (observed by the prior and the curriculum) and the kept
    ones (trained on). Without dynamic sampling the two are the same."""

    idx: list[int]  # kept prompts' dataset indices
    rollout: Rollout  # the kept groups' completions, prompt-major
    rewards: torch.Tensor  # [B, G] kept
    mask: torch.Tensor  # [B, G] kept, True = scorable
    drawn_idx: list[int]  # every drawn prompt, all draws in order
    drawn_rewards: torch.Tensor  # [B_drawn, G]
    drawn_mask: torch.Tensor  # [B_drawn, G]
    extra_draws: int
    reward_errors: dict[str, int]  # reward/errors, reward/timeouts: masked by containment


@dataclass
class Run:
    cfg: config.Config
    policy: Policy
    backend: RolloutBackend
    train_examples: list[data.Example]
    eval_examples: list[data.Example]
    prompt_ids: list[list[int]]  # per training example
    reward_fns: list[tuple[str, Any]]
    reward_weights: list[float]
    curriculum: Any  # curriculum.PromptSampler: which prompts come next (not the rollout)
    prior: EBPrior | None
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: LossScaler = field(default_factory=lambda: LossScaler(False))  # on for float16
    tools: Any = None  # engine.tools.Tools: environments and tools (env.*), or None
    episodes: Any = None  # engine.episodes.EpisodeRunner: multi-turn rollouts, with `tools`

    # ------------------------------------------------------------------ sampling and scoring
    def sample_and_score(self, step: int) -> Sample:
        """Prompts from the curriculum, G completions each, rewards and mask (see `Sample`).

        With `curriculum.dynamic_sampling`, groups whose rewards are all equal are dropped and
        up to `max_extra_draws` more batches are drawn to refill (DAPO). The curriculum learns
        from every drawn group as soon as it is scored, so a redraw already knows which prompts
        were dropped; unscorable completions (reward None) are not counted as trials.
        """
        cfg = self.cfg
        B = cfg.train.prompts_per_step
        idx, roll, r, m = self._draw(B, step, 0)
        self.curriculum.update(idx, curriculum_rewards(r, m))
        drawn = (idx, r, m)
        extra = 0
        if cfg.curriculum.dynamic_sampling:
            keep = curriculum.informative_groups(r, m)  # [B]
            while int(keep.sum()) < B and extra < cfg.curriculum.max_extra_draws:
                extra += 1
                i2, roll2, r2, m2 = self._draw(B, step, extra)
                self.curriculum.update(i2, curriculum_rewards(r2, m2))
                idx, roll = idx + i2, roll + roll2
                r, m = torch.cat([r, r2]), torch.cat([m, m2])
                keep = torch.cat([keep, curriculum.informative_groups(r2, m2)])
            drawn = (idx, r, m)
            chosen = keep.nonzero().flatten()[:B].tolist() or list(range(B))
            idx = [idx[i] for i in chosen]
            roll, r, m = roll.rows(chosen), r[chosen], m[chosen]
        return Sample(idx, roll, r, m, *drawn, extra, rewards.take_error_counts(self.reward_fns))

    def observe(self, sample: Sample) -> None:
        """The EB prior's step 1 with every drawn group (docs/algorithm.md section 5)."""
        if self.prior is not None:
            keys = self.prior_keys(sample.drawn_idx)
            self.prior.observe(sample.drawn_rewards, sample.drawn_mask, keys, sample.drawn_idx)

    def _draw(self, n: int, step: int, draw: int):
        idx = self.curriculum.next_batch(n)
        seed = draw_seed(self.cfg.train.seed, step, draw)
        prompts, examples = [self.prompt_ids[i] for i in idx], [self.train_examples[i] for i in idx]
        if self.episodes is not None:  # tool use: multi-turn episodes (engine/episodes.py)
            roll = self.episodes.run(
                self.backend, examples, prompts, self.cfg.rollout.group_size, seed
            )
        else:
            roll = self.backend.generate(prompts, self.cfg.rollout.group_size, seed=seed)
        r, m = self.score(examples, roll)
        return idx, roll, r, m

    def score(
        self, examples: list[data.Example], roll: Rollout
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Weighted sum of the reward functions; None from any of them marks the row unscorable."""
        G = len(roll.completion_ids) // len(examples)
        tok = self.policy.tokenizer
        if roll.episodes is not None:  # an episode's answer is in the model's last turn
            texts = [ep.final_text for ep in roll.episodes]
        else:
            texts = tok.batch_decode(roll.completion_ids, skip_special_tokens=True)
        extra, own = env_runtime.reward_inputs(
            self.tools, len(texts)
        )  # `environments`; their get_reward
        total, _ = rewards.combine_rewards(
            dict(self.reward_fns),
            self.reward_weights,
            texts,
            timeout_s=self.cfg.reward.timeout_s,
            **rewards.reward_columns(examples, G),
            **extra,
        )
        total = [t if o is None or t is None else t + o for t, o in zip(total, own)]
        rc = self.cfg.reward
        if rc.length_penalty > 0:
            pen = rewards.length_penalty(
                [roll.loss_tokens(i) for i in range(len(roll.completion_ids))],  # the model's
                self.cfg.rollout.max_new_tokens,
                rc.length_penalty,
                rc.length_penalty_start,
            )
            total = [None if t is None else t + p for t, p in zip(total, pen)]
        mask = torch.tensor([t is not None for t in total]).reshape(-1, G)  # [B, G]
        r = torch.tensor([0.0 if t is None else float(t) for t in total]).reshape(-1, G)  # [B, G]
        return r, mask

    _prior_keys = None  # per training example, made on first use

    # ------------------------------------------------------------------ advantages
    def prior_keys(self, idx: list[int]) -> list | None:
        key = self.cfg.algo.prior_key
        if key is None or self.prior is None:
            return None
        if self._prior_keys is None:  # once: checked in build_run, binned (labels.prior_keys)
            self._prior_keys = labels.prior_keys(self.train_examples, key)
        return [self._prior_keys[i] for i in idx]

    def advantages(
        self, r: torch.Tensor, m: torch.Tensor, idx: list[int]
    ) -> tuple[torch.Tensor, dict]:
        """Advantages [B, G] of the kept groups (training-example indices `idx`, which are also
        the prompt ids of `algo.prompt_prior`); the prior has observed the step (`observe`)."""
        return compute_advantages(
            self.cfg.algo.estimator,
            r,
            prior=self.prior,
            mask=m,
            keys=self.prior_keys(idx),
            grpo_scale=self.cfg.algo.grpo_scale,
            observe=False,
            prompts=idx,
        )

    # ------------------------------------------------------------------ optimisation
    def optimize(
        self, prompts: list[list[int]], roll: Rollout, adv: torch.Tensor, valid: torch.Tensor
    ) -> dict[str, float]:
        """`num_iterations` passes over the rollout, each split into `train.mini_batches`
        optimizer steps; each step accumulates gradients over length-sorted micro-batches.

        Micro-batch losses are weighted by their share of the mini-batch's normaliser (tokens for
        `token_mean`, sequences otherwise), so accumulation equals one mini-batch loss. Once the
        policy has moved within a step (several mini-batches or iterations), the PPO ratio is
        taken against the log-probs before the first update: the first mini-batch's first pass
        runs on those weights, so its own forward gives them (kept for later passes); the other
        rows' are computed up front, in eval mode. With dropout active in training that forward
        is a dropout sample, so then every row's is computed up front. Stats stay on the device;
        the step syncs once.
        """
        cfg, a = self.cfg, self.cfg.algo
        rows = [i for i, ok in enumerate(valid.tolist()) if ok]  # `valid` is on the host
        n_mini = min(cfg.train.mini_batches, max(len(rows), 1))
        minis = [
            rows[k * len(rows) // n_mini : (k + 1) * len(rows) // n_mini] for k in range(n_mini)
        ]
        old_rows: list[int] = []
        if a.num_iterations > 1 or n_mini > 1:
            live = set() if dropout_in_training(self.policy.model) else set(minis[0])
            old_rows = [i for i in rows if i not in live]
        fixed = self._fixed_logprobs(prompts, roll, old_rows, rows if a.kl_coef > 0 else [])
        stats: dict[str, torch.Tensor] = {}
        norms = []
        self.policy.model.train()
        n_updates = a.num_iterations * len(minis)
        lr = self.scheduler.get_last_lr()[0]  # the lr of this step's updates
        scale = self.scaler.metrics()  # float16: the loss scale of this step's first update
        for _ in range(a.num_iterations):
            for mini in minis:
                norms.append(self._update(prompts, roll, adv, mini, fixed, stats, 1 / n_updates))
        self.scheduler.step()
        flat = torch.stack([v.float() for v in [*stats.values(), *norms]]).tolist()  # one sync
        values = dict(zip(stats, flat))
        out = {f"train/{k}": v for k, v in values.items() if not k.startswith(("is_", "logp_"))}
        out.update({f"rollout/{k}": v for k, v in values.items() if k.startswith(("is_", "logp_"))})
        out["train/grad_norm"] = sum(flat[len(stats) :]) / max(len(norms), 1)
        out["train/lr"] = lr
        out.update(scale)
        return out

    def _chunks(self, rows: list[int], prompts, roll: Rollout) -> list[list[int]]:
        return micro_batches(rows, prompts, roll.completion_ids, self.cfg.train.micro_batch_size)

    @torch.no_grad()
    def _fixed_logprobs(self, prompts, roll: Rollout, old_rows, ref_rows) -> dict:
        """Per-row log-probs fixed for the whole step: `("old", i)` for `old_rows` and
        `("ref", i)` (adapter off) for `ref_rows`.

        Always in eval mode (dropout off), as the samplers score, whatever mode the model was
        left in (eval before the first step, train after it); the mode is restored.
        """
        policy, out, temp = self.policy, {}, self.cfg.rollout.temperature  # as sampled
        was_training = policy.model.training
        policy.model.eval()
        for kind, kind_rows in (("old", old_rows), ("ref", ref_rows)):
            for c in self._chunks(kind_rows, prompts, roll):
                b = _batch(policy, prompts, roll, c)
                with policy.ref_context() if kind == "ref" else contextlib.nullcontext():
                    logp = completion_logprobs(policy.model, b, temperature=temp)[0]  # [n, C]
                for j, i in enumerate(c):
                    out[(kind, i)] = logp[j]
        policy.model.train(was_training)
        return out

    def _update(self, prompts, roll, adv, mini, fixed, stats, weight) -> torch.Tensor:
        """One optimizer step on the rows `mini`; returns the gradient norm before clipping.

        A row with no `("old", i)` in `fixed` is on the weights the rollout was scored with (the
        first pass of the first mini-batch, or a one-update step): this forward is its old
        log-prob, stored in `fixed` for later passes.
        """
        cfg, a, policy = self.cfg, self.cfg.algo, self.policy
        kind = loss_type_of(a)  # the loss menu (docs/losses.md)
        mini_tokens = self._loss_tokens(mini, roll) or 1
        self.optimizer.zero_grad(set_to_none=True)
        for c in self._chunks(mini, prompts, roll):
            b = _batch(policy, prompts, roll, c)  # tool tokens: 0 in its completion mask
            logp, entropy = completion_logprobs(
                policy.model, b, with_entropy=True, temperature=cfg.rollout.temperature
            )  # [n, C]: the sampling distribution's
            width, live = logp.shape[1], logp.detach()
            old = _stack([fixed.setdefault(("old", i), live[j]) for j, i in enumerate(c)], width)
            ref = _stack([fixed[("ref", i)] for i in c], width) if ("ref", c[0]) in fixed else None
            slp = None  # the sampler's log-probs: mismatch metrics always, correction if asked
            if roll.sampler_logprobs is not None:
                slp = _pad([roll.sampler_logprobs[i] for i in c], width).to(logp.device)
            mask = b.completion_mask  # [n, C]
            if a.mask_truncated_completions:  # DAPO's overlong filter: out of the loss only
                mask = loss.drop_truncated(mask, [roll.finished[i] for i in c])
            lval, st = loss.policy_loss(
                logp,
                old,
                adv[c].to(logp.device),
                mask,
                loss_type=kind,
                clip_eps_low=a.clip_eps_low,
                clip_eps_high=a.clip_eps_high,
                importance_sampling_level=a.importance_sampling_level,
                options=loss_options(a),
                entropy=entropy,
                top_entropy_quantile=a.top_entropy_quantile,
                ref_logp=ref,
                kl_coef=a.kl_coef,
                kl_estimator=a.kl_estimator,
                use_bias_correction_kl=a.use_bias_correction_kl,
                sampler_logp=slp,
                is_correction=a.is_correction if slp is not None else "none",
                is_cap=a.is_cap,
                max_tokens=cfg.rollout.max_new_tokens,
                sync_stats=False,
            )
            tokens = self._loss_tokens(c, roll)  # = the mask's sum, no sync
            share = loss.microbatch_weight(
                AGGREGATION[kind], tokens, len(c), mini_tokens, len(mini)
            )
            self.scaler.scale_loss(lval * share).backward()  # float16: times the loss scale
            st["entropy"] = loss.masked_mean(entropy, b.completion_mask)
            _accumulate(stats, st, share * weight)
        params = policy.trainable_parameters()
        self.scaler.unscale_(params)  # the loss's own gradients, before clipping
        norm = torch.nn.utils.clip_grad_norm_(params, cfg.train.max_grad_norm)
        # the step's running loss (finite so far, or an earlier update would have stopped) and
        # this update's gradient norm; NaN / inf: no step (train_step undoes the rest); float16:
        # inf gradients of a finite loss lower the loss scale (scaler.py)
        faults.check_update(stats.get("loss", norm), norm, self.scaler)
        self.optimizer.step()
        return norm

    def _loss_tokens(self, rows: list[int], roll: Rollout) -> int:
        """Completion tokens of `rows` in the loss: the model's (tool results are not), less the
        truncated completions' with `algo.mask_truncated_completions`."""
        drop = self.cfg.algo.mask_truncated_completions
        return sum(roll.loss_tokens(i) for i in rows if roll.finished[i] or not drop)

    # ------------------------------------------------------------------ checkpoints
    def save(self, step: int, extra: dict | None = None) -> Path:
        if self.scaler.enabled:  # float16: the loss scale goes on with the run
            extra = {**(extra or {}), "loss_scale": self.scaler.state_dict()}
        return checkpoint.save(
            self.cfg.output_dir,
            step,
            self.policy,
            self.optimizer,
            self.scheduler,
            self.prior,
            self.curriculum,
            extra=extra,
            keep=self.cfg.train.keep_checkpoints,
        )

    def maybe_resume(self) -> tuple[int, dict]:
        """(step, the checkpoint's `extra`) of the newest checkpoint, or (0, {})."""
        if not self.cfg.train.resume:
            return 0, {}
        path = checkpoint.latest(self.cfg.output_dir)
        if path is None:
            print(
                f"train.resume: no checkpoint in {self.cfg.output_dir}; starting fresh", flush=True
            )
            return 0, {}
        state = checkpoint.load(
            path, self.policy, self.optimizer, self.scheduler, self.prior, self.curriculum
        )
        extra = dict(state.get("extra") or {})
        if self.scaler.enabled and "loss_scale" in extra:
            self.scaler.load_state_dict(extra["loss_scale"])
        self.backend.sync(self.policy, version=state["step"])
        print(f"resumed from {path} (step {state['step']})", flush=True)
        return int(state["step"]), extra


def load_policy(cfg: config.Config, log=print) -> Policy:
    """The trainer's policy. With `rollout.backend=unsloth`, Unsloth builds it (its vLLM engine
    shares the base); otherwise transformers + peft (`Policy.from_config`)."""
    if cfg.rollout.backend == "unsloth":
        from ebpo_lite.rollout.unsloth import load_unsloth_policy

        return load_unsloth_policy(cfg, log)
    return Policy.from_config(cfg, log=log)


def build_run(
    cfg: config.Config,
    log: Callable[[str], None] = print,
    policy: Policy | None = None,
    env_objects: tuple[Any, list] | None = None,
) -> Run:
    """Everything a run holds. The user's mistakes surface first, before any write or model load:
    the config against the machine and paths (`checks`), the reward functions, the data. Then it
    says what it does, one line each: the data, the memory plan, the model (the hub's download
    progress follows), the sampler, and the labels `data.labels_path=auto` makes.
    `policy`: one built elsewhere, used instead of loading `model.name` (scripts/gpu_smoke_stages.py
    builds a random-weight Qwen3-8B in place: its folder holds a config but no weight files).
    `env_objects`: (environment class or {name: class}, tool functions) from the Python API,
    instead of `env.factory` / `env.tools`."""
    checks.before_load(cfg, log)
    fns, weights = reward_functions(cfg.reward, cfg.data)
    tools = env_runtime.prepare(cfg, env_objects, log)  # tool use: probed before the model loads
    train_ex, eval_ex = data.load_train_eval(cfg.data)
    if not train_ex:
        raise UserError("data: no training examples; check data.max_examples and the data file")
    log(startup.data_line(cfg.data, train_ex, eval_ex))
    train_ex = labels.maybe_topic_labels(cfg, train_ex, log)
    rewards.check_columns(fns, train_ex, "the training data")  # a column a reward reads
    rewards.check_columns(fns, eval_ex, "the held-out data")
    labels.check_sampler_labels(cfg, train_ex)  # a curriculum with nothing to order by
    key = cfg.algo.prior_key if cfg.algo.estimator == "ebpo" else None
    if key and not (key == "difficulty" and cfg.data.labels_path == labels.AUTO):
        labels.prior_keys(train_ex, key)  # every example has one: else one line, no model load
    out = _prepare_output_dir(cfg)
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    torch.manual_seed(cfg.train.seed)
    from ebpo_lite.model.plan import preflight

    preflight(cfg)  # on a GPU: refuse a plan that cannot fit before the model loads (CPU: no-op)
    log(startup.memory_line(cfg))
    log(startup.model_line(cfg.model))
    policy = load_policy(cfg) if policy is None else policy
    prompt_ids = data.encode_prompts(policy.tokenizer, train_ex, cfg.data)
    backend = make_backend(cfg, policy)
    log(startup.sampler_line(cfg.rollout, cfg.train))
    episodes = None
    if tools is not None:
        log(tools.line())
        prompt_ids, encode = env_runtime.prompts(cfg, tools, policy.tokenizer, train_ex, prompt_ids)
        episodes = env_runtime.make_runner(cfg, tools, policy, backend, encode)
    labelled = labels.maybe_difficulty_labels(
        cfg, train_ex, prompt_ids, policy, backend, (fns, weights), log
    )
    prompt_sampler = curriculum.make_sampler(
        cfg.curriculum.sampler,
        len(train_ex),
        cfg.train.seed,
        topics=[ex.topic for ex in labelled],
        difficulties=[ex.difficulty for ex in labelled],
        difficulty_is_pass_rate=False,  # levels, and labels files store 1 - pass_rate
        topic_order=cfg.curriculum.topic_order,
        run_length=cfg.curriculum.run_length,
        repeat=cfg.curriculum.repeat,
    )
    prior = _prior(cfg.algo)
    optimizer = torch.optim.AdamW(
        policy.trainable_parameters(),
        lr=cfg.train.lr,
        betas=tuple(cfg.train.betas),
        weight_decay=cfg.train.weight_decay,
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _schedule(cfg.train))
    # written once, and again when a resume changed a setting (checks.same_run names them)
    recorded, text = out / "config.yaml", config.dump(cfg)
    if not (cfg.train.resume and recorded.exists() and recorded.read_text() == text):
        write_atomic(recorded, text)
    return Run(
        cfg,
        policy,
        backend,
        labelled,
        eval_ex,
        prompt_ids,
        fns,
        weights,
        prompt_sampler,
        prior,
        optimizer,
        scheduler,
        LossScaler.for_policy(policy),
        tools,
        episodes,
    )


def _prior(a: config.AlgoConfig) -> EBPrior | None:
    if a.estimator != "ebpo":
        return None
    return EBPrior(
        tau2=a.tau2,
        sigma2=a.sigma2,
        center=a.center,
        decay=a.decay,
        min_count=a.min_count,
        tau2_min=a.tau2_min,
        leave_one_out=a.leave_one_out,
        prompt_prior=a.prompt_prior,
        prompt_capacity=a.prompt_capacity,
    )


def draw_seed(seed: int, step: int, draw: int) -> int:
    """Sampling seed of draw `draw` (0, then dynamic-sampling redraws) of step `step`.

    A 63-bit hash of the triple, so distinct triples never share a seed in practice (the former
    `seed * 1_000_003 + step * 101 + draw` gave draw 101 of step s the seed of draw 0 of step s + 1),
    and a pure function of it, so a resumed run draws what the uninterrupted one did.
    """
    entropy = [seed & 0xFFFF_FFFF_FFFF_FFFF, step, draw]
    return int(np.random.SeedSequence(entropy).generate_state(1, np.uint64)[0]) >> 1


def reward_functions(r: config.RewardConfig, d: config.DataConfig):
    """The (name, function) pairs and weights of `reward.*`; `auto` picks by dataset."""
    names = list(r.functions)
    if names == ["auto"]:
        names = rewards.default_reward_names("arithmetic" if data.is_arithmetic(d) else "")
    fns = []
    for name in names:
        try:
            fns.append((name, rewards.get_reward_fn(name)))
        except ValueError as e:
            raise ConfigError(f"reward.functions: {e}") from None
    weights = list(r.weights) or [1.0] * len(fns)
    return fns, weights


def _schedule(t: config.TrainConfig):
    def factor(step: int) -> float:
        if t.warmup_steps and step < t.warmup_steps:
            return (step + 1) / t.warmup_steps
        if t.schedule == "cosine":
            progress = (step - t.warmup_steps) / max(1, t.steps - t.warmup_steps)
            return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
        return 1.0

    return factor


def _prepare_output_dir(cfg: config.Config) -> Path:
    """Make `output_dir`, prove it writable and roomy enough for the kept checkpoints; then
    `train.overwrite` deletes the old checkpoints, after the data loaded (`checks.output_dir`
    has refused the folder otherwise)."""
    out = Path(cfg.output_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".write_test_{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise ConfigError(
            f"output_dir: cannot write to {out} ({e.strerror or e}); pick a folder you can write to"
        ) from None
    checkpoint.check_disk(cfg)  # room for the checkpoints the recipe keeps, before any delete
    if checkpoint.latest(out) is not None and not cfg.train.resume and cfg.train.overwrite:
        checkpoint.remove_all(out)
    return out


def _accumulate(total: dict[str, torch.Tensor], stats: dict[str, torch.Tensor], weight) -> None:
    """Combine micro-batch stats (0-d tensors, no sync): extremes by max / min, the rest as a
    weighted mean."""
    for k, v in stats.items():
        if k not in total:
            total[k] = v if k.endswith(("_max", "_min")) else v * weight
        elif k.endswith("_max"):
            total[k] = torch.maximum(total[k], v)
        elif k.endswith("_min"):
            total[k] = torch.minimum(total[k], v)
        else:
            total[k] = total[k] + v * weight


def micro_batches(
    rows: list[int], prompts: list[list[int]], completions: list[list[int]], size: int
) -> list[list[int]]:
    """`rows` in micro-batches of `size`, sorted by (completion, prompt) length.

    A micro-batch is padded to its longest prompt + longest completion, so grouping rows of
    similar length wastes little; the loss is unchanged (accumulation is exact for any grouping).
    """
    order = sorted(rows, key=lambda i: (len(completions[i]), len(prompts[i])))
    return [order[s : s + size] for s in range(0, len(order), size)]


def _batch(policy: Policy, prompts: list[list[int]], roll: Rollout, rows: list[int]):
    """The policy's batch of `rows`; a multi-turn rollout's tool-result tokens are 0 in its
    completion mask, so no loss, KL, ratio, entropy or token count sees them."""
    masks = None if roll.tool_masks is None else [roll.tool_masks[i] for i in rows]
    return policy.batch(
        [prompts[i] for i in rows], [roll.completion_ids[i] for i in rows], token_masks=masks
    )


def _stack(rows: list[torch.Tensor], width: int) -> torch.Tensor:
    """Right-pad 1-D tensors of varying length to `[len(rows), width]`."""
    out = rows[0].new_zeros((len(rows), width))
    for i, r in enumerate(rows):
        out[i, : min(len(r), width)] = r[:width]
    return out


def _pad(rows: list[list[float]], width: int) -> torch.Tensor:
    out = torch.zeros((len(rows), width))
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(r[:width])
    return out


def curriculum_rewards(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Rewards [B, G] for `Run.curriculum.update`: NaN where unscorable, which samplers skip (a reward
    of None is no evidence of failure)."""
    ok = mask & torch.isfinite(rewards)  # a NaN / inf reward (a skipped step) is unscorable
    return torch.where(ok, rewards, torch.full_like(rewards, math.nan))  # [B, G]
