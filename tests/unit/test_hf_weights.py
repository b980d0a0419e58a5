"""HF safetensors in, one tensor at a time (models/hf_weights.py through
engine.load_full_state_dict), in this process at N = 1: every tensor the source hands
out is dropped before the next one is read, the engine ends with the file's weights,
and what cannot be read is said naming the directory."""
import weakref

import pytest
import torch

import zerompi
from zerompi.models.hf_weights import HFCheckpoint, load_hf
from zerompi.models.llama import Llama
from zerompi.models.llama_config import from_hf

tf = pytest.importorskip("transformers")


class Watched(HFCheckpoint):
    """Counts reads and how many tensors it handed out are still alive at each read."""

    def __init__(self, *a):
        super().__init__(*a)
        self.alive_at_read, self.reads, self._refs = [], 0, []

    def __getitem__(self, name):
        self.alive_at_read.append(sum(r() is not None for r in self._refs))  # freed by refcount, no gc needed
        t = super().__getitem__(name)
        self.reads += 1
        self._refs.append(weakref.ref(t))
        return t


@pytest.mark.parametrize("stage", [1, 3])
def test_streams_one_tensor_at_a_time(tmp_path, stage):
    hc = tf.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(3)
    ref = tf.LlamaForCausalLM(hc)
    ref.save_pretrained(tmp_path, max_shard_size="20KB")
    torch.manual_seed(4)
    engine = zerompi.initialize(Llama(from_hf(hc.to_dict())), {"stage": stage})
    src = Watched(str(tmp_path), "llama")
    engine.load_full_state_dict(src)
    assert src.reads == len(src) == len(list(ref.parameters()))  # each tensor read once
    assert max(src.alive_at_read) == 0  # nothing read before is still held
    full = engine.full_state_dict()
    want = {k.removeprefix("model."): v for k, v in ref.state_dict().items()}
    assert all(torch.equal(full[k], want[k]) for k in full), [k for k in full if not torch.equal(full[k], want[k])]


def test_unreadable_checkpoints_are_named(tmp_path):
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="pytorch_model.bin is pickled torch.*safetensors"):
        HFCheckpoint(str(tmp_path), "llama")
    engine = zerompi.initialize(Llama(from_hf(tf.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4).to_dict())),
        {"stage": 2})
    with pytest.raises(ValueError, match=f"init_from {tmp_path / 'none'}: FileNotFoundError"):
        load_hf(engine, str(tmp_path / "none"), "llama")
