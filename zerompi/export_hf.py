"""`python -m zerompi.export CKPT --hf DIR`: a trainer checkpoint as a Hugging Face model
directory that `AutoModelForCausalLM.from_pretrained(DIR)` loads strictly.

DIR receives config.json (LlamaForCausalLM or GPT2LMHeadModel, from the architecture
record the trainer saves in every checkpoint: models/arch.py), model.safetensors (or
model-0000K-of-0000N.safetensors shards of at most --max-shard-size each plus
model.safetensors.index.json, transformers' layout), generation_config.json, and the
tokenizer's files when the run named one (TrainConfig `tokenizer`, or --tokenizer):
a directory's tokenizer files are copied; a lone tokenizer.json is copied with a
tokenizer_config.json that names PreTrainedTokenizerFast. Without a tokenizer the
export says so and writes none.

Names and layouts: models/hf_names.py (GPT2's Conv1D weights are written transposed; a
tied head is written once, as transformers' tie_word_embeddings expects). Tensors are
streamed one at a time from the rank files, as export.py does (memory: one tensor).
"""
from __future__ import annotations

import json
import os
import shutil
import struct

import numpy as np

from .checkpoint import verify as ver
from .checkpoint.directory import resolve
from .checkpoint.errors import CheckpointError
from .checkpoint.reader import PieceReader
from .models import arch, hf_names
from .runtime.fileio import atomic_file, atomic_write

_ITEMSIZE = {"F32": 4, "BF16": 2}


def _numel(shape) -> int:
    return int(np.prod(shape)) if shape else 1


def _tensor_bytes(reader: PieceReader, m: dict, item: dict) -> np.ndarray:
    """One parameter's values in its output dtype (fp32, or bf16 as int16 bits), the way
    export.py reads them (not imported: export.py's --hf imports this module)."""
    vals = reader.read("param", item["name"], 0, _numel(item["shape"]))
    if item["st"] == "BF16":
        import torch

        return torch.from_numpy(np.ascontiguousarray(vals, dtype=np.float32)).to(torch.bfloat16) \
            .view(torch.int16).numpy()
    return vals.astype(np.float32, copy=False)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "tokenizer.model", "added_tokens.json", "chat_template.jinja")


def parse_size(text: str) -> int:
    """'5GB', '500MB', '64KiB', '1000' -> bytes."""
    t = str(text).strip().upper().replace("IB", "B")
    for unit, mult in (("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10), ("B", 1)):
        if t.endswith(unit):
            return int(float(t[:-len(unit)]) * mult)
    return int(t)


def hf_plan(m: dict, dtype: str) -> tuple[str, object, list[dict]]:
    """(family, shape, tensors in HF names) of a checkpoint's manifest."""
    rec = (m.get("client_state") or {}).get("model")
    if not rec:
        raise CheckpointError("this checkpoint has no model record (not saved by python -m zerompi.train): "
                              "--hf needs the architecture to write config.json")
    shape = arch.shape_of(rec)
    family = arch.family(shape)
    st = "BF16" if dtype == "bf16" else "F32"
    items = []
    for name, t in m["tensors"].items():  # one per parameter: a tied head is an alias, left out
        shp = list(t["shape"])
        tr = hf_names.transposed(family, name)
        items.append({"name": name, "hf": hf_names.hf_name(family, name), "shape": shp,
                      "hf_shape": shp[::-1] if tr else shp, "transpose": tr, "st": st, "src": "param"})
    return family, shape, items


def _shards(items: list[dict], limit: int) -> list[list[dict]]:
    out, cur, size = [], [], 0
    for it in items:
        n = _numel(it["shape"]) * _ITEMSIZE[it["st"]]
        if cur and size + n > limit:
            out.append(cur)
            cur, size = [], 0
        cur.append(it)
        size += n
    return out + [cur] if cur else out


def _write_file(path: str, reader: PieceReader, m: dict, items: list[dict]) -> None:
    header, pos = {}, 0
    for it in items:
        n = _numel(it["shape"]) * _ITEMSIZE[it["st"]]
        header[it["hf"]] = {"dtype": it["st"], "shape": it["hf_shape"], "data_offsets": [pos, pos + n]}
        pos += n
    header["__metadata__"] = {"format": "pt"}  # transformers refuses files without it
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with atomic_file(path) as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for it in items:
            data = _tensor_bytes(reader, m, it)
            if it["transpose"]:
                data = np.ascontiguousarray(data.reshape(it["shape"]).T)
            f.write(memoryview(np.ascontiguousarray(data)).cast("B"))
            del data


def copy_tokenizer(src: str, out: str) -> list[str]:
    """The tokenizer's files into `out`; the names copied."""
    if os.path.isdir(src):
        names = [n for n in TOKENIZER_FILES if os.path.exists(os.path.join(src, n))]
        if not names:
            raise CheckpointError(f"tokenizer {src}: no tokenizer files ({', '.join(TOKENIZER_FILES[:3])}, ...)")
        for n in names:
            shutil.copyfile(os.path.join(src, n), os.path.join(out, n))
        return names
    if not os.path.isfile(src):
        raise CheckpointError(f"tokenizer {src}: no such file or directory")
    shutil.copyfile(src, os.path.join(out, "tokenizer.json"))
    atomic_write(os.path.join(out, "tokenizer_config.json"),
                 json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}, indent=1) + "\n")
    return ["tokenizer.json", "tokenizer_config.json"]


