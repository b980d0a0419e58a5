"""Consolidate a sharded checkpoint into one state dict, one tensor in memory at a time.

    python -m zerompi.export CKPT OUT [--dtype fp32|bf16] [--format torch|safetensors|both]
    python -m zerompi.export CKPT --hf DIR [--dtype fp32|bf16] [--max-shard-size 5GB] [--tokenizer PATH]

--hf writes a Hugging Face model directory instead (config.json, safetensors, the
tokenizer's files): export_hf.py.

CKPT: DIR/TAG or DIR (then DIR/latest), e.g. runs/tiny/checkpoints. OUT: a directory;
it receives model.safetensors and model.pt (a torch.save'd {name: tensor} dict; one of
them with --format safetensors|torch) plus export.json (source, step, names, shapes,
tied-parameter aliases). Keys are those of model.state_dict(): the parameters, tied ones
under every name (model.pt shares one storage between them, model.safetensors holds a
copy), then persistent buffers, so `model.load_state_dict(sd, strict=True)` works.

Memory. safetensors is written by hand (8-byte little-endian header length, JSON
header, raw little-endian bytes) and streamed: one tensor's values are assembled from
the rank files, written, and dropped. torch.save can only write a whole dict, so the
torch format is produced from the safetensors file: every tensor is a view of an mmap
of it, and torch.save reads them through the page cache. Resident memory is then
file-backed pages the kernel can drop, not a second copy of the model; the cost is
writing the data twice (for --format torch a temporary safetensors file is removed
afterwards). Verification (sizes, and checksums: CRC-32 per 64 MiB block, sha256 in
checkpoints older than format version 2) runs first unless --no-verify. Every output
file is written atomically (zerompi.runtime.fileio): an interrupted export never leaves a
half-written model file under its final name.
"""
from __future__ import annotations

import argparse
import json
import mmap
import os
import struct
import sys
import warnings

import numpy as np

from .checkpoint import verify as ver
from .checkpoint.directory import resolve
from .checkpoint.errors import CheckpointError
from .checkpoint.reader import PieceReader
from .runtime.fileio import atomic_file, atomic_write

_ST_DTYPES = {"float32": "F32", "float64": "F64", "float16": "F16", "bfloat16": "BF16", "int64": "I64",
              "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL"}
_ITEMSIZE = {"F32": 4, "F64": 8, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}


def _numel(shape) -> int:
    return int(np.prod(shape)) if shape else 1


def plan(m: dict, dtype: str) -> list[dict]:
    """Tensor list in output order: name, shape, safetensors dtype, source."""
    out = []
    for name, t in m["tensors"].items():
        out.append({"name": name, "shape": list(t["shape"]), "st": "BF16" if dtype == "bf16" else "F32",
                    "src": "param"})
    # A tied parameter is stored once; its other names (lm_head.weight -> wte.weight)
    # come back so that load_state_dict(strict=True) into the same model works.
    shapes = {it["name"]: it for it in out}
    for alias, target in m.get("aliases", {}).items():
        if target in shapes:
            out.append(dict(shapes[target], name=alias, src="param", alias_of=target))
    for name, t in m.get("module_tensors", {}).items():
        np_name = np.dtype(t["dtype"]).name
        st = _ST_DTYPES.get(np_name)
        if st is None:
            raise CheckpointError(f"buffer {name}: dtype {np_name} has no safetensors equivalent")
        if np.dtype(t["dtype"]).kind == "f" and t["torch_dtype"] != "float64":
            st = "BF16" if dtype == "bf16" else "F32"
        out.append({"name": name, "shape": list(t["shape"]), "st": st, "src": "module"})
    return out


def _tensor_bytes(reader: PieceReader, m: dict, item: dict) -> np.ndarray:
    """The tensor's bytes in its output dtype (the only large allocation)."""
    if item["src"] == "param":
        vals = reader.read("param", item.get("alias_of", item["name"]), 0, _numel(item["shape"]))
    else:
        vals = np.ascontiguousarray(reader.module_tensor(item["name"])).ravel()
    if item["st"] == "BF16":
        import torch

        return torch.from_numpy(np.ascontiguousarray(vals, dtype=np.float32)).to(torch.bfloat16) \
            .view(torch.int16).numpy()
    if item["st"] == "F32":
        return vals.astype(np.float32, copy=False)
    return vals


def write_safetensors(path: str, reader: PieceReader, m: dict, items: list[dict], metadata: dict) -> None:
    header, pos = {}, 0
    for it in items:
        n = _numel(it["shape"]) * _ITEMSIZE[it["st"]]
        header[it["name"]] = {"dtype": it["st"], "shape": it["shape"], "data_offsets": [pos, pos + n]}
        pos += n
    header["__metadata__"] = {k: str(v) for k, v in metadata.items()}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data section starts 8-byte aligned
    with atomic_file(path) as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for it in items:
            data = _tensor_bytes(reader, m, it)
            f.write(memoryview(np.ascontiguousarray(data)).cast("B"))
            del data


