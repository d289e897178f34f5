"""The trainable policy: a base model (full precision or NF4 via bitsandbytes) plus a peft LoRA.

- The base is never merged: the sampler receives the adapter alone (`export_adapter`).
- Optional extra trainable base parameters (`model.trainable_extra`, e.g. norm weights) make
  `trains_base` true; `export_base` then writes the base with those tensors updated, copied from
  the original checkpoint files, so a sampler can reload exactly what the trainer holds.
  Checkpoints and `ebpo_lite.commands.export` save them inside the adapter as peft `modules_to_save`
  (`add_extra_weights`), so `PeftModel.from_pretrained(base, folder)` is the trained model.
- The reference policy for the KL term is this same model with the adapter disabled: no second copy.

Batch layout used by the log-prob functions: prompts are left-padded to width P and completions
right-padded to width C, so every completion starts at column P and only the last C + 1 positions
of the logits are computed (`logits_to_keep`), which matters for 150k-token vocabularies.

Shared prompts (`train.share_prompts`): a GRPO batch holds each prompt G times. Then each distinct
prompt runs forward once (U rows, with its KV cache), the cache's rows are gathered to the N
completions (`Cache.reorder_cache`, an index_select, so gradients flow back to the one prompt
forward) and the completions run on top of it. The logits, log-probs and LoRA gradients are the
full batch's to fp32 round-off (tests/test_policy.py). Not with gradient checkpointing (the
checkpointed layers drop the cache) or train-mode dropout (the G rows would share one dropout mask
on the prompt): there the full batch runs.

NF4 base (`model.load_in_4bit`; docs/qlora.md): every LoRA-wrapped linear layer's base is a
bitsandbytes `Linear4bit`. A forward whose input needs grad runs bitsandbytes' `MatMul4Bit`
autograd function (forward `gemm_4bit`; backward dequantizes the weight and multiplies, so the
gradient flows to the input and on to every LoRA below); a no-grad forward (sampling, scoring)
calls `gemm_4bit` directly. That holds on CUDA for every shape, single decode rows included.
On a CPU with AVX512-BF16, bitsandbytes 0.50.2 would instead repack the weight at the first
eval-mode no-grad forward and from then on run every forward, training too, through
`gemv_4bit`, which has no autograd kernel: the base silently stops passing gradient to its
input. `keep_nf4_differentiable` turns that repacking off (tests/test_nf4.py checks the LoRA
gradients against the dequantized base).
From those logits (model dtype) the log-probs and entropies are computed in fp32 chunks of rows
(`completion_logprobs`), so a micro-batch never holds an fp32 [N, C, V] copy: with Qwen3's 152k
vocabulary and 4 x 4096 completion tokens one such copy is 9.3 GiB.
"""

from __future__ import annotations

import inspect
import shutil
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ebpo_lite.errors import UserError
from ebpo_lite.model.extra_weights import add_extra_weights, unsaveable_extra
from ebpo_lite.model.memory import logprob_chunk_rows

if TYPE_CHECKING:
    from ebpo_lite.config import Config


@dataclass
class Batch:
    input_ids: torch.Tensor  # [N, P + C]
    attention_mask: torch.Tensor  # [N, P + C]
    position_ids: torch.Tensor  # [N, P + C]
    completion_mask: torch.Tensor  # [N, C] float, 1 on real completion tokens
    prompt_width: int  # P
    prompt_rows: torch.Tensor | None = None  # [U] first row of each distinct prompt (shared)
    prompt_index: torch.Tensor | None = None  # [N] each row's distinct prompt, in 0..U-1


