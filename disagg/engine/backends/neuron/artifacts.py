"""What a compiled directory depends on, and how it becomes complete.

NxDI's compile() (application_base.compile, 0.6-0.9) saves neuron_config.json,
traces, writes model.pt and only then shards the weights into weights/: neither
file says the compile finished. Ours does: a directory is compiled when it holds
COMPLETE_MARKER, written after compile() returned. A compile runs in a sibling
`<name>.partial` directory that is renamed into place when complete, under a
lock on the final directory, so that two workers of one configuration compile
once and a compile killed at any point leaves nothing a later start would load.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import pathlib
import shutil

from disagg.engine.cache_dir import exclusive  # noqa: F401  (the compile's lock, shared with the packed weights file)

COMPLETE_MARKER = "disagg-compiled.json"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


def nxdi_version() -> str:
    """The installed NxDI's version ("none" where it is not installed)."""
    try:
        return importlib.metadata.version("neuronx-distributed-inference")
    except importlib.metadata.PackageNotFoundError:
        pass
    try:
        import neuronx_distributed_inference
    except ImportError:
        return "none"
    return str(getattr(neuronx_distributed_inference, "__version__", "unknown"))


def toolchain(nxdi: str | None = None) -> dict:
    """What compiles the graphs besides our options: NxDI's release, the compiler's, and the
    compiler flags read from the environment at compile time (option.neuron_optimize_level)."""
    try:
        compiler = importlib.metadata.version("neuronx-cc")
    except importlib.metadata.PackageNotFoundError:
        compiler = "none"
    return {"nxdi": nxdi or nxdi_version(), "neuronx-cc": compiler, "NEURON_CC_FLAGS": os.environ.get("NEURON_CC_FLAGS", "")}


def quantizer() -> dict:
    """What makes a quantized state dict besides the checkpoint and the settings: NxDI's
    generate_quantized_state_dict over NxD's quantize_pytorch_model_* (torch's quantize_dynamic)."""
    versions = {"nxdi": nxdi_version()}
    for package in ("neuronx-distributed", "torch"):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = "none"
    return versions


def checkpoint_fingerprint(model: str) -> dict:
    """The checkpoint's config and weight files (name, size, mtime): the weights are sharded
    into the compiled directory, so a checkpoint replaced at the same path compiles again."""
    root = pathlib.Path(model)
    if not root.is_dir():
        return {"id": model}  # a hub id: its revision is what the cache resolved
    files = sorted(p for p in root.iterdir() if p.suffix in WEIGHT_SUFFIXES or p.name == "config.json")
    return {p.name: [p.stat().st_size, p.stat().st_mtime_ns] for p in files}


def digest(value) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:16]


def is_complete(path: pathlib.Path) -> bool:
    return (path / COMPLETE_MARKER).is_file()


def partial_path(path: pathlib.Path) -> pathlib.Path:
    return path.with_name(path.name + ".partial")


def work_path(path: pathlib.Path) -> pathlib.Path:
    """NxDI's BASE_COMPILE_WORK_DIR for this configuration (see compile.compile_work_dir)."""
    return path.with_name(path.name + ".work")


def clear_leftovers(path: pathlib.Path) -> None:
    """A compile of this configuration killed before: its partial and work directories go.
    Only called under the lock, so no other process is using them."""
    for leftover in (partial_path(path), work_path(path)):
        shutil.rmtree(leftover, ignore_errors=True)


def install_complete(partial: pathlib.Path, path: pathlib.Path, record: dict) -> None:
    """Marks `partial` complete and renames it onto `path`, which is emptied first and kept
    (rename onto an empty directory is atomic; the directory's inode holds the lock)."""
    (partial / COMPLETE_MARKER).write_text(json.dumps(record, indent=1, default=str))
    for child in path.iterdir():  # a directory an older disagg treated as compiled, or an earlier failure's
        shutil.rmtree(child) if child.is_dir() and not child.is_symlink() else child.unlink()
    os.rename(partial, path)
