"""One GGUF file from a merged transformers folder, for llama.cpp, Ollama and LM Studio.

Built on PyPI's `gguf`, llama.cpp's own Python package (gguf-py, the one its
`convert_hf_to_gguf.py` uses; 0.19 is the copy vendored in llama.cpp itself). Tensor names come
from its `TensorNameMap` for the architecture, and each mapped tensor is checked against the
architecture's tensor list (`MODEL_TENSORS`); no table of names lives here. Merges, special
token ids and the chat template come from its `SpecialVocab`, quantisation from `gguf.quants`,
the file from `GGUFWriter`. What this module adds is what llama.cpp's converter adds per
architecture:
- the hyperparameters, one `GGUFWriter.add_*` per config field;
- for `llama`, q_proj and k_proj permuted from Hugging Face's rotary layout (two halves) to the
  one llama.cpp's LLAMA graph rotates (adjacent pairs); transformers' GGUF reader undoes the
  same permutation. Qwen2 / Qwen3 rotate halves in llama.cpp too (NeoX rope): not permuted;
- Llama 3 rope scaling as the `rope_freqs` tensor: per pair, the default inverse frequency over
  the scaled one (llama.cpp divides each pair's angle by it), from transformers' own `llama3`
  rope function;
- the token list by id (padded to the config's vocabulary with unused `[PADi]` tokens), the
  token types (special added tokens are control tokens) and the pre-tokenizer's name.
  The name is llama.cpp's converter's own when the base came from a GGUF file (SmolLM2: its
  `tokenizer.ggml.pre`); otherwise `qwen2` for Qwen2/3, and for a Llama the tokenizer's
  pre-tokenizer decides (`smollm`: single digits; `llama-bpe`: Llama 3's up-to-3-digit split;
  `gpt-2`: a plain byte-level split, GPT-2's regex).
  The built-in tiny model's character vocabulary is written in GPT-2's byte-level alphabet
  (space as `Ġ`), so llama.cpp's BPE reads and writes the same characters.

Types (`TYPES`): f32, f16, bf16, q8_0. One-dimensional tensors (norms) stay f32; under q8_0 a
matrix whose rows are not a multiple of 32 is written f16. For 4-bit files use llama.cpp's
`llama-quantize` on the f16 one. Tensors stream: their list is written first, then each is read
from the safetensors, converted and written, so memory holds one tensor, not the model. The
file is written under a temporary name and renamed when complete.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ebpo_lite.errors import UserError

PIP_COMMAND = "pip install gguf"
TYPES = ("f16", "q8_0", "bf16", "f32")
ARCHES = {"qwen3": "QWEN3", "qwen2": "QWEN2", "llama": "LLAMA"}  # model_type -> gguf.MODEL_ARCH
SUPPORTED = "Qwen3, Qwen2 and Llama (Llama 3.x, SmolLM2)"


def check_ready(base_config: dict[str, Any] | None, qtype: str):
    """Refuse, in one line and before any work, a missing `gguf`, an unknown type, or a base
    architecture this writer does not convert (`base_config`: the base's config.json); returns
    that architecture (None without a config)."""
    if qtype not in TYPES:
        raise UserError(f"--gguf-type: {qtype!r} is not one of {', '.join(TYPES)}")
    try:
        import gguf  # noqa: F401
    except ImportError:
        raise UserError(f"--gguf needs llama.cpp's gguf package: {PIP_COMMAND}") from None
    return None if base_config is None else arch_of(base_config)


def arch_of(config: dict[str, Any]):
    import gguf

    kind = config.get("model_type")
    if kind not in ARCHES:
        raise UserError(f"--gguf: model_type {kind!r} is not converted; supported: {SUPPORTED}")
    arch = getattr(gguf.MODEL_ARCH, ARCHES[kind], None)
    if arch is None:
        raise UserError(
            f"--gguf: this gguf package has no {kind} architecture: pip install -U gguf"
        )
    return arch


def write_gguf(
    model_dir: str | Path,
    out: str | Path,
    qtype: str = "f16",
    source_gguf: str | Path | None = None,
    name: str | None = None,
    log: Callable[[str], None] = print,
) -> Path:
    """Write the transformers folder `model_dir` (full weights) as the GGUF file `out`.

    `source_gguf`: the GGUF the base was converted from, if any (its pre-tokenizer name is
    reused). Returns `out`."""
    import gguf

    model_dir, out = Path(model_dir), Path(out)
    config = json.loads((model_dir / "config.json").read_text())
    arch = check_ready(config, qtype)
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        raise UserError(f"--gguf: no tokenizer.json in {model_dir}")
    tok = json.loads(path.read_text())
    tokens, types = token_list(tok, path, config["vocab_size"])
    plan = tensor_plan(model_dir, config, arch, qtype)
    tmp = out.with_name(out.name + ".partial")
    tmp.unlink(missing_ok=True)
    writer = gguf.GGUFWriter(None, gguf.MODEL_ARCH_NAMES[arch])
    try:
        writer.add_name(name or model_dir.name)
        writer.add_type(gguf.GGUFType.MODEL)
        _add_hparams(writer, config, arch, qtype)
        _add_tokenizer(writer, model_dir, pre_tokenizer_name(tok, path, config, source_gguf))
        writer.add_token_list(tokens)
        writer.add_token_types(types)
        _add_special_vocab(writer, model_dir, tokens)
        for item in plan:
            writer.add_tensor_info(item.name, item.shape, item.dtype, item.nbytes, item.raw)
        writer.write_header_to_file(path=tmp)
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        total = sum(item.nbytes for item in plan)
        log(f"gguf: writing {out.name}: {len(plan)} tensors, {total / 2**30:.2f} GiB ({qtype})")
        for item in plan:
            writer.write_tensor_data(item.data())
        writer.close()
        os.replace(tmp, out)
    except BaseException:
        writer.close()
        tmp.unlink(missing_ok=True)
        raise
    log(f"gguf: {out.name} written ({out.stat().st_size / 2**20:.1f} MiB)")
    return out


class _Tensor:
    """One tensor of the file: its GGUF name, the shape and type written, how to make it."""

    def __init__(self, name: str, shape, qtype, make: Callable[[], Any]):
        import gguf
        import numpy as np

        self.name, self.make = name, make
        q = gguf.GGMLQuantizationType
        if qtype in (q.F32, q.F16):
            self.shape, self.raw = tuple(shape), None
            self.dtype = np.float32 if qtype == q.F32 else np.float16
            self.nbytes = int(np.prod(shape)) * np.dtype(self.dtype).itemsize
        else:  # written as bytes: the writer's shape is the byte shape, raw the real type
            self.shape = gguf.quant_shape_to_byte_shape(tuple(shape), qtype)
            self.dtype, self.raw = np.uint8, qtype
            self.nbytes = int(np.prod(self.shape))
        self.qtype = qtype

    def data(self):
        import gguf
        import numpy as np

        arr = self.make()  # float32
        q = gguf.GGMLQuantizationType
        if self.qtype == q.F32:
            return arr
        if self.qtype == q.F16:
            return arr.astype(np.float16)
        return gguf.quants.quantize(arr, self.qtype)


def tensor_plan(model_dir: Path, config: dict, arch, qtype: str) -> list[_Tensor]:
    """Every tensor of the file in order, from the folder's safetensors (nothing loaded yet)."""
    import gguf
    from safetensors import safe_open

    q = gguf.GGMLQuantizationType
    want = {"f32": q.F32, "f16": q.F16, "bf16": q.BF16, "q8_0": q.Q8_0}[qtype]
    n_layers = config["num_hidden_layers"]
    names = gguf.get_tensor_name_map(arch, n_layers)
    allowed = set(gguf.MODEL_TENSORS[arch])
    n_head, n_kv = config["num_attention_heads"], config.get("num_key_value_heads")
    permute = arch == gguf.MODEL_ARCH.LLAMA
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise UserError(f"--gguf: no .safetensors weights in {model_dir}")
    plan = []
    for file in files:
        with safe_open(file, "pt") as f:
            keys = list(f.keys())
            shapes = {k: f.get_slice(k).get_shape() for k in keys}
        for key in keys:
            if key.endswith("rotary_emb.inv_freq"):
                continue
            if key == "lm_head.weight" and config.get("tie_word_embeddings"):
                continue  # llama.cpp uses token_embd as the output when there is no output
            found = names.get_type_and_name(key, try_suffixes=(".weight", ".bias"))
            if found is None or found[0] not in allowed:
                raise UserError(f"--gguf: {key} ({file.name}) has no name in llama.cpp's map")
            shape = shapes[key]
            kind = want
            if len(shape) == 1:
                kind = q.F32
            elif want == q.Q8_0 and shape[-1] % 32:
                kind = q.F16
            heads = n_head if key.endswith("q_proj.weight") else n_kv or n_head
            flip = permute and key.endswith(("q_proj.weight", "k_proj.weight"))
            plan.append(_Tensor(found[1], shape, kind, _reader(file, key, heads if flip else 0)))
    if (freqs := rope_freqs(config)) is not None:
        name = gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight"
        plan.append(_Tensor(name, freqs.shape, q.F32, lambda: freqs))
    return plan


def _reader(file: Path, key: str, permute_heads: int) -> Callable[[], Any]:
    def read():
        from safetensors import safe_open

        with safe_open(file, "pt") as f:
            w = f.get_tensor(key).float()
        if permute_heads:
            w = permute_rotary(w, permute_heads)
        return w.numpy()

    return read


def permute_rotary(w, n_head: int):
    """A q/k projection's rows from rotating halves (HF) to rotating adjacent pairs (llama.cpp's
    LLAMA): within each head, row i of the first half and row i of the second become rows 2i,
    2i+1."""
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def rope_freqs(config: dict):
    """Llama 3 rope scaling as llama.cpp's per-pair frequency divisors, or None."""
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    kind = rope.get("rope_type") or rope.get("type") or "default"
    if kind == "default":
        return None
    if kind != "llama3":
        raise UserError(f"--gguf: rope scaling {kind!r} is not converted (default and llama3 are)")
    import torch
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = AutoConfig.for_model(**config)
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](hf, "cpu")
    dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    default = 1.0 / rope_theta(config) ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    return (default / scaled.float()).numpy()