def make_batch(
    prompt_ids: list[list[int]],
    completion_ids: list[list[int]],
    pad_id: int,
    device: torch.device | str = "cpu",
    share_prompts: bool = False,
    token_masks: list[list[int]] | None = None,
) -> Batch:
    """Left-pad prompts to P, right-pad completions to C (layout in the module docstring).

    `token_masks` (multi-turn rollouts): per completion, 1 on the tokens the model wrote, 0 on
    tool results; the completion mask is 0 there too, so they are context and nothing more.

    `share_prompts`: when some prompt occurs more than once, record the distinct prompts
    (`prompt_rows`, `prompt_index`) so that `completion_logits` runs each of them once.
    """
    if len(prompt_ids) != len(completion_ids):
        raise ValueError(f"{len(prompt_ids)} prompts for {len(completion_ids)} completions")
    n = len(prompt_ids)
    width_p = max(len(p) for p in prompt_ids)
    width_c = max(1, max(len(c) for c in completion_ids))
    # one tensor from padded Python rows: a per-row torch.tensor costs more than the model here
    rows = [
        [pad_id] * (width_p - len(p)) + list(p) + list(c) + [pad_id] * (width_c - len(c))
        for p, c in zip(prompt_ids, completion_ids)
    ]
    masks = [
        [0] * (width_p - len(p)) + [1] * (len(p) + len(c)) + [0] * (width_c - len(c))
        for p, c in zip(prompt_ids, completion_ids)
    ]
    ids = torch.tensor(rows, dtype=torch.long).reshape(n, width_p + width_c)  # [N, P + C]
    attn = torch.tensor(masks, dtype=torch.long).reshape(n, width_p + width_c)  # [N, P + C]
    pos = (attn.cumsum(-1) - 1).clamp(min=0)  # [N, P + C]
    cmask = attn[:, width_p:].float()  # [N, C]
    if token_masks is not None:
        tm = [list(m) + [0] * (width_c - len(m)) for m in token_masks]
        cmask = cmask * torch.tensor(tm, dtype=torch.float).reshape(n, width_c)  # [N, C]
    batch = Batch(ids.to(device), attn.to(device), pos.to(device), cmask.to(device), width_p)
    if share_prompts:
        first: dict[tuple[int, ...], int] = {}  # prompt -> its distinct index
        heads: list[int] = []  # each distinct prompt's first row
        index = []  # each row's distinct prompt
        for i, p in enumerate(prompt_ids):
            index.append(first.setdefault(tuple(p), len(first)))
            heads += [i] if index[-1] == len(heads) else []  # a new prompt
        if len(first) < n:
            batch.prompt_rows = torch.tensor(heads, dtype=torch.long, device=device)  # [U]
            batch.prompt_index = torch.tensor(index, dtype=torch.long, device=device)  # [N]
    return batch


def completion_logits(model, batch: Batch) -> torch.Tensor:
    """Logits at the completion positions, in the model's dtype: [N, C + 1, V].

    Position P-1+t predicts completion token t; the last row predicts the token after the batch.
    A batch with shared prompts runs each distinct prompt once (`_shared_prompt_logits`).
    On CPU the kept positions are passed as an index tensor (`_kept_positions`).
    """
    if batch.prompt_index is not None and not (model.training and _checkpointing(model)):
        return _shared_prompt_logits(model, batch)
    keep = _kept_positions(batch.input_ids, batch.completion_mask.shape[1] + 1)
    out = model(
        input_ids=batch.input_ids,
        attention_mask=batch.attention_mask,
        position_ids=batch.position_ids,
        logits_to_keep=keep,
        use_cache=False,
    )
    return out.logits


def _kept_positions(input_ids: torch.Tensor, keep: int) -> int | torch.Tensor:
    """`logits_to_keep` for the last `keep` positions of `input_ids` [N, T].

    On CPU the kept positions are passed as an index tensor, which gathers them into a
    contiguous [N, keep, h]: the last-k slice an integer asks for is a non-contiguous view, and
    CPU `F.linear` on such a view materialises the lm_head weight once per sequence (N x V x h,
    0.6 GiB at N = 2 for Qwen3's V and h = 1024; benchmarks/plan_vs_measured.py). CUDA keeps the
    integer, the form the GPU-only backends (Unsloth's patched forward) were written against;
    whether CUDA's batched matmul copies the weight too is not measured yet (docs/gpu_check.md).
    """
    if input_ids.device.type != "cpu":
        return keep
    width = input_ids.shape[1]
    return torch.arange(width - keep, width)  # [keep]


