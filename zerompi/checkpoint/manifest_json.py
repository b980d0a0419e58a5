"""manifest.json and client_state as JSON: client_state checked to be plain JSON (no
pickle is ever loaded), and the manifest sealed by a checksum over its canonical form."""
from __future__ import annotations

import hashlib
import json
from typing import Any

from .errors import CheckpointError
from .naming import FORMAT, READS_VERSIONS


def _json_path_error(obj: Any, path: str) -> str | None:
    """First place in obj that does not survive a JSON round trip, as a readable path."""
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return None
    if isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            bad = _json_path_error(v, f"{path}[{i}]")
            if bad:
                return bad
        return None
    if isinstance(obj, dict):
        for k, v in obj.items():
            if not isinstance(k, str):
                return f"{path}: key {k!r} is a {type(k).__name__}, JSON keys must be str"
            bad = _json_path_error(v, f"{path}[{k!r}]")
            if bad:
                return bad
        return None
    return f"{path}: {type(obj).__name__} is not JSON-serialisable"


def client_state_json(client_state: Any) -> str:
    """JSON text of client_state; TypeError naming the offending key otherwise. Only
    JSON is stored so that loading can never execute code (no pickle)."""
    if client_state is None:
        client_state = {}
    if not isinstance(client_state, dict):
        raise TypeError(f"client_state must be a dict, got {type(client_state).__name__}")
    bad = _json_path_error(client_state, "client_state")
    if bad:
        raise TypeError(bad + " (store plain numbers, strings, lists and dicts)")
    return json.dumps(client_state)


def canonical(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def seal(manifest: dict) -> dict:
    """Add a checksum over the manifest itself so a damaged manifest.json is detected."""
    body = {k: v for k, v in manifest.items() if k != "checksum"}
    return dict(body, checksum=hashlib.sha256(canonical(body)).hexdigest())


def unseal(text: bytes, where: str) -> dict:
    try:
        m = json.loads(text)
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{where}: not valid JSON ({e})") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise CheckpointError(f"{where}: not a zerompi checkpoint manifest")
    if m.get("format_version") not in READS_VERSIONS:
        raise CheckpointError(f"{where}: format version {m.get('format_version')!r}, "
                              f"this zerompi reads versions {', '.join(map(str, READS_VERSIONS))}")
    body = {k: v for k, v in m.items() if k != "checksum"}
    if hashlib.sha256(canonical(body)).hexdigest() != m.get("checksum"):
        raise CheckpointError(f"{where}: checksum mismatch (the manifest is damaged)")
    return m
