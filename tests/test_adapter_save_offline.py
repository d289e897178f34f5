"""Per-step adapter saves make no network call, and an Unsloth-loaded base is named as loaded.

peft's `save_pretrained` (0.17-0.21, `get_peft_model_state_dict` with the default
`save_embedding_layers="auto"`) asks the hub whether `base_model_name_or_path` has a config.json
on every save, unless HF_HUB_OFFLINE is set. This machine has no network, so the network is
replaced by a guard that records and refuses every connection (a BaseException: peft's
`except Exception` around the lookup would swallow an ordinary error). The base is a random tiny
Qwen3 whose `name_or_path` is a hub id, as transformers records it after a hub load.

Unsloth needs a CUDA GPU and cannot be installed here: its `FastLanguageModel` is faked with what
its source does (unsloth 2026.10.9: `from_pretrained` loads the repository `get_model_name` maps
the id to, `get_peft_model` wraps it with peft; unsloth_zoo `save_lora` is `save_pretrained` of
the LoRA tensors, forwarding its keyword arguments). Everything else is the real code.
"""

from __future__ import annotations

import json
import socket
from types import SimpleNamespace

import huggingface_hub.constants
import peft  # noqa: F401  (imported before the guard: bitsandbytes asks the hub at import)
import pytest
import torch

from ebpo_lite import config
from ebpo_lite.algo.curriculum import ShuffleSampler
from ebpo_lite.engine import checkpoint
from ebpo_lite.errors import UserError
from ebpo_lite.model.policy import Policy, _add_lora
from ebpo_lite.model.tiny import save_random_qwen3
from ebpo_lite.rollout import unsloth

HUB_ID = "Qwen/Qwen3-8B"
# unsloth/models/mapper.py (2026.10.9): "unsloth/Qwen3-8B-unsloth-bnb-4bit": {"16": ("unsloth/
# Qwen3-8B", "Qwen/Qwen3-8B", ...)}, so FLOAT_TO_INT_MAPPER maps the hub id to that key in 4-bit
UNSLOTH_4BIT = {"qwen/qwen3-8b": "unsloth/Qwen3-8B-unsloth-bnb-4bit"}


class NetworkCall(BaseException):
    """A connection attempt; a BaseException, so that no `except Exception` can hide it."""


@pytest.fixture
def no_network(monkeypatch):
    """Online as far as every library can tell (no *_OFFLINE flag), with every connection
    recorded and refused: the list of attempts."""
    calls: list = []

    def refuse(*args, **kwargs):
        calls.append(args[:2])
        raise NetworkCall(f"a network call: {args[:2]}")

    for flag in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(flag, raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    monkeypatch.setattr(socket.socket, "connect", refuse)
    return calls


def _base(tmp_path, name: str = HUB_ID):
    """A random tiny Qwen3 that believes it was loaded from hub id `name`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = save_random_qwen3(tmp_path / "base")
    model = AutoModelForCausalLM.from_pretrained(folder)
    model.name_or_path = model.config._name_or_path = name  # what a hub load records
    return model, AutoTokenizer.from_pretrained(folder)


def test_the_guard_catches_what_peft_does_by_default(tmp_path, no_network):
    """The check can fail: peft's own default save asks the hub (and swallows the refusal's
    ordinary errors, hence the BaseException)."""
    model, _ = _base(tmp_path)
    model = _add_lora(model, config.load(None, []).model)
    with pytest.raises(NetworkCall):
        model.save_pretrained(tmp_path / "default")
    assert no_network  # the attempt was made and recorded


def test_policy_adapter_exports_make_no_network_call(tmp_path, no_network):
    """The samplers' copy (vLLM sync) and the checkpoint's (with trained norms) both."""
    model, tok = _base(tmp_path)
    m = config.load(None, ["model.trainable_extra=[norm]"]).model
    policy = Policy(_add_lora(model, m), tok, torch.device("cpu"), HUB_ID, 16, ["norm"],
                    torch.float32)  # fmt: skip
    out = policy.export_adapter(tmp_path / "sync")
    assert (out / "adapter_model.safetensors").is_file()
    assert json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"] == (
        HUB_ID
    )
    params = policy.trainable_parameters()
    opt = torch.optim.AdamW(params, lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    ckpt = checkpoint.save(tmp_path / "run", 3, policy, opt, sched, None, ShuffleSampler(8, 0))
    assert (ckpt / "adapter_model.safetensors").is_file() and (ckpt / "trainer_state.pt").is_file()
    assert no_network == []


class FakeFastLanguageModel:
    """Unsloth's loader as its source behaves (module docstring), on the local tiny model."""

    folder = None

    @classmethod
    def from_pretrained(cls, model_name, load_in_4bit=True, **kwargs):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        repo = UNSLOTH_4BIT.get(model_name.lower(), model_name) if load_in_4bit else model_name
        model = AutoModelForCausalLM.from_pretrained(cls.folder)
        model.name_or_path = model.config._name_or_path = repo  # transformers: the id it loaded
        return model, AutoTokenizer.from_pretrained(cls.folder)

    @staticmethod
    def get_peft_model(model, r, lora_alpha, lora_dropout, target_modules, bias, **kwargs):
        from peft import LoraConfig, get_peft_model

        lcfg = LoraConfig(r=r, lora_alpha=lora_alpha, lora_dropout=lora_dropout,
                          target_modules=target_modules, bias=bias)  # fmt: skip
        model = get_peft_model(model, lcfg)

        def save_lora(save_directory, *args, **kw):  # unsloth_zoo vllm_utils.save_lora
            lora = {
                k: v for k, v in model.state_dict().items() if ".lora_A." in k or ".lora_B." in k
            }
            model.save_pretrained(save_directory, *args, state_dict=lora, **kw)

        model.save_lora = save_lora
        model.load_lora = lambda folder: SimpleNamespace(lora_int_id=len(str(folder)),
                                                         lora_path=str(folder))  # fmt: skip
        return model