def _shared_prompt_logits(model, batch: Batch) -> torch.Tensor:
    """`completion_logits` with one forward per distinct prompt: [N, C + 1, V].

    The U distinct prompts run with a KV cache and keep their last position's logits (it
    predicts completion token 0); the cache's rows are gathered to the N completions, which then
    run on top of it with the full [N, P + C] attention mask and their own positions.
    """
    width_p, width_c = batch.prompt_width, batch.completion_mask.shape[1]
    rows, index = batch.prompt_rows, batch.prompt_index  # [U], [N]
    head = model(
        input_ids=batch.input_ids[rows, :width_p],  # [U, P]
        attention_mask=batch.attention_mask[rows, :width_p],  # [U, P]
        position_ids=batch.position_ids[rows, :width_p],  # [U, P]
        logits_to_keep=_kept_positions(batch.input_ids[rows, :width_p], 1),
        use_cache=True,
    )
    cache = head.get("cache") or head.past_key_values  # transformers >= 5.2x name it `cache`
    cache.reorder_cache(index)  # every layer's keys / values: [U, ...] -> [N, ...]
    tail = model(
        input_ids=batch.input_ids[:, width_p:],  # [N, C]
        attention_mask=batch.attention_mask,  # [N, P + C]
        position_ids=batch.position_ids[:, width_p:],  # [N, C]
        **{_cache_argument(model): cache},
        logits_to_keep=width_c,  # every position of the [N, C] input: no slice, no copy
        use_cache=True,
    )
    # index_select: logits[index]'s CPU backward adds rows from all threads at once (random order)
    return torch.cat([head.logits.index_select(0, index), tail.logits], dim=1)  # [N, C + 1, V]


def _checkpointing(model) -> bool:
    """Whether gradient (activation) checkpointing is on, under either transformers name."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        if hasattr(type(base), name):
            return bool(getattr(base, name))
    return False


def _cache_argument(model) -> str:
    """The forward's KV-cache argument: `cache` (newer transformers) or `past_key_values`."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return (
        "cache"
        if "cache" in inspect.signature(type(base).forward).parameters
        else ("past_key_values")
    )


def completion_logprobs(
    model,
    batch: Batch,
    with_entropy: bool = False,
    temperature: float = 1.0,
    chunk_rows: int | None = None,
):
    """Per-token log-probs of the completion tokens at `temperature`: [N, C] (and entropies).

    The log-probs are those of softmax(logits / T), the distribution a sampler draws from at
    temperature T (before any top-p / top-k / min-p truncation); the entropy is that
    distribution's, without gradient. T = 0 (greedy) is scored at 1, as vLLM does.
    Both are computed in chunks of `chunk_rows` of the N * C positions (default: one fp32 chunk
    within `memory.LOGPROB_CHUNK_BYTES`), so no fp32 [N, C, V] copy is ever made
    (`_ChunkedLogProbs`).
    """
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    logits = completion_logits(model, batch)  # [N, C + 1, V]
    targets = batch.input_ids[:, batch.prompt_width :]  # [N, C]
    rows = chunk_rows or logprob_chunk_rows(logits.shape[-1])
    scale = 1.0 / temperature if temperature > 0 else 1.0
    logp, entropy = _ChunkedLogProbs.apply(logits, targets, scale, rows, with_entropy)
    return logp, (entropy if with_entropy else None)


class _ChunkedLogProbs(torch.autograd.Function):
    """log softmax(x / T)[target] per position, x = logits, in chunks of rows of fp32.

    Notation: x [N, L, V] logits in the model's dtype (L >= C), y [N, C] targets, s = 1 / T,
    position (n, t) scores y[n, t] from x[n, t]; z = s * x[n, t] in fp32, lse = logsumexp(z).
    Forward: logp = z[y] - lse, entropy = lse - sum softmax(z) * z (no gradient).
    Backward: d logp / d x = s * (onehot(y) - softmax(z)), recomputed per chunk from the saved
    x and lse. Only x (which the model made anyway), lse and one gradient the size of x stay
    alive; fp32 exists for one chunk at a time (the per-chunk helpers free it on return).
    Autograd through `.float()`, `logsumexp` and `gather` would instead keep the fp32 [N, C, V]
    copy and build more of it in backward.
    """

    @staticmethod
    def forward(ctx, logits, targets, scale: float, chunk_rows: int, with_entropy: bool):
        n_seq, width = targets.shape
        flat_y = targets.reshape(-1)  # [N*C]
        logp = torch.empty(flat_y.shape, dtype=torch.float32, device=logits.device)  # [N*C]
        lse = torch.empty_like(logp)  # [N*C]
        entropy = torch.empty_like(logp) if with_entropy else logp.new_empty(0)  # [N*C] or [0]
        for idx in _chunks(flat_y.numel(), chunk_rows, logits.device):
            _forward_chunk(logits, flat_y, idx, width, scale, logp, lse, entropy)
        ctx.save_for_backward(logits, targets, lse)
        ctx.scale, ctx.chunk_rows = scale, chunk_rows
        entropy = entropy.view(n_seq, width) if with_entropy else entropy  # [N, C] or [0]
        ctx.mark_non_differentiable(entropy)
        return logp.view(n_seq, width), entropy

    @staticmethod
    def backward(ctx, grad_logp, _grad_entropy):
        logits, targets, lse = ctx.saved_tensors
        width = targets.shape[1]
        flat_y, g = targets.reshape(-1), grad_logp.reshape(-1).float()  # [N*C], [N*C]
        grad = torch.zeros_like(logits)  # [N, L, V]
        for idx in _chunks(flat_y.numel(), ctx.chunk_rows, logits.device):
            grad[idx // width, idx % width] = _grad_chunk(
                logits, flat_y, lse, g, idx, width, ctx.scale
            )
        return grad, None, None, None, None


