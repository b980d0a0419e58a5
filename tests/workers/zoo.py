"""Models users bring (issue 13 "Must show"), small enough for 2-core CI.

Same interface as common.py's models: `forward(idx, targets=None)` returns logits, or
(logits, fp32 cross-entropy) with targets; vocab 37; an `emb` attribute (the input
embedding) so common.vocab_of() works. Dropout is off everywhere, so a model is a
deterministic function of the seed. Each model stresses one pattern that stage 3 and
zerompi.Init must survive:

  tenc       nn.TransformerEncoder: MultiheadAttention reads out_proj.weight without
             calling out_proj; xavier_uniform_ imported by name; Embedding(padding_idx)
  flinear    a parent calling F.linear on its child's weight, never the child; a head
             computed from the embedding's weight (tied by use, not by module);
             flinear-late reads the child only from the second forward on
  branch     a sub-module run only for rows whose data sets a flag, and a layer skipped
             when none of a rank's rows need it: ranks run different modules
  moe1/moe2  4 experts, top-1/top-2 routing; an expert that gets no token is not run,
             so ranks run different experts (one expert is made rare on purpose)
  hf-*       transformers BERT, T5, GPT-2, Llama, Mixtral from small configs (eager
             attention, dropout 0), built through their own post_init/_init_weights

The data-dependent choices are made per row or per token, never from batch-wide
statistics: then the whole global batch on one process computes exactly the function
N ranks compute on their slices, so parity with single-process AdamW is meaningful.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, DIM = 37, 32
KINDS = ("tenc", "flinear", "branch", "moe1", "moe2",
         "hf-bert", "hf-t5", "hf-gpt2", "hf-llama", "hf-mixtral")
# Built by build()/make_zoo() but not part of the parity zoo: changes behaviour between calls.
LATE_KINDS = ("flinear-late",)


def _lm_out(logits: torch.Tensor, targets):
    logits = logits.float()
    if targets is None:
        return logits
    return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))


class TEnc(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM, padding_idx=0)  # zeroes row 0 in place
        layer = nn.TransformerEncoderLayer(DIM, nhead=2, dim_feedforward=48, dropout=0.0,
                                           batch_first=True)
        self.enc = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, idx, targets=None):
        t = idx.size(1)
        causal = torch.triu(torch.full((t, t), float("-inf")), diagonal=1)
        return _lm_out(self.head(self.enc(self.emb(idx), mask=causal)), targets)


class _FBlock(nn.Module):
    """Uses `child`'s parameters through F.linear; `child` itself never runs. With
    `late`, the first forward leaves `child` out and only later ones read its weight (a
    read that first appears after step 1, of parameters no step has gathered yet)."""

    def __init__(self, late: bool = False):
        super().__init__()
        self.child = nn.Linear(DIM, DIM)
        self.norm = nn.LayerNorm(DIM)
        self.calls = 0 if late else 1

    def forward(self, x):
        self.calls += 1
        if self.calls == 1:
            return x + torch.tanh(self.norm(x))
        return x + torch.tanh(F.linear(self.norm(x), self.child.weight, self.child.bias))


class FLinear(nn.Module):
    def __init__(self, late: bool = False):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(_FBlock(late) for _ in range(2))
        self.scale = nn.Parameter(torch.ones(DIM))

    def forward(self, idx, targets=None):
        h = self.emb(idx)
        for b in self.blocks:
            h = b(h)
        return _lm_out(F.linear(h * self.scale, self.emb.weight), targets)  # tied head by use


class Branch(nn.Module):
    """`extra` runs only on rows whose mean token id exceeds the vocabulary's middle;
    `rare` only on rows starting with a token id divisible by 5. A rank none of whose
    rows qualify skips the module: with 1-2 rows per rank, ranks differ within a step
    and a module runs on some steps and not others."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.base = nn.Sequential(nn.Linear(DIM, DIM), nn.GELU())
        self.extra = nn.Sequential(nn.Linear(DIM, 48), nn.GELU(), nn.Linear(48, DIM))
        self.rare = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, idx, targets=None):
        h = self.emb(idx)
        h = h + self.base(h)
        flag = idx.float().mean(1) > (VOCAB - 1) / 2
        if flag.any():
            h = h + self.extra(h) * flag[:, None, None]
        skip = idx[:, 0] % 5 != 0
        if not skip.all():
            h = h + self.rare(h) * (~skip)[:, None, None]
        return _lm_out(self.head(h), targets)


