"""EBPO inside TRL: `EBPOGRPOTrainer`, a `trl.GRPOTrainer` whose advantages come from EBPO.

What it does (tested with TRL `TRL_TESTED`, see `check_trl_version`)
- TRL has no public advantage hook; as its maintainers advise (trl#4525), this overrides
  `_generate_and_score_completions` and replaces `output["advantages"]`. TRL gathers the rewards of
  every process inside `_calculate_rewards`; this class keeps that gathered `[N, F]` tensor, forms
  the weighted sum per completion (`reward_weights`, as TRL's "sum_then_normalize"), reshapes it to
  `[B, G]` (B = prompts of the whole generation batch, all processes) and calls
  `ebpo_lite.algo.advantages.ebpo_advantages`. Every rank computes the same thing from the same
  gathered rewards, so every rank holds an identical prior; each rank then keeps its own slice,
  exactly as TRL slices its advantages.
- Completions that every reward function scored None are masked (no statistic, advantage 0).
- Statistics go to TRL's metrics (`self._metrics["train"]`): `adv/shrinkage`, `adv/mu_glob`,
  `adv/sigma2`, `adv/tau2`, and `curriculum/*` when a curriculum sampler is given.
- Checkpoints: `ebpo_prior.json` (and `ebpo_curriculum.json`) are written into every
  `checkpoint-N` folder and read back on `trainer.train(resume_from_checkpoint=...)`.
- Curriculum: `curriculum=make_sampler(...)` replaces TRL's `RepeatSampler` through
  `_get_train_sampler` with `CurriculumSampler`, which keeps RepeatSampler's layout (each prompt
  `num_generations` times in a row, each generation batch `num_iterations * steps_per_generation`
  times). An adaptive sampler is told the rewards of the prompts it chose.

Options (constructor keywords; everything else goes to `GRPOTrainer`)
    ebpo_prior     an `EBPrior` (its options: tau2, sigma2, center, decay, min_count, tau2_min,
                   leave_one_out, prompt_prior, prompt_capacity)
    ebpo_options   or a dict of those options (not both); default: the paper's variant
    ebpo_prior_key a dataset column (e.g. "topic") whose value per prompt keys the hierarchical
                   prior (docs/algorithm.md section 4, `prior_key`); None: one global prior
    ebpo_prompt_id with the option prompt_prior: a dataset column (str or int) naming each
                   prompt; None: a digest of the prompt itself (its text, or its messages as JSON),
                   so every visit of the same prompt shares one history
    curriculum     a `PromptSampler` from `ebpo_lite.algo.curriculum.make_sampler` over the training
                   dataset's rows; None: TRL's own sampler

Departures from TRL and from ebpo_lite's own trainer
- TRL's `scale_rewards` is ignored (EBPO whitens over the batch); `multi_objective_aggregation`
  must be "sum_then_normalize" (EBPO needs one raw reward per completion).
- Evaluation batches keep TRL's advantages and never update the prior (they only feed the logged
  eval loss).
- TRL's logged completion table shows the EBPO advantages.
- With a curriculum, `args.ignore_data_skip` is set to True: the curriculum state in the
  checkpoint says where to continue, so TRL must not replay (skip) batches on resume. The sampler
  draws a few batches ahead of training (DataLoader prefetch), so an adaptive sampler learns from
  rewards one or two generation batches late; the saved state is the one of the last generation
  batch actually trained on.
- The multi-process layout assumes TRL's default: every rank gets consecutive slices of one
  generation batch (accelerate's batch sharding), which is what RepeatSampler relies on too.

Reward functions: one convention for both
- TRL calls `fn(prompts=..., completions=..., completion_ids=..., **dataset_columns, trainer_state=..,
  log_extra=.., log_metric=..)` and expects `list[float | None]`. ebpo_lite's reward functions
  (`ebpo_lite.rewards.math_answer(completions, answer, **kwargs)`, ...) have that shape, so pass them
  to TRL unchanged: `reward_funcs=[math_answer]` with an `answer` column in the dataset.
- ebpo_lite calls `fn(completions=..., **columns)` (columns: `answer` and the example's meta). A TRL
  function that names `prompts` or `completion_ids` positionally needs `trl_reward(fn)`, which
  fills them (from the `prompts` / `completion_ids` columns when present, else empty strings / None).
"""

