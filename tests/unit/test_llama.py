"""The Llama family (zerompi/models/llama.py) against transformers.LlamaForCausalLM on the
same weights, its document mask, presets and config.json in both directions.

Tolerance of the logits: max |ours - transformers| <= 1e-5 x max |logits|, in fp32 on
the CPU. Both compute the same operations in the same order except the attention
(ours: torch's scaled_dot_product_attention with grouped kv heads; transformers' eager
path: repeat_kv, matmul, softmax, matmul), whose different summation order costs fp32
rounding (docs/models.md gives the measured size); 1e-5 leaves a wide margin over that while
every real mistake (RoPE's half-rotation or frequencies, kv heads mapped to the wrong
query heads, RMSNorm's eps or dtype, SwiGLU's gate and up swapped) moves the logits by
percent. Weights are drawn wider than transformers' init (std 0.2) so the logits are
O(1) and a small relative error is a real one."""
import dataclasses

import pytest
import torch

from zerompi.models import hf_names
from zerompi.models.llama import Llama, document_mask, rope_inv_freq
from zerompi.models.llama_config import PRESETS, LlamaConfig, count_params, from_hf, to_hf

tf = pytest.importorskip("transformers")
REL = 1e-5
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}


def hf_pair(kv: int, tie: bool = False, rope=None, bias: bool = False):
    hc = tf.LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=kv, tie_word_embeddings=tie,
                        max_position_embeddings=32, attn_implementation="eager", rms_norm_eps=1e-5,
                        attention_bias=bias, mlp_bias=bias, **({"rope_parameters": rope} if rope else {}))
    torch.manual_seed(0)
    ref = tf.LlamaForCausalLM(hc).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0.0, 0.2) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    ours = Llama(from_hf(hc.to_dict())).eval()
    sd = {hf_names.our_name("llama", k): v for k, v in ref.state_dict().items()}
    ours.load_state_dict(sd, strict=True)
    return ours, ref


@pytest.mark.parametrize("kv,tie,rope,bias", [(4, False, None, False), (2, False, None, False),
                                              (1, True, LLAMA3_ROPE, True)],
                         ids=["mha", "gqa", "mqa-tied-llama3rope-bias"])
def test_logits_match_transformers(kv, tie, rope, bias):
    ours, ref = hf_pair(kv, tie, rope, bias)
    assert ours.config.n_kv_head == kv and (ours.lm_head.weight is ours.embed_tokens.weight) == tie
    x = torch.randint(0, 97, (3, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got, want = ours(x), ref(input_ids=x).logits
    scale = want.abs().max()
    assert scale > 1.0  # O(1) logits: the relative bound means something
    assert (got - want).abs().max() <= REL * scale, float((got - want).abs().max() / scale)
    # loss with targets: transformers' own (it shifts the labels itself)
    _, loss = ours(x[:, :-1], x[:, 1:])
    with torch.no_grad():
        want_loss = ref(input_ids=x, labels=x).loss
    assert abs(loss.item() - want_loss.item()) <= REL * want_loss.item()


def test_llama3_rope_frequencies_are_transformers():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hc = tf.LlamaConfig(hidden_size=64, num_attention_heads=4, rope_parameters=LLAMA3_ROPE)
    want, _ = ROPE_INIT_FUNCTIONS["llama3"](hc, "cpu")
    assert torch.equal(rope_inv_freq(from_hf(hc.to_dict())), want)


def test_document_mask_attends_within_documents_only():
    """doc_ids: each document's logits are those of the document run alone (RoPE is
    relative, so the second document's absolute offset does not matter)."""
    ours, _ = hf_pair(2)
    x = torch.randint(0, 97, (2, 24), generator=torch.Generator().manual_seed(2))
    doc = torch.tensor([[0] * 10 + [1] * 14, [5] * 24])
    with torch.no_grad():
        both = ours(x, doc_ids=doc)
        first, second = ours(x[:1, :10]), ours(x[:1, 10:])
        whole = ours(x[1:])
    tol = REL * first.abs().max()
    assert (both[0, :10] - first[0]).abs().max() <= tol
    assert (both[0, 10:] - second[0]).abs().max() <= 10 * tol  # absolute positions 10.. vs 0..
    assert (both[1] - whole[0]).abs().max() <= tol  # one document: the causal model
    assert (both[0, 10:] - ours(x[:1])[0, 10:]).abs().max() > 1e-3  # the mask does cut
    m = document_mask(doc)
    assert m.shape == (2, 1, 24, 24) and not m[0, 0, 12, 5] and m[0, 0, 12, 11] and not m[0, 0, 3, 4]


def test_presets_counts_and_config_round_trip():
    assert count_params(PRESETS["llama3-8b"]) == 8_030_261_248
    assert count_params(PRESETS["llama2-7b"]) == 6_738_415_616
    assert count_params(PRESETS["llama3.2-1b"]) == 1_235_814_400
    tiny = PRESETS["tiny"]
    assert Llama(tiny).num_params() == count_params(tiny)
    for cfg in (tiny, PRESETS["llama3.1-8b"], dataclasses.replace(tiny, tie_word_embeddings=True)):
        d = to_hf(cfg)
        assert from_hf(d) == cfg
        assert from_hf(tf.LlamaConfig(**d).to_dict()) == cfg  # transformers reads it the same
    with pytest.raises(ValueError, match="n_kv_head"):
        LlamaConfig(vocab_size=8, block_size=8, n_layer=1, n_head=4, n_kv_head=3, n_embd=16,
                    intermediate_size=8)
    assert tiny.tp_problem(4) == "must divide the model's n_kv_head (2)"
    assert tiny.tp_problem(2) is None
    with pytest.raises(ValueError, match="config.json: model_type 'bert'"):
        hf_names.config_from_hf({"model_type": "bert"})


def test_tp_that_does_not_divide_kv_heads_is_refused_naming_the_key():
    from zerompi.config.errors import ConfigError
    from zerompi.parallel.parallelize import check_tp

    with pytest.raises(ConfigError, match=r"tensor_parallel_size.*n_kv_head \(2\)"):
        check_tp(PRESETS["tiny"], 4)