def read_safetensors_header(path: str) -> tuple[dict, int]:
    """(header, offset of the data section)."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n)), 8 + n


def write_torch(path: str, st_path: str, aliases: dict | None = None) -> None:
    """torch.save a {name: tensor} dict whose tensors are views of an mmap of st_path;
    each alias shares its target's storage (safetensors cannot share, so it holds a copy)."""
    import torch

    tdt = {"F32": torch.float32, "F64": torch.float64, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
           "U8": torch.uint8, "BOOL": torch.bool}
    header, base = read_safetensors_header(st_path)
    with open(st_path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        sd, t = {}, None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # read-only buffer: torch.save only reads it
            for name, h in header.items():
                if name == "__metadata__":
                    continue
                a, b = h["data_offsets"]
                t = torch.frombuffer(mm, dtype=tdt[h["dtype"]], count=(b - a) // _ITEMSIZE[h["dtype"]],
                                     offset=base + a) if b > a else torch.empty(0, dtype=tdt[h["dtype"]])
                sd[name] = t.view(h["shape"])
            for alias, target in (aliases or {}).items():
                if alias in sd and target in sd:
                    sd[alias] = sd[target]  # tied: one storage in model.pt, as in the model
        with atomic_file(path) as f:
            torch.save(sd, f)
            sd, t = None, None  # drop the views so the mapping can close
    finally:
        try:
            mm.close()
        except BufferError:  # a view still alive somewhere: the mapping goes with it
            pass


def export(ckpt_path: str, out: str, dtype: str = "fp32", fmt_: str = "both",
           tag: str | None = None, verify: bool = True) -> list[str]:
    ckpt = resolve(ckpt_path, tag)
    if ckpt is None:
        raise CheckpointError(f"{ckpt_path}: no checkpoint here")
    m = ver.verify_checkpoint(ckpt) if verify else ver.read_manifest(ckpt)
    os.makedirs(out, exist_ok=True)
    items = plan(m, dtype)
    meta = {"format": "pt", "source": ckpt, "tag": m["tag"], "global_steps": m["counters"]["global_steps"],
            "dtype": dtype, "zerompi_version": m["zerompi_version"]}
    st_path = os.path.join(out, "model.safetensors" if fmt_ in ("safetensors", "both") else ".model.safetensors.tmp")
    written = []
    with PieceReader(ckpt, m) as reader:
        write_safetensors(st_path, reader, m, items, meta)
    if fmt_ in ("safetensors", "both"):
        written.append(st_path)
    if fmt_ in ("torch", "both"):
        pt = os.path.join(out, "model.pt")
        try:
            write_torch(pt, st_path, m.get("aliases", {}))
        finally:
            if fmt_ == "torch":
                os.unlink(st_path)
        written.append(pt)
    info = dict(meta, tensors={it["name"]: {"shape": it["shape"], "dtype": it["st"]} for it in items},
                aliases=m.get("aliases", {}), files=[os.path.basename(w) for w in written])
    atomic_write(os.path.join(out, "export.json"), json.dumps(info, indent=1))
    return written


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m zerompi.export", description=__doc__.split("\n")[0])
    ap.add_argument("ckpt", help="checkpoint directory DIR/TAG, or DIR (uses DIR/latest)")
    ap.add_argument("out", nargs="?", help="output directory (model.safetensors, model.pt, export.json)")
    ap.add_argument("--hf", metavar="DIR", help="write a Hugging Face model directory instead: config.json, "
                    "model.safetensors (sharded past --max-shard-size), generation_config.json and the run's "
                    "tokenizer files; AutoModelForCausalLM.from_pretrained(DIR) loads it (runs of "
                    "python -m zerompi.train: GPT as GPT2LMHeadModel, llama as LlamaForCausalLM)")
    ap.add_argument("--max-shard-size", default="5GB", help="--hf: largest safetensors file (default 5GB)")
    ap.add_argument("--tokenizer", help="--hf: tokenizer.json or tokenizer directory to copy (default: the "
                    "run's `tokenizer` key; neither: no tokenizer files, said on stdout)")
    ap.add_argument("--tag")
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--format", choices=("torch", "safetensors", "both"), default="both",
                    help="both (default): model.safetensors and model.pt")
    ap.add_argument("--no-verify", action="store_true", help="skip the checksum pass over the checkpoint's files "
                    "(CRC-32 per 64 MiB block; sha256 in older checkpoints)")
    a = ap.parse_args(argv)
    if (a.out is None) == (a.hf is None):
        ap.error("give either OUT or --hf DIR")
    try:
        if a.hf:
            from .export_hf import export_hf, parse_size

            written, notes = export_hf(a.ckpt, a.hf, a.dtype, a.tag, verify=not a.no_verify,
                                       max_shard=parse_size(a.max_shard_size), tokenizer=a.tokenizer)
        else:
            written, notes = export(a.ckpt, a.out, a.dtype, a.format, a.tag, verify=not a.no_verify), []
        for path in written:
            print(f"wrote {path} ({os.path.getsize(path)} bytes)")
        for note in notes:
            print(f"note: {note}")
    except (CheckpointError, OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