def _unsloth_cfg(*extra: str):
    return config.load(None, [f"model.name={HUB_ID}", "model.device=cpu", "model.dtype=float32",
                              "rollout.backend=unsloth", *extra])  # fmt: skip


def test_unsloth_policy_names_the_base_it_really_loaded(tmp_path, monkeypatch, no_network):
    FakeFastLanguageModel.folder = save_random_qwen3(tmp_path / "base")
    monkeypatch.setattr(unsloth, "_import_unsloth", lambda: (FakeFastLanguageModel, None))
    lines: list[str] = []
    policy = unsloth.load_unsloth_policy(_unsloth_cfg("model.load_in_4bit=true"), lines.append)
    loaded = UNSLOTH_4BIT[HUB_ID.lower()]
    assert policy.base_path == loaded
    assert f"Unsloth loaded {loaded}" in lines[-1]
    out = policy.export_adapter(tmp_path / "ckpt", with_extra=True)  # the checkpoint's copy
    assert json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"] == (
        loaded
    )
    sampler = object.__new__(unsloth.UnslothRollout)  # its __init__ needs a GPU; sync does not
    sampler.workdir, sampler.lora_request, sampler.used_ids = tmp_path / "shm", None, []
    sampler.sync(policy, 1)
    assert (tmp_path / "shm" / "adapter-v1-0" / "adapter_model.safetensors").is_file()
    assert no_network == []  # neither the checkpoint's save nor Unsloth's save_lora asked

    policy = unsloth.load_unsloth_policy(_unsloth_cfg("model.load_in_4bit=false"), lines.append)
    assert policy.base_path == HUB_ID and "Unsloth loaded" not in lines[-1]  # not in this table


# unsloth_zoo/vllm_utils.py `load_vllm` (2026.10.9), verbatim
NO_BNB_PLUGIN = (
    "Unsloth: vLLM >= 0.28 moved bitsandbytes out of tree. Install it with `pip install "
    "vllm-bnb-plugin` to use load_in_4bit with fast_inference."
)


def _load_error(monkeypatch, error: BaseException, *overrides: str) -> str:
    """The UserError message of an Unsloth load whose from_pretrained raises `error`."""

    class Refusing(FakeFastLanguageModel):
        @classmethod
        def from_pretrained(cls, model_name, **kwargs):
            raise error

    monkeypatch.setattr(unsloth, "_import_unsloth", lambda: (Refusing, None))
    with pytest.raises(UserError) as e:
        unsloth.load_unsloth_policy(_unsloth_cfg(*overrides))
    return str(e.value)


@pytest.mark.parametrize(
    "error",
    [
        RuntimeError(NO_BNB_PLUGIN),
        ValueError("Unknown quantization method: bitsandbytes. Must be one of ['awq', 'fp8'].\n.."),
        ModuleNotFoundError(
            "No module named 'vllm.model_executor.layers.quantization.bitsandbytes'"
        ),
    ],
)
def test_unsloth_4bit_without_vllm_bitsandbytes_is_one_line_with_the_fix(monkeypatch, error):
    msg = _load_error(monkeypatch, error, "model.load_in_4bit=true")
    assert "\n" not in msg and msg.startswith("model.load_in_4bit: Unsloth's fast_inference")
    assert "pip install -U vllm-bnb-plugin" in msg and "model.load_in_4bit=false" in msg


@pytest.mark.parametrize(
    "error",
    [
        OSError("Qwen/Qwen3-8B is not a local folder\nand is not a valid model identifier"),
        torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\n(GPU 0 ...)"),
        NotImplementedError("Unsloth: qwen9 is not yet implemented!"),
    ],
)
def test_other_unsloth_load_errors_are_one_line_naming_the_model(monkeypatch, error):
    first = str(error).splitlines()[0]
    assert _load_error(monkeypatch, error) == (
        f"model.name: Unsloth cannot load {HUB_ID!r} ({type(error).__name__}: {first})"
    )
