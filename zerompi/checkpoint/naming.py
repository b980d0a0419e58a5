"""Names in a checkpoint directory and its files: the format's name and version, file
and group names, tensor link names, tags, the low-precision copy's dataset."""
from __future__ import annotations

import re

FORMAT = "zerompi-checkpoint"
# Version 2: the manifest's "files" and "index" entries carry "digest" (CRC-32 per 64 MiB
# block, checksums.DIGEST_ALGO) instead of version 1's "sha256"; a reader of version 1 only would
# fail on the missing key, hence the bump. Everything else is unchanged, and this
# zerompi reads both (version-1 manifests with "sha256" or, written between the two,
# "digest" entries: checksums.file_matches checks whichever is there).
VERSION = 2
READS_VERSIONS = (1, 2)
MANIFEST = "manifest.json"
INDEX = "index.h5"
LATEST = "latest"
TMP_PREFIX = ".tmp-"      # DIR/.tmp-TAG-XXXX: a save in progress (or one that crashed)
OLD_PREFIX = ".old-"      # DIR/.old-TAG-XXXX: a checkpoint moved aside while TAG is replaced
STATE_GROUP = "state"      # rank file: /state/<kind> = concatenated pieces (1-D)
MODULE_GROUP = "module"    # frozen parameters and buffers (rank 0's file only)


def rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.h5"


def lowp_kind(precision: str) -> str | None:
    """Name of the optional low-precision parameter copy (/param_bf16, /param_fp16)."""
    return {"bf16": "param_bf16", "fp16": "param_fp16"}.get(precision)


def link_name(name: str) -> str:
    """HDF5 link name of a tensor: dots are legal in HDF5 names and kept ("body.0.weight");
    '/' would create groups and '%' is the escape, so both are percent-encoded."""
    return name.replace("%", "%25").replace("/", "%2F")


_TAG_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.+=,@-]{0,199}$")


def check_tag(tag: str) -> str:
    if not isinstance(tag, str) or not _TAG_RE.match(tag) or tag == LATEST:
        raise ValueError(f"checkpoint tag {tag!r}: use letters, digits and _.+=,@- "
                         f"(not starting with '.' or '-', not {LATEST!r})")
    return tag