from __future__ import annotations

import functools
import json
import os
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Sampler

from ebpo_lite.algo.advantages import EBPrior, ebpo_advantages
from ebpo_lite.data.prompts import prompt_digest

TRL_TESTED = (">=1.16.0", "<1.17")  # the range the tests ran against (CI tier integrations)
SKIP_VERSION_ENV = "EBPO_LITE_TRL_ANY_VERSION"  # "1": try an untested TRL anyway
PRIOR_FILE = "ebpo_prior.json"
CURRICULUM_FILE = "ebpo_curriculum.json"
LOGGED_STATS = ("shrinkage", "mu_glob", "sigma2", "tau2")  # + prompt_visits with prompt_prior
_LEARNED_KEYS = ("successes", "trials")  # sampler state learned from rewards (adaptive)


def check_trl_version(version: str) -> None:
    """Raise ImportError unless `version` is inside TRL_TESTED (or SKIP_VERSION_ENV=1)."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    spec = SpecifierSet(",".join(TRL_TESTED))
    if Version(version) in spec or os.environ.get(SKIP_VERSION_ENV) == "1":
        return
    raise ImportError(
        f"ebpo_lite.integrations.trl is tested with trl{','.join(TRL_TESTED)}, but trl {version} is "
        f"installed. It overrides private GRPOTrainer methods that change between releases: "
        f"install a tested version (pip install 'trl{','.join(TRL_TESTED)}'), or set "
        f"{SKIP_VERSION_ENV}=1 to try this one at your own risk."
    )


import trl  # noqa: E402  (the version check must run before GRPOTrainer's private API is used)

check_trl_version(trl.__version__)

from trl import GRPOTrainer  # noqa: E402

# ----------------------------------------------------------------------------- rewards


def trl_reward(fn: Callable[..., Sequence[Any]]) -> Callable[..., list[float | None]]:
    """Wrap a TRL-style reward function for ebpo_lite (`fn(completions=..., **columns)`)."""

    @functools.wraps(fn)
    def wrapper(completions: Sequence[Any], **columns: Any) -> list[float | None]:
        n = len(completions)
        prompts = columns.pop("prompts", None) or [""] * n
        completion_ids = columns.pop("completion_ids", None)
        values = fn(
            prompts=prompts, completions=completions, completion_ids=completion_ids, **columns
        )
        return [None if v is None else float(v) for v in values]

    return wrapper


# ----------------------------------------------------------------------------- sampler


class CurriculumSampler(Sampler):
    """A torch Sampler over a `PromptSampler`, laid out like TRL's `RepeatSampler`.

    Per generation batch: `prompts_per_batch` indices from `sampler.next_batch`, each yielded
    `mini_repeat_count` (= G) times in a row, the whole batch `repeat_count` times. One "epoch" is
    `n_examples // prompts_per_batch` batches (RepeatSampler's length); the PromptSampler carries on
    across epochs. A short or exhausted batch (difficulty with repeat=False) ends the iteration.
    `pending` holds (indices, state after drawing them) for batches not yet trained on.
    """

    def __init__(
        self, sampler: Any, prompts_per_batch: int, mini_repeat_count: int, repeat_count: int
    ) -> None:
        self.sampler = sampler
        self.prompts_per_batch = prompts_per_batch
        self.mini_repeat_count = mini_repeat_count
        self.repeat_count = repeat_count
        self.batches_per_epoch = max(sampler.n_examples // prompts_per_batch, 1)
        self.pending: deque[tuple[list[int], dict[str, Any]]] = deque()

    def __len__(self) -> int:
        return (
            self.batches_per_epoch
            * self.prompts_per_batch
            * self.mini_repeat_count
            * self.repeat_count
        )

    def __iter__(self) -> Iterator[int]:
        for _ in range(self.batches_per_epoch):
            try:
                chunk = self.sampler.next_batch(self.prompts_per_batch)
            except StopIteration:
                return
            if len(chunk) < self.prompts_per_batch:
                return
            self.pending.append((list(chunk), self.sampler.state_dict()))
            for _ in range(self.repeat_count):
                for index in chunk:
                    for _ in range(self.mini_repeat_count):
                        yield index


def consumed_state(after_draw: dict[str, Any], live: dict[str, Any]) -> dict[str, Any]:
    """The sampler state to save: position as right after drawing the last trained batch, learned
    statistics (adaptive posterior counts) as they are now, i.e. including that batch's rewards."""
    return {**after_draw, **{k: live[k] for k in _LEARNED_KEYS if k in live}}


# ----------------------------------------------------------------------------- trainer


class EBPOGRPOTrainer(GRPOTrainer):
    """`GRPOTrainer` with EBPO advantages, a saved prior and optional curriculum (module docstring)."""

    def __init__(
        self,
        *args: Any,
        ebpo_prior: EBPrior | None = None,
        ebpo_options: dict[str, Any] | None = None,
        ebpo_prior_key: str | None = None,
        ebpo_prompt_id: str | None = None,
        curriculum: Any | None = None,
        **kwargs: Any,
    ) -> None:
        if ebpo_prior is not None and ebpo_options is not None:
            raise ValueError("EBPOGRPOTrainer: pass ebpo_prior or ebpo_options, not both")
        if ebpo_prior is not None and not isinstance(ebpo_prior, EBPrior):
            raise ValueError(f"ebpo_prior: expected an EBPrior, got {type(ebpo_prior).__name__}")
        self.ebpo_prior = ebpo_prior if ebpo_prior is not None else EBPrior(**(ebpo_options or {}))
        self.ebpo_prior_key = ebpo_prior_key
        self.ebpo_prompt_id = ebpo_prompt_id
        self.curriculum = curriculum
        self.ebpo_last: dict[str, Any] = {}  # rewards [B, G], mask, advantages [B, G], stats
        self._ebpo_rewards_per_func: torch.Tensor | None = None
        self._curriculum_sampler: CurriculumSampler | None = None
        self._curriculum_saved: dict[str, Any] | None = None
        super().__init__(*args, **kwargs)
        if self.multi_objective_aggregation != "sum_then_normalize":
            raise ValueError(
                "multi_objective_aggregation: EBPO needs one raw reward per completion; use "
                f"'sum_then_normalize', got {self.multi_objective_aggregation!r}"
            )
        if curriculum is not None:
            n = len(self.train_dataset)
            if curriculum.n_examples != n:
                raise ValueError(
                    f"curriculum: built over {curriculum.n_examples} examples but train_dataset has {n}"
                )
            self.args.ignore_data_skip = True  # the curriculum state says where to continue

    # -- sampling ------------------------------------------------------------------------------
    def _get_train_sampler(self, dataset: Any = None) -> Sampler:
        if self.curriculum is None:
            return super()._get_train_sampler(dataset)
        self._curriculum_sampler = CurriculumSampler(
            self.curriculum,
            prompts_per_batch=self.args.generation_batch_size // self.num_generations,
            mini_repeat_count=self.num_generations,
            repeat_count=self.num_iterations * self.args.steps_per_generation,
        )
        return self._curriculum_sampler

    # -- advantages ----------------------------------------------------------------------------
    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        rewards_per_func = super()._calculate_rewards(
            inputs, prompts, completions, completion_ids_list
        )
        self._ebpo_rewards_per_func = rewards_per_func  # [N, F], gathered over all processes
        return rewards_per_func

    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        self._ebpo_rewards_per_func = None
        output = super()._generate_and_score_completions(inputs)
        if not self.model.training:
            return output  # eval: TRL's advantages, prior untouched
        per_func = self._ebpo_rewards_per_func  # [N, F]
        if per_func is None:
            raise RuntimeError(
                "EBPOGRPOTrainer: TRL did not call _calculate_rewards (TRL changed?)"
            )
        G = self.num_generations
        weights = self.reward_weights.to(per_func.device)  # [F]
        valid = ~torch.isnan(per_func).all(dim=1)  # [N]
        rewards = (per_func * weights.unsqueeze(0)).nansum(dim=1)  # [N]
        R = rewards.view(-1, G)  # [B, G]
        M = valid.view(-1, G)  # [B, G]
        keys = self._prior_keys(inputs, G)
        prompts = self._prompt_ids(inputs, G)
        A, stats = ebpo_advantages(R, self.ebpo_prior, mask=M, keys=keys, prompts=prompts)
        n_local = len(inputs)
        start = self.accelerator.process_index * n_local
        local = A.reshape(-1)[start : start + n_local]  # [n_local]
        output["advantages"] = local.to(output["advantages"].dtype)
        for _ in range(min(A.numel(), len(self._logs["advantages"]))):
            self._logs["advantages"].pop()
        self._logs["advantages"].extend(A.reshape(-1).tolist())
        for k in (*LOGGED_STATS, "prompt_visits"):
            if k in stats:
                self._metrics["train"][f"adv/{k}"].append(stats[k])
        self.ebpo_last = {
            "rewards": R.detach().cpu(),
            "mask": M.cpu(),
            "advantages": A.cpu(),
            "stats": stats,
            "keys": keys,
            "prompts": prompts,
        }
        self._maybe_update_curriculum(inputs, torch.where(M, R, torch.nan))
        return output

    def _prior_keys(self, inputs: list[dict[str, Any]], G: int) -> list[Any] | None:
        if self.ebpo_prior_key is None:
            return None
        from accelerate.utils import gather_object

        local = [x.get(self.ebpo_prior_key) for x in inputs]
        if any(v is None for v in local):
            raise ValueError(f"ebpo_prior_key: column {self.ebpo_prior_key!r} missing or None")
        return gather_object(local)[::G]  # one key per prompt

    def _prompt_ids(self, inputs: list[dict[str, Any]], G: int) -> list[Any] | None:
        """One id per prompt of the whole generation batch (all processes), for prompt_prior."""
        if not self.ebpo_prior.prompt_prior:
            return None
        from accelerate.utils import gather_object

        if self.ebpo_prompt_id is not None:
            local = [x.get(self.ebpo_prompt_id) for x in inputs]
            if any(v is None for v in local):
                raise ValueError(f"ebpo_prompt_id: column {self.ebpo_prompt_id!r} missing or None")
        else:
            local = [prompt_digest(json.dumps(x["prompt"], sort_keys=True)) for x in inputs]
        return gather_object(local)[::G]  # one id per prompt

    def _maybe_update_curriculum(self, inputs: list[dict[str, Any]], R: torch.Tensor) -> None:
        cs = self._curriculum_sampler
        if cs is None:
            return
        G, n_local = self.num_generations, len(inputs)
        first = self.accelerator.process_index * n_local  # this rank's first global position
        while cs.pending:
            chunk, after_draw = cs.pending.popleft()
            if self.train_dataset[chunk[first // G]]["prompt"] == inputs[0]["prompt"]:
                break
        else:  # nothing matched (e.g. an untested TRL layout): keep training, skip the update
            return
        cs.sampler.update(chunk, R.cpu())
        self._curriculum_saved = consumed_state(after_draw, cs.sampler.state_dict())
        for k, v in cs.sampler.stats().items():
            self._metrics["train"][f"curriculum/{k}"].append(float(v))

    # -- checkpoints ---------------------------------------------------------------------------
    def _save_checkpoint(self, model, trial) -> None:
        super()._save_checkpoint(model, trial)
        if not self.args.should_save:
            return
        from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

        folder = (
            Path(self._get_output_dir(trial=trial))
            / f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        )
        _write_json(folder / PRIOR_FILE, self.ebpo_prior.state_dict())
        if self._curriculum_saved is not None:
            _write_json(folder / CURRICULUM_FILE, self._curriculum_saved)

    def _load_optimizer_and_scheduler(self, checkpoint) -> None:
        # Called on every resume path (plain, DeepSpeed, FSDP), before the dataloader is iterated.
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is None:
            return
        path = Path(checkpoint) / PRIOR_FILE
        if path.is_file():
            self.ebpo_prior.load_state_dict(json.loads(path.read_text()))
        path = Path(checkpoint) / CURRICULUM_FILE
        if self.curriculum is not None and path.is_file():
            self.curriculum.load_state_dict(json.loads(path.read_text()))
            self._curriculum_saved = json.loads(path.read_text())


def _write_json(path: Path, obj: Any) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, path)
