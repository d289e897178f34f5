"""The tiny model's supervised warm-up loop, shared by the plain task (`tiny.warm_tiny_model`)
and the calculator task (`tiny_tools.supervised_tool_warmup`, which adds tool trajectories).

Its own module so that `tiny` (which picks a warm-up) and `tiny_tools` (which builds the tool
one's targets) both use it without importing each other."""

from __future__ import annotations

from collections.abc import Callable

import torch


def supervised_warmup(
    model,
    tokenizer,
    examples,
    steps: int,
    seed: int,
    batch: int = 64,
    lr: float = 3e-3,
    slip: float = 0.0,
    on_step: Callable[[int], None] | None = None,
    trajectories: list[tuple[list[int], list[int]]] | None = None,
    tool_share: float = 0.0,
) -> float:
    """Teacher-forced cross-entropy on the answer tokens (+ EOS); returns last token accuracy.

    With `slip > 0`, each time a problem is drawn its target is `meta["slip"]` (the answer with
    the carries dropped) with probability `slip`, so the model learns that slip as a habit.
    With `tool_share > 0`, a draw is instead, with that probability, the example's entry of
    `trajectories` ((ids after the prompt, loss mask): `tiny_tools.supervised_tool_warmup`);
    with 0 no coin is drawn, so the stream of draws is the plain warm-up's.
    `on_step(n)` is called after the n-th step (progress display).
    """
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 50) * max(0.05, 1 - s / max(steps, 1))
    )
    eos = tokenizer.eos_token_id
    all_prompts = [tokenizer.encode(ex.prompt, add_special_tokens=False) for ex in examples]
    all_answers = [tokenizer.encode(ex.answer, add_special_tokens=False) + [eos] for ex in examples]
    all_slips = [
        tokenizer.encode(ex.meta.get("slip", ex.answer), add_special_tokens=False) + [eos]
        for ex in examples
    ]
    model.train()
    acc = 0.0
    for n in range(1, steps + 1):
        idx = torch.randint(len(examples), (batch,), generator=gen).tolist()
        slipped = (torch.rand(batch, generator=gen) < slip).tolist()
        tooled = (torch.rand(batch, generator=gen) < tool_share).tolist() if tool_share > 0 else []
        rows = []
        for k, (i, s) in enumerate(zip(idx, slipped)):
            if tooled and tooled[k]:
                rows.append((all_prompts[i], *trajectories[i]))
            else:
                target = all_slips[i] if s else all_answers[i]
                rows.append((all_prompts[i], target, [1] * len(target)))
        ids, labels, attn = pack_masked(rows, tokenizer.pad_token_id)
        logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1]  # [N, T-1, V]
        target = labels[:, 1:]  # [N, T-1]
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), target.reshape(-1), ignore_index=-100
        )
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        with torch.no_grad():
            mask = target != -100
            acc = (logits.argmax(-1)[mask] == target[mask]).float().mean().item()
        if on_step is not None:
            on_step(n)
    model.eval()
    return acc


def pack_masked(rows: list[tuple[list[int], list[int], list[int]]], pad_id: int):
    """Right-pad (prompt, completion, mask) rows: ids [N, T], labels [N, T] (-100 on the
    prompt, the padding and where the mask is 0), attention [N, T]."""
    width = max(len(p) + len(c) for p, c, _ in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    attn = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (p, c, m) in enumerate(rows):
        n = len(p) + len(c)
        ids[i, :n] = torch.tensor(p + c)
        labels[i, len(p) : n] = torch.tensor([t if k else -100 for t, k in zip(c, m)])
        attn[i, :n] = 1
    return ids, labels, attn