def _chunks(rows: int, chunk_rows: int, device) -> list[torch.Tensor]:
    """Flat position indices [k] of each chunk of `chunk_rows` (the last one shorter)."""
    return [
        torch.arange(s, min(s + chunk_rows, rows), device=device)
        for s in range(0, rows, chunk_rows)
    ]


def _forward_chunk(logits, flat_y, idx, width, scale, logp, lse, entropy) -> None:
    """Fill logp[idx], lse[idx] (and entropy[idx] when it has room) from one chunk of rows."""
    z = logits[idx // width, idx % width].float().mul_(scale)  # [k, V] (a copy)
    lse[idx] = torch.logsumexp(z, dim=-1)  # [k]
    logp[idx] = z.gather(-1, flat_y[idx, None]).squeeze(-1) - lse[idx]  # [k]
    if entropy.numel():
        p = torch.softmax(z, dim=-1)  # [k, V]
        entropy[idx] = lse[idx] - p.mul_(z).sum(-1)  # [k]


def _grad_chunk(logits, flat_y, lse, g, idx, width, scale) -> torch.Tensor:
    """d(sum g * logp) / d logits on one chunk of rows: [k, V] in the logits' dtype."""
    z = logits[idx // width, idx % width].float().mul_(scale)  # [k, V] (a copy)
    gz = z.sub_(lse[idx, None]).exp_().mul_(-g[idx, None])  # [k, V]: -g * softmax(z)
    gz[torch.arange(idx.numel(), device=idx.device), flat_y[idx]] += g[idx]  # + g * onehot(y)
    return gz.mul_(scale).to(logits.dtype)


def dropout_in_training(model) -> bool:
    """Whether a train-mode forward is random: an `nn.Dropout` with p > 0 (LoRA dropout), or a
    `*dropout` / `*pdrop` config value > 0 (attention dropout is functional, not a module)."""
    if any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules()):
        return True
    cfg = getattr(model, "config", None)
    values = cfg.to_dict() if hasattr(cfg, "to_dict") else {}
    return any(
        k.endswith(("dropout", "pdrop")) and isinstance(v, float | int) and v > 0
        for k, v in values.items()
    )


class Policy:
    """Base + LoRA, with the adapter export the samplers need."""

    def __init__(
        self,
        model,
        tokenizer,
        device: torch.device,
        base_path: str,
        lora_rank: int,
        trainable_extra: list[str],
        dtype: torch.dtype,
        share_prompts: bool = False,
    ):
        self.model, self.tokenizer, self.device, self.dtype = model, tokenizer, device, dtype
        self.base_path, self.lora_rank = base_path, lora_rank
        self.trainable_extra = list(trainable_extra)
        self.share_prompts = share_prompts  # each distinct prompt of a micro-batch runs once

    @property
    def trains_base(self) -> bool:
        return bool(self.trainable_extra)

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """The ids that end a turn: the generation config's `eos_token_id` list + the tokenizer's."""
        from ebpo_lite.model.base_model import stop_token_ids

        return stop_token_ids(self.tokenizer, getattr(self.model, "generation_config", None))

    @classmethod
    def from_config(cls, cfg: Config, log=print) -> Policy:
        """transformers + peft. (`run.load_policy` picks Unsloth's loader for its backend.)"""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from ebpo_lite.model.base_model import model_name, resolve
        from ebpo_lite.model.device import resolve_attn, resolve_device, resolve_dtype
        from ebpo_lite.model.scaler import refuse_float16_extra

        m = cfg.model
        model_name(m.name)  # a mistyped path fails here, not as a hub download
        device = resolve_device(m.device)
        dtype = resolve_dtype(m.dtype, device)
        refuse_float16_extra(m.trainable_extra, dtype)  # before the model loads
        base_path = resolve(cfg, log)  # tiny, smollm2, a .gguf: their cached folder
        kwargs = dict(
            dtype=dtype,
            trust_remote_code=m.trust_remote_code,
            attn_implementation=resolve_attn(m.attn_implementation, device, dtype),
        )
        if m.load_in_4bit:  # quantised on model.device (else on CUDA's current device)
            kwargs.update(quantization_config=_nf4_config(dtype), device_map={"": str(device)})
        try:
            tokenizer = AutoTokenizer.from_pretrained(
                base_path, trust_remote_code=m.trust_remote_code
            )
            model = AutoModelForCausalLM.from_pretrained(base_path, **kwargs)
        except (OSError, ValueError) as e:  # no such hub id, no network, unreadable files
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise UserError(
                f"model.name: cannot load {base_path!r} ({first}); give a hub id (owner/name), "
                "a local model folder, or tiny; offline, set HF_HUB_OFFLINE=1 to use the cache"
            ) from None
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        if m.load_in_4bit:
            keep_nf4_differentiable(model)  # before any forward: see `keep_nf4_differentiable`
        else:
            model.to(device)
        torch.manual_seed(cfg.train.seed)  # LoRA A's init: the same whatever ran before
        model = _add_lora(model, m)
        if m.gradient_checkpointing:
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )
            model.enable_input_require_grads()
        share = cfg.train.share_prompts and not m.gradient_checkpointing
        share = share and not dropout_in_training(model)  # see the module docstring
        return cls(
            model, tokenizer, device, base_path, m.lora_rank, m.trainable_extra, dtype, share
        )

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def trainable_state(self) -> dict[str, torch.Tensor]:
        """The tensors a checkpoint needs: LoRA weights and any extra trainable base tensors."""
        return {
            n: p.detach().cpu().clone() for n, p in self.model.named_parameters() if p.requires_grad
        }

    def load_trainable_state(self, state: dict[str, torch.Tensor]) -> None:
        params = dict(self.model.named_parameters())
        for name, value in state.items():
            if name not in params:
                raise UserError(f"checkpoint: parameter {name} does not exist in this model")
            params[name].data.copy_(value.to(params[name].device, params[name].dtype))

    def batch(
        self,
        prompt_ids: list[list[int]],
        completion_ids: list[list[int]],
        token_masks: list[list[int]] | None = None,
    ) -> Batch:
        pad = self.tokenizer.pad_token_id
        return make_batch(
            prompt_ids, completion_ids, pad, self.device, self.share_prompts, token_masks
        )

    def ref_context(self):
        """Context in which the model is the reference policy (adapter disabled)."""
        return self.model.disable_adapter()

    @torch.no_grad()
    def token_logprobs(
        self,
        prompt_ids: list[list[int]],
        completion_ids: list[list[int]],
        reference: bool = False,
        micro_batch: int = 64,
        temperature: float = 1.0,
    ) -> list[list[float]]:
        """Trainer log-probs of each completion token at `temperature` (no grad), ragged."""
        was_training = self.model.training
        self.model.eval()
        out: list[list[float]] = []
        with self.ref_context() if reference else nullcontext():
            for s in range(0, len(prompt_ids), micro_batch):
                b = self.batch(prompt_ids[s : s + micro_batch], completion_ids[s : s + micro_batch])
                logp, _ = completion_logprobs(self.model, b, temperature=temperature)
                for row, c in zip(logp.cpu().tolist(), completion_ids[s : s + micro_batch]):
                    out.append(row[: len(c)])
        self.model.train(was_training)
        return out

    def export_adapter(self, out_dir: str | Path, with_extra: bool = False) -> Path:
        """Write the LoRA adapter in peft's format (adapter_model.safetensors).

        `with_extra`: also the trained non-LoRA tensors (`model.trainable_extra`, e.g. norms) as
        peft `modules_to_save` (`add_extra_weights`), so that `PeftModel.from_pretrained(base,
        out_dir)` is the trained model. Without it (the samplers' copy) the folder holds LoRA
        alone: vLLM's LoRA loader refuses any other tensor, and the vLLM sampler reloads the
        trained base tensors itself (`export_base`). No hub call: peft's default
        `save_embedding_layers="auto"` asks the hub whether the base has a config.json on every save
        unless HF_HUB_OFFLINE (peft 0.17-0.21 `get_peft_model_state_dict`); the vocabulary is never
        resized here, so there are no embedding weights to save.
        """
        out = Path(out_dir)
        self.model.save_pretrained(out, safe_serialization=True, save_embedding_layers=False)
        if with_extra and self.trains_base:
            extra = {
                n: p.detach().cpu()
                for n, p in self.model.named_parameters()
                if p.requires_grad and "lora_" not in n
            }
            if not unsaveable_extra(extra):
                add_extra_weights(out, extra)
        return out

    def export_base(self, out_dir: str | Path) -> Path:
        """Write the base weights the trainer holds now: original files + trained extras."""
        from safetensors.torch import load_file, save_file

        src = _local_model_dir(self.base_path)
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        current = {
            _hf_name(n): p.detach().cpu()
            for n, p in self.model.named_parameters()
            if p.requires_grad and "lora_" not in n
        }
        for f in src.iterdir():
            if f.suffix == ".safetensors":
                tensors = load_file(f)
                for k in tensors.keys() & current.keys():
                    tensors[k] = current[k].to(tensors[k].dtype).contiguous()
                save_file(tensors, out / f.name, metadata={"format": "pt"})
            elif f.is_file() and f.suffix in (".json", ".txt", ".model", ".jinja"):
                shutil.copy2(f, out / f.name)
        return out