class MoE(nn.Module):
    """Token-level top-k routing over 4 MLP experts. Experts without tokens on this rank
    are not called at all (the pattern real MoE code has)."""

    def __init__(self, k: int):
        super().__init__()
        self.k = k
        self.router = nn.Linear(DIM, 4)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(DIM, 48), nn.GELU(), nn.Linear(48, DIM))
                                     for _ in range(4))
        with torch.no_grad():
            self.router.bias[3].sub_(1.5)  # expert 3 rare: some rank sends it no token

    def forward(self, x):
        flat = x.reshape(-1, x.size(-1))
        probs = F.softmax(self.router(flat), dim=-1)
        w, sel = probs.topk(self.k, dim=-1)
        if self.k > 1:  # top-1 keeps the raw probability, or the router would get no gradient
            w = w / w.sum(-1, keepdim=True)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            tok, slot = torch.where(sel == e)
            if tok.numel() == 0:
                continue
            out = out.index_add(0, tok, expert(flat[tok]) * w[tok, slot, None])
        return out.view_as(x)


class MoENet(nn.Module):
    def __init__(self, k: int):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.norms = nn.ModuleList(nn.LayerNorm(DIM) for _ in range(2))
        self.moes = nn.ModuleList(MoE(k) for _ in range(2))
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, idx, targets=None):
        h = self.emb(idx)
        for norm, moe in zip(self.norms, self.moes):
            h = h + moe(norm(h))
        return _lm_out(self.head(h), targets)


def _hf_config(kind: str):
    import transformers as tf

    common = dict(vocab_size=VOCAB, attn_implementation="eager")
    if kind == "hf-bert":
        return tf.BertConfig(hidden_size=DIM, num_hidden_layers=2, num_attention_heads=2,
                             intermediate_size=48, max_position_embeddings=32, type_vocab_size=1,
                             hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                             pad_token_id=0, **common)
    if kind == "hf-t5":
        return tf.T5Config(d_model=DIM, d_kv=8, d_ff=48, num_layers=2, num_heads=4,
                           relative_attention_num_buckets=8, dropout_rate=0.0,
                           decoder_start_token_id=0, pad_token_id=0, eos_token_id=1, **common)
    if kind == "hf-gpt2":
        return tf.GPT2Config(n_positions=32, n_embd=DIM, n_layer=2, n_head=2, resid_pdrop=0.0,
                             embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
                             **common)
    if kind == "hf-llama":
        return tf.LlamaConfig(hidden_size=DIM, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2,
                              max_position_embeddings=32, bos_token_id=0, eos_token_id=0,
                              pad_token_id=None, **common)
    if kind == "hf-mixtral":
        return tf.MixtralConfig(hidden_size=DIM, intermediate_size=24, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                num_experts_per_tok=2, output_router_logits=False,
                                router_aux_loss_coef=0.0, max_position_embeddings=32,
                                bos_token_id=0, eos_token_id=0, **common)
    raise ValueError(f"unknown zoo model {kind!r}; known: {', '.join(KINDS)}")


class HFZoo(nn.Module):
    """A transformers model behind the (idx, targets) call. T5 is fed `idx` to the
    encoder and `idx` shifted right (start token 0) to the decoder."""

    def __init__(self, kind: str):
        super().__init__()
        import transformers as tf

        cfg = _hf_config(kind)
        cls = {"hf-bert": tf.BertForMaskedLM, "hf-t5": tf.T5ForConditionalGeneration,
               "hf-gpt2": tf.GPT2LMHeadModel, "hf-llama": tf.LlamaForCausalLM,
               "hf-mixtral": tf.MixtralForCausalLM}[kind]
        self.kind = kind
        self.lm = cls(cfg)
        self.emb = self.lm.get_input_embeddings()  # common.vocab_of() looks here

    def forward(self, idx, targets=None):
        if self.kind == "hf-t5":
            dec = torch.cat([torch.zeros_like(idx[:, :1]), idx[:, :-1]], dim=1)
            logits = self.lm(input_ids=idx, decoder_input_ids=dec).logits
        else:
            logits = self.lm(input_ids=idx).logits
        return _lm_out(logits, targets)


def build(kind: str) -> nn.Module:
    """Construct `kind` with whatever torch RNG state is current (for Init tests that
    seed once themselves)."""
    if kind == "tenc":
        return TEnc()
    if kind in ("flinear", "flinear-late"):
        return FLinear(late=kind == "flinear-late")
    if kind == "branch":
        return Branch()
    if kind in ("moe1", "moe2"):
        return MoENet(int(kind[-1]))
    if kind.startswith("hf-"):
        return HFZoo(kind)
    raise ValueError(f"unknown zoo model {kind!r}; known: {', '.join(KINDS)}")


def make_zoo(kind: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return build(kind)