def rope_theta(config: dict) -> float:
    """The rotary base: transformers 5 keeps it in `rope_parameters`, 4.x at the top level."""
    rope = config.get("rope_parameters") or {}
    return float(rope.get("rope_theta", config.get("rope_theta", 10000.0)))


def _add_hparams(w, config: dict, arch, qtype: str) -> None:
    import gguf

    n_head = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // n_head
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    w.add_block_count(config["num_hidden_layers"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(n_head)
    w.add_head_count_kv(config.get("num_key_value_heads") or n_head)
    w.add_layer_norm_rms_eps(config["rms_norm_eps"])
    w.add_rope_freq_base(rope_theta(config))
    if head_dim != config["hidden_size"] // n_head:  # else llama.cpp derives it
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if arch == gguf.MODEL_ARCH.LLAMA:
        w.add_rope_dimension_count(head_dim)
    w.add_vocab_size(config["vocab_size"])
    ftype = gguf.LlamaFileType
    names = {"f32": "ALL_F32", "f16": "MOSTLY_F16", "bf16": "MOSTLY_BF16", "q8_0": "MOSTLY_Q8_0"}
    w.add_file_type(getattr(ftype, names[qtype]))
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)


def token_list(tok: dict, path: Path, n_vocab: int) -> tuple[list[str], list[int]]:
    """The vocabulary by id as GGUF stores it (byte-level BPE text) and each token's type, from
    `tok`, the tokenizer.json at `path`."""
    import gguf

    model = tok["model"]
    if model["type"] == "BPE" and _byte_level(tok):
        text_of = str
    elif model["type"] == "WordLevel" and all(len(t) == 1 or t[0] == "<" for t in model["vocab"]):
        text_of = _byte_level_text  # a character vocabulary (the tiny model's)
    else:
        raise UserError(
            f"--gguf: {path}: a {model['type']} tokenizer; byte-level BPE is converted "
            f"(the tokenizers of {SUPPORTED})"
        )
    by_id = {i: text_of(t) for t, i in model["vocab"].items()}
    added = {a["id"]: a for a in tok.get("added_tokens", [])}
    kind = gguf.TokenType
    tokens, types = [], []
    for i in range(n_vocab):
        if i in added:
            tokens.append(added[i]["content"])
            types.append(kind.CONTROL if added[i].get("special") else kind.USER_DEFINED)
        elif i in by_id:
            tokens.append(by_id[i])
            types.append(kind.NORMAL)
        else:
            tokens.append(f"[PAD{i}]")
            types.append(kind.UNUSED)
    return tokens, [int(t) for t in types]


def _byte_level(tok: dict) -> bool:
    parts = [tok.get("pre_tokenizer") or {}, tok.get("decoder") or {}]
    seen = []
    while parts:
        p = parts.pop()
        seen.append(p.get("type"))
        parts += p.get("pretokenizers", []) + p.get("decoders", [])
    return "ByteLevel" in seen


def _byte_level_text(text: str) -> str:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    table = bytes_to_unicode()
    return "".join(table[b] for b in text.encode("utf-8"))


def pre_tokenizer_name(tok: dict, path: Path, config: dict, source_gguf=None) -> str:
    """llama.cpp's name of the pre-tokenizer of `tok` (the tokenizer.json at `path`; module
    docstring)."""
    if source_gguf is not None and Path(source_gguf).is_file():
        import gguf

        field = gguf.GGUFReader(source_gguf).fields.get("tokenizer.ggml.pre")
        if field is not None:
            return bytes(field.parts[field.data[0]]).decode()
    if tok["model"]["type"] == "WordLevel":
        return "default"
    if config.get("model_type") in ("qwen2", "qwen3"):
        return "qwen2"
    text = json.dumps(tok.get("pre_tokenizer"))
    if '"Digits"' in text and '"individual_digits": true' in text:
        return "smollm"
    if "\\\\p{N}{1,3}" in text:
        return "llama-bpe"
    pre = tok.get("pre_tokenizer") or {}
    if pre.get("type") == "ByteLevel" and pre.get("use_regex", True):
        return "gpt-2"  # ByteLevel alone splits with GPT-2's regex, as llama.cpp's gpt-2 does
    raise UserError(
        f"--gguf: {path}: a pre-tokenizer llama.cpp's names are not "
        f"known for here; converted: the tokenizers of {SUPPORTED}"
    )


def inert_merge(tokens: list[str]) -> str:
    """A merge that never applies, for a vocabulary without merges: its first part is longer
    than one character, which BPE (starting from single characters, merging nothing else)
    never forms, and the join is a token (transformers' reader refuses any other merge);
    else the first two tokens."""
    have = set(tokens)
    for t in tokens:
        for n in range(2, len(t)):
            if t[:n] in have and t[n:] in have:
                return f"{t[:n]} {t[n:]}"
    return f"{tokens[0]} {tokens[1]}"


def _add_tokenizer(w, model_dir: Path, pre: str) -> None:
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)


def _add_special_vocab(w, model_dir: Path, tokens: list[str]) -> None:
    """Merges, special token ids, add-bos/eos and the chat template (gguf's `SpecialVocab`)."""
    import gguf

    special = gguf.SpecialVocab(model_dir, load_merges=True, n_vocab=len(tokens))
    if not special.merges:  # a character vocabulary: llama.cpp requires the key, gguf refuses []
        w.add_token_merges([inert_merge(tokens)])
        special.load_merges = False
    special.add_to_gguf(w, quiet=True)
    w.add_add_space_prefix(False)
    if "bos" not in special.add_special_token:
        w.add_add_bos_token(False)