def _hf_name(peft_name: str) -> str:
    name = peft_name.removeprefix("base_model.model.")
    return name.replace(".base_layer.", ".")


def _local_model_dir(path: str) -> Path:
    p = Path(path)
    if p.is_dir():
        return p
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(path, local_files_only=True))


def _nf4_config(dtype: torch.dtype):
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        raise UserError(
            "model.load_in_4bit: needs bitsandbytes (pip install 'ebpo-lite[bnb]'), "
            "or set model.load_in_4bit=false"
        ) from None
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=dtype,
    )


def keep_nf4_differentiable(model) -> int:
    """Keep every bitsandbytes `Linear4bit` of `model` on its differentiable path; returns how
    many there are.

    bitsandbytes 0.50.2 on a CPU with AVX512-BF16 repacks a `Linear4bit`'s weight, once and for
    good, at its first forward in eval mode on an input without grad (a sampler's or scorer's
    forward). From then on `matmul_4bit` sends every forward of that layer, training ones
    included, to `torch.ops.bitsandbytes.gemv_4bit`, an op with no autograd kernel: the layer's
    output then has no gradient with respect to its input (torch warns once, then LoRA layers
    below it lose that part of their gradient), and the kernel rounds an fp32 input to bf16.
    With the flag below off, every CPU forward stays on `gemm_4bit` (dequantize, then matmul:
    bitsandbytes' `MatMul4Bit` autograd function when the input needs grad); CUDA never repacks.
    """
    import bitsandbytes as bnb

    layers = [mod for mod in model.modules() if isinstance(mod, bnb.nn.Linear4bit)]
    for mod in layers:
        if getattr(mod.weight.quant_state, "packing_format_for_cpu", False):
            raise RuntimeError(f"{type(mod).__name__}: already repacked for bitsandbytes' CPU gemv")
        mod.support_avx512bf16_for_cpu = False
    return len(layers)


def _add_lora(model, m):
    from peft import LoraConfig, get_peft_model

    targets = m.lora_target_modules
    target = "all-linear" if targets == ["all-linear"] else list(targets)
    lcfg = LoraConfig(
        r=m.lora_rank,
        lora_alpha=m.lora_alpha,
        lora_dropout=m.lora_dropout,
        target_modules=target,
        task_type="CAUSAL_LM",
        bias="none",
    )
    model = get_peft_model(model, lcfg)
    hit = set()
    for name, p in model.named_parameters():
        if "lora_" not in name and (match := {s for s in m.trainable_extra if s in name}):
            if p.dtype in (torch.uint8, torch.int8):
                raise UserError(f"model.trainable_extra: {name} is quantised and cannot be trained")
            p.requires_grad_(True)
            hit |= match
    if missing := sorted(set(m.trainable_extra) - hit):  # a typo must not train nothing silently
        raise UserError(f"model.trainable_extra: {missing} match no parameter name of {m.name}")
    return model
