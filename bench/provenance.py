"""Provenance of a results document: its schema, when and from what commit it came (``git_commit``,
``provenance``), a new empty document and writing it as JSON."""

from __future__ import annotations

import datetime as _dt
import json
import os
import subprocess
from pathlib import Path

# /2: recall rows carry the margin sweep (needle_rate per margin, resolution, ref_overlap); `bench report`
# still re-prints /1 documents (without their recall rows, which had no margins).
SCHEMA = "cupy-dsa-bench/2"
READABLE_SCHEMAS = (SCHEMA, "cupy-dsa-bench/1")
SECTIONS = ("bytes", "store", "query", "logits", "recall")


# --------------------------------------------------------------------------------------------------
# document
# --------------------------------------------------------------------------------------------------

def _git(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(cwd), *args], capture_output=True, text=True, timeout=5)


def _running_from_checkout() -> bool:
    """Whether this code is a git checkout's own files (the clone, or an editable install of it): this file
    must be tracked where it is. An installed copy that merely sits inside some repository (a virtual
    environment in the clone) is not, and the repository's HEAD says nothing about what was installed."""
    here = Path(__file__).resolve()
    try:
        return _git(here.parent, "ls-files", "--error-unmatch", here.name).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def git_commit() -> str | None:
    """Commit of the code that ran: CUPY_DSA_COMMIT (set when the tree was copied without .git), else the
    checkout's HEAD when the code runs from a checkout, with ``-dirty`` when tracked files differ from it;
    None otherwise (:func:`no_commit_reason` says why)."""
    if os.environ.get("CUPY_DSA_COMMIT"):
        return os.environ["CUPY_DSA_COMMIT"]
    if not _running_from_checkout():
        return None
    root = Path(__file__).resolve().parent
    try:
        head = _git(root, "rev-parse", "--short=12", "HEAD")
        if head.returncode != 0:
            return None
        dirty = _git(root, "status", "--porcelain", "--untracked-files=no").stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.strip() + ("-dirty" if dirty else "")


NO_COMMIT = "no commit recorded (not run from a git checkout; set CUPY_DSA_COMMIT to record one)"
INSTALLED_COPY = ("installed copy, commit unknown (a non-editable install keeps no git metadata; set "
                  "CUPY_DSA_COMMIT to record one, or run from an editable install: pip install -e .)")


def no_commit_reason() -> str:
    """Why :func:`git_commit` found none: an installed copy (``bench/`` inside the ``cupy_dsa`` package, as pip
    lays it out) or a tree without git metadata."""
    return INSTALLED_COPY if Path(__file__).resolve().parents[1].name == "cupy_dsa" else NO_COMMIT


def commit_label(doc: dict, missing: str = "not recorded") -> str:
    """The run's commit as a table names it: 12 hex digits, and ``-dirty`` when the checkout had uncommitted
    changes (a cut at 12 characters dropped that mark, and the run was then named by a commit that is not its)."""
    c = doc.get("git_commit") if isinstance(doc, dict) else None
    if not c:
        return missing
    return c.removesuffix("-dirty")[:12] + ("-dirty" if c.endswith("-dirty") else "")


def commit_text(doc: dict, code=True) -> str:
    """``commit `abc...` `` (saying when the checkout had uncommitted changes) or a sentence saying that the
    run recorded none and why."""
    c = doc.get("git_commit")
    if not c:
        return doc.get("commit_note") or NO_COMMIT
    text = f"commit `{c}`" if code else f"commit {c}"
    return text + (" (the checkout had uncommitted changes)" if c.endswith("-dirty") else "")


def provenance() -> dict:
    """When and from what a run came: date, commit (or why none), cupy_dsa and torch versions."""
    import torch

    import cupy_dsa

    commit = git_commit()
    return {"date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), "git_commit": commit,
            "commit_note": None if commit else no_commit_reason(),
            "cupy_dsa_version": getattr(cupy_dsa, "__version__", None), "torch_version": torch.__version__}


def driver_version() -> str | None:
    """``driver <version>`` of the NVIDIA driver as nvidia-smi reports it, or None where it cannot be read (no
    nvidia-smi, no GPU)."""
    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = r.stdout.strip().splitlines()
    return f"driver {lines[0].strip()}" if r.returncode == 0 and lines and lines[0].strip() else None


def new_document(*, backend: str, device_name: str, quick: bool, seed: int, gpu_mem_gib: float) -> dict:
    return {
        "schema": SCHEMA,
        **provenance(),
        "device": device_name,
        "backend": backend,
        "quick": quick,
        "seed": seed,
        "gpu_mem_gib": gpu_mem_gib,
        "ceilings": {"copy_gbps": None, "matmul_tflops": None, "read_gbps": None, "copy_bytes": None,
                     "matmul_n": None, "l2_bytes": None},
        "targets": {},
        "notes": {s: [] for s in SECTIONS},
        "bytes": [], "store": [], "query": [], "logits": [], "recall": [],
    }


def write_json(doc: dict, path: str) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(doc, indent=1, default=str) + "\n")