def export_hf(ckpt_path: str, out: str, dtype: str = "fp32", tag: str | None = None, verify: bool = True,
              max_shard: int = 5 << 30, tokenizer: str | None = None) -> tuple[list[str], list[str]]:
    """Write the HF directory; returns (files written, notes for the user)."""
    ckpt = resolve(ckpt_path, tag)
    if ckpt is None:
        raise CheckpointError(f"{ckpt_path}: no checkpoint here")
    m = ver.verify_checkpoint(ckpt) if verify else ver.read_manifest(ckpt)
    family, shape, items = hf_plan(m, dtype)
    try:
        cfg = hf_names.config_to_hf(shape, {"torch_dtype": "bfloat16" if dtype == "bf16" else "float32"})
    except ValueError as e:
        raise CheckpointError(f"--hf: {e}") from None
    os.makedirs(out, exist_ok=True)
    notes, written = [], []
    if m.get("module_tensors"):
        notes.append(f"buffers not exported: {', '.join(m['module_tensors'])}")
    shards = _shards(items, max_shard)
    names = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    with PieceReader(ckpt, m) as reader:
        for name, part in zip(names, shards):
            path = os.path.join(out, name)
            _write_file(path, reader, m, part)
            written.append(path)
    if len(shards) > 1:
        total = sum(_numel(it["shape"]) * _ITEMSIZE[it["st"]] for it in items)
        index = {"metadata": {"total_size": total},
                 "weight_map": {it["hf"]: n for n, part in zip(names, shards) for it in part}}
        written.append(os.path.join(out, "model.safetensors.index.json"))
        atomic_write(written[-1], json.dumps(index, indent=1) + "\n")
    written.append(os.path.join(out, "config.json"))
    atomic_write(written[-1], json.dumps(cfg, indent=1) + "\n")
    written.append(os.path.join(out, "generation_config.json"))
    atomic_write(written[-1], json.dumps({"_from_model_config": True}, indent=1) + "\n")
    tok = tokenizer or ((m.get("client_state") or {}).get("config") or {}).get("tokenizer") or ""
    if tok:
        written += [os.path.join(out, n) for n in copy_tokenizer(tok, out)]
    else:
        notes.append("no tokenizer: the run named none (TrainConfig tokenizer) and --tokenizer was not "
                     "given, so DIR has no tokenizer files")
    notes.append(f"{'LlamaForCausalLM' if family == 'llama' else 'GPT2LMHeadModel'}, step "
                 f"{m['counters']['global_steps']}, {dtype}")
    return written, notes
