"""Hugging Face <-> zerompi for the two families, without torch: config.json in both
directions and parameter names in both directions.

    family, shape = config_from_hf(json.load(open("config.json")))   # "llama" | "gpt"
    hf_name("gpt", "h.0.attn.c_attn.weight") == "transformer.h.0.attn.c_attn.weight"
    transposed("gpt", "h.0.attn.c_attn.weight")  # GPT2's Conv1D stores (in, out)

Llama: ours are LlamaForCausalLM's names without "model." (lm_head.weight as it is).
GPT: GPT2LMHeadModel's names without "transformer."; GPT2's Conv1D weights (c_attn,
c_proj, c_fc) are the transpose of our nn.Linear weights. zerompi's GPT uses exact GELU
(HF activation_function "gelu"); GPT-2 checkpoints use "gelu_new" (tanh approximation):
such a checkpoint loads, with a note that the logits differ slightly from transformers'.
"""
from __future__ import annotations

import re

from . import llama_config
from .gpt_config import GPTConfig
from .llama_config import LlamaConfig

FAMILIES = ("gpt", "llama")
MODEL_TYPES = {"llama": "llama", "gpt2": "gpt"}
# HF tensors that are not parameters of ours (old checkpoints' buffers): skipped on load
_IGNORED = re.compile(r"(^|\.)(attn\.bias|attn\.masked_bias|rotary_emb\.inv_freq)$")
_CONV1D = re.compile(r"^h\.\d+\.(attn\.c_attn|attn\.c_proj|mlp\.c_fc|mlp\.c_proj)\.weight$")


def family_of(shape) -> str:
    return "llama" if isinstance(shape, LlamaConfig) else "gpt"


def config_from_hf(d: dict, where: str = "config.json"):
    """(family, GPTConfig | LlamaConfig) from a config.json dict; ValueError naming
    `where` for a model type or setting zerompi cannot reproduce."""
    kind = d.get("model_type")
    family = MODEL_TYPES.get(kind)
    if family is None:
        raise ValueError(f"{where}: model_type {kind!r} is not supported "
                         f"(supported: {', '.join(MODEL_TYPES)})")
    try:
        return family, (llama_config.from_hf(d) if family == "llama" else _gpt_from_hf(d))
    except (KeyError, ValueError) as e:
        raise ValueError(f"{where}: {e if not isinstance(e, KeyError) else f'missing {e}'}") from None


def _gpt_from_hf(d: dict) -> GPTConfig:
    c = d["n_embd"]
    if d.get("n_inner") not in (None, 4 * c):
        raise ValueError(f"n_inner {d['n_inner']}: zerompi's GPT has an MLP of 4 x n_embd")
    if d.get("layer_norm_epsilon", 1e-5) != 1e-5:
        raise ValueError(f"layer_norm_epsilon {d['layer_norm_epsilon']}: zerompi's GPT uses 1e-5")
    for k in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"):
        if d.get(k):
            raise ValueError(f"{k} = true is not supported by zerompi's GPT")
    if d.get("scale_attn_weights", True) is not True:
        raise ValueError("scale_attn_weights = false is not supported by zerompi's GPT")
    if d.get("tie_word_embeddings", True) is not True:
        raise ValueError("tie_word_embeddings = false: zerompi's GPT ties its head")
    drop = max(float(d.get(k, 0.0) or 0.0) for k in ("resid_pdrop", "embd_pdrop", "attn_pdrop"))
    return GPTConfig(vocab_size=d["vocab_size"], block_size=d.get("n_positions", d.get("n_ctx", 1024)),
                     n_layer=d["n_layer"], n_head=d["n_head"], n_embd=c, dropout=drop, bias=True)


def gpt_activation_note(d: dict) -> str | None:
    act = d.get("activation_function", "gelu_new")
    if act == "gelu":
        return None
    return (f"activation_function {act!r}: zerompi's GPT uses exact GELU, so its logits differ "
            "slightly from transformers' on these weights (training from them is unaffected otherwise)")


def config_to_hf(shape, extra: dict | None = None) -> dict:
    """config.json for LlamaForCausalLM or GPT2LMHeadModel of this shape."""
    if isinstance(shape, LlamaConfig):
        return llama_config.to_hf(shape, extra)
    if not shape.bias:
        raise ValueError("a GPT without biases (model.bias = false) has no GPT2LMHeadModel equivalent")
    d = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": shape.vocab_size,
         "n_positions": shape.block_size, "n_ctx": shape.block_size, "n_embd": shape.n_embd,
         "n_layer": shape.n_layer, "n_head": shape.n_head, "n_inner": None,
         "activation_function": "gelu",  # exact GELU, as models/gpt.py computes
         "layer_norm_epsilon": 1e-5, "resid_pdrop": shape.dropout, "embd_pdrop": shape.dropout,
         "attn_pdrop": shape.dropout, "scale_attn_weights": True, "tie_word_embeddings": True,
         "torch_dtype": "float32"}
    d.update(extra or {})
    return d


def hf_name(family: str, ours: str) -> str:
    if ours == "lm_head.weight":
        return ours
    return ("model." if family == "llama" else "transformer.") + ours


def our_name(family: str, hf: str) -> str | None:
    """Our parameter name for a HF tensor name; None for a tensor we skip (an old
    checkpoint's attention-mask or RoPE buffer)."""
    if _IGNORED.search(hf):
        return None
    if hf == "lm_head.weight":
        return hf
    for prefix in (("model.",) if family == "llama" else ("transformer.",)):
        if hf.startswith(prefix):
            return hf[len(prefix):]
    return hf  # unprefixed (a bare LlamaModel/GPT2Model checkpoint): same name


def transposed(family: str, ours: str) -> bool:
    """Whether the HF tensor is the transpose of ours (GPT2's Conv1D weights)."""
    return family == "gpt" and bool(_CONV1D.match(ours))
