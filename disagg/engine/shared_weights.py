"""The weights once per box: one file of a model's packed weights, mapped by every worker on the machine.

A worker that packs a checkpoint (packed_linear) writes the packed model's tensors (every linear's
panels, laid so that the linears of a group lie end to end as `SharedInput` reads them, every bias,
and every other parameter and buffer: embeddings, norms) to one file under the cache directory, and
then serves from a mapping of that file. Any other worker on the machine that serves the same
checkpoint in the same dtype and kernel layout maps the same file instead of packing. The page cache
holds the weights once; each worker's share of them shows as shared memory (`memory.read_process_memory`).
The mapping is private (copy-on-write): a worker that wrote into a mapped tensor would get a page of
its own, never change another worker's weights or the file.

The file is named by a key: a hash of the checkpoint's content (each weight file's size and CRC-32,
and config.json), the dtype, the kernel's layout (its build and panel width), and the versions of this
project, of the file's format, of torch and of transformers (whose module names the file's entries
follow). It is written beside its final name and renamed into place once complete and synced; its
header holds the payload's size and CRC-32, checked before every use. A file that fails a check
(torn, changed bits, another format or key) is written anew, never served. The workers of one key
take turns under a lock on its directory, so a second worker waits for the first's file (reporting
`waiting_for_compile`) rather than packing a second copy.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import mmap
import os
import pathlib
import zlib
from dataclasses import dataclass

import torch
from torch import nn

from disagg.engine.cache_dir import cache_dir, exclusive
from disagg.engine.cpu_kernels import small_gemm
from disagg.engine.cpu_kernels.packed_linear import PackedLinear

log = logging.getLogger(__name__)

FORMAT = 2  # 2: the pairs layout's columns 16-23 interleave their two pairs (small_gemm.pack)
MAGIC = b"DISAGGPW"
ALIGN = 4096  # the payload, and each tensor in it, start on a page
HEADER_RESERVE = 8 + 8  # magic, header length
CHUNK = 64 << 20  # bytes read or written at a time


class UnusableFile(ValueError):
    """A packed weights file that must not be served: its reason says why (and it is then rebuilt)."""


def key_for(model: str, dtype: torch.dtype, quantization: str = "", quantized_values: tuple[torch.dtype, ...] = (),
            storage: torch.dtype | None = None) -> str | None:
    """The file's key for this checkpoint and dtype, or None where nothing is shared: a checkpoint
    that is not a local directory of safetensors files, or a dtype the kernel does not pack.
    quantization: how its linears were quantized at load ("" for none; see TorchBackend);
    quantized_values: their 8-bit values' dtypes, whose panels' layout is the build this host chose;
    storage: the dtype the other linears' panels hold, where it is not the model's (weight_storage)."""
    root = pathlib.Path(model)
    kernel = small_gemm.kernel(storage or dtype)
    files = sorted(root.glob("*.safetensors")) if root.is_dir() else []
    if kernel is None or not files or not (root / "config.json").is_file():
        return None
    import transformers

    from disagg import __version__

    content = {p.name: [p.stat().st_size, file_crc32(p)] for p in files}
    content["config.json"] = hashlib.sha256((root / "config.json").read_bytes()).hexdigest()
    facts = {
        "checkpoint": content, "dtype": str(dtype), "layout": [kernel.layout, small_gemm.PANEL], "format": FORMAT, "quantization": quantization,
        "disagg": __version__, "torch": torch.__version__, "transformers": transformers.__version__,
    }
    if storage is not None:
        facts["storage"] = str(storage)
    if quantized_values:  # the 8-bit panels' layouts: the build this host chose (int8's is measured at start-up)
        chosen = (small_gemm.quantized_kernel(values, dtype) for values in sorted(set(quantized_values), key=str))
        facts["quantized_layouts"] = [k.layout if k is not None else None for k in chosen]
    return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:24]


def file_crc32(path: pathlib.Path) -> int:
    with open(path, "rb") as f:
        return crc_of(f.fileno(), 0, os.fstat(f.fileno()).st_size)


def directory(key: str) -> pathlib.Path:
    return cache_dir() / "packed-weights" / key


def weights_path(key: str) -> pathlib.Path:
    return directory(key) / "weights.bin"


@dataclass
class MappedWeights:
    """The tensors of a packed weights file, as views over one private mapping of it."""

    tensors: dict[str, torch.Tensor]
    nbytes: int


# -- what a packed model holds, and how it is laid out in the file ------------------------------


def entries(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor the packed model serves from: each linear's panels (a group's
    members one after another, as their span lies in memory) and bias, and every other parameter
    and buffer. A tensor two modules share (a tied embedding) is listed under each name."""
    listed: list[tuple[str, torch.Tensor]] = []
    for prefix, module in model.named_modules():
        if isinstance(module, PackedLinear):
            listed += [(f"{prefix}.{field}", getattr(module, field)) for field in ("panels", "bias") if getattr(module, field) is not None]
            continue
        for tensors in (module._parameters, module._buffers):
            listed += [(f"{prefix}.{name}" if prefix else name, t) for name, t in tensors.items() if t is not None and t.layout is torch.strided]
    return listed


def layout(listed: list[tuple[str, torch.Tensor]], spans: dict[int, torch.Tensor]) -> tuple[list[tuple[torch.Tensor, int]], dict[str, list], int]:
    """Where each tensor goes: the regions to write (a tensor, or a group's span whose members
    are views of it, at a file offset) and each name's [dtype, shape, offset]; and the payload's size."""
    regions: list[tuple[torch.Tensor, int]] = []
    placed: dict[tuple[int, int], int] = {}  # (storage pointer, first byte) of a region -> its file offset
    names: dict[str, list] = {}
    end = 0
    for name, tensor in listed:
        region = spans.get(tensor.data_ptr(), tensor.contiguous())
        where = (region.untyped_storage().data_ptr(), region.data_ptr())
        if where not in placed:
            placed[where] = end
            regions.append((region, end))
            end += -(-region.numel() * region.element_size() // ALIGN) * ALIGN
        offset = placed[where] + (tensor.data_ptr() - region.data_ptr() if tensor.is_contiguous() else 0)
        names[name] = [str(tensor.dtype).removeprefix("torch."), list(tensor.shape), offset]
    return regions, names, end


def group_spans(model: nn.Module) -> dict[int, torch.Tensor]:
    """For each grouped linear's panels (a view into its group's), the group's span, by the view's pointer."""
    return {m.panels.data_ptr(): m.shared.panels for m in model.modules() if isinstance(m, PackedLinear) and m.shared is not None}


# -- the file ------------------------------------------------------------------------------------


def write(model: nn.Module, key: str, path: pathlib.Path, checkpoint: str = "") -> None:
    """The packed model's tensors into `path`, complete or not at all (written beside it, synced, renamed)."""
    regions, names, payload = layout(entries(model), group_spans(model))
    header = {"format": FORMAT, "key": key, "checkpoint": checkpoint, "payload_bytes": payload, "crc32": "00000000", "tensors": names}
    reserved = len(json.dumps(header).encode())
    start = -(-(HEADER_RESERVE + reserved) // ALIGN) * ALIGN
    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
    with open(partial, "w+b") as f:
        for region, offset in regions:
            f.seek(start + offset)
            data = region.reshape(-1).view(torch.uint8).numpy()
            for first in range(0, len(data), CHUNK):
                chunk = memoryview(data[first : first + CHUNK])
                f.write(chunk)
        f.truncate(start + payload)
        f.flush()
        crc = crc_of(f.fileno(), start, payload)  # over the payload as the file holds it, padding included
        header["crc32"] = f"{crc:08x}"
        text = json.dumps(header).encode()
        f.seek(0)
        f.write(MAGIC + len(text).to_bytes(8, "little") + text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(partial, path)


def crc_of(fd: int, start: int, length: int) -> int:
    """CRC-32 of length bytes of the file from start, read through a mapping (no copy into Python)."""
    crc = 0
    if start + length == 0:
        return crc  # an empty file maps nothing
    with mmap.mmap(fd, start + length, access=mmap.ACCESS_READ) as view:
        for first in range(start, start + length, CHUNK):
            crc = zlib.crc32(memoryview(view)[first : min(first + CHUNK, start + length)], crc)
    return crc


def read(path: pathlib.Path, key: str) -> MappedWeights:
    """The file's tensors, once its magic, key, size and CRC-32 check; else UnusableFile."""
    with open(path, "rb") as f:
        head = f.read(HEADER_RESERVE)
        if len(head) < HEADER_RESERVE or head[:8] != MAGIC:
            raise UnusableFile("it does not start as a packed weights file")
        length = int.from_bytes(head[8:], "little")
        try:
            header = json.loads(f.read(length))
        except (ValueError, UnicodeDecodeError) as exc:
            raise UnusableFile(f"its header does not read ({exc})") from None
        if header.get("format") != FORMAT or header.get("key") != key:
            raise UnusableFile(f"it is format {header.get('format')} for key {header.get('key')}, not format {FORMAT} for {key}")
        start = -(-(HEADER_RESERVE + length) // ALIGN) * ALIGN
        payload, size = int(header["payload_bytes"]), os.fstat(f.fileno()).st_size
        if size != start + payload:
            raise UnusableFile(f"it holds {size} bytes, not the {start + payload} its header names (torn)")
        if f"{crc_of(f.fileno(), start, payload):08x}" != header["crc32"]:
            raise UnusableFile("its payload's CRC-32 is not the one its header names")
        # Private and writable (copy-on-write): torch takes the buffer without a warning, and the pages
        # stay the page cache's, shared, unless written.
        mapping = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)
    # One storage over the whole mapping, every tensor a view of it: a group's members then lie end to end in it.
    whole = torch.frombuffer(mapping, dtype=torch.uint8)
    tensors = {}
    for name, (dtype, shape, offset) in header["tensors"].items():
        dtype = getattr(torch, dtype)
        count = 1
        for n in shape:
            count *= n
        first = start + offset
        tensors[name] = whole[first : first + count * dtype.itemsize].view(dtype).view(shape)
    return MappedWeights(tensors, payload)


# -- a packed model onto the file's tensors ------------------------------------------------------


def fits(model: nn.Module, mapped: MappedWeights) -> str | None:
    """Why the file's tensors do not stand for this model's (names, dtypes, shapes), or None."""
    listed = dict(entries(model))
    missing = sorted(set(listed) - set(mapped.tensors))
    if missing:
        return f"it lacks {missing[0]}"
    for name, tensor in listed.items():
        view = mapped.tensors[name]
        if view.dtype != tensor.dtype or view.shape != tensor.shape:
            return f"its {name} is {view.dtype} {tuple(view.shape)}, not {tensor.dtype} {tuple(tensor.shape)}"
    return None


def adopt(model: nn.Module, mapped: MappedWeights) -> None:
    """Every tensor of the packed model replaced by the file's (which must fit): the packed
    copies and the loader's buffers are freed, and a group's span becomes the file's."""
    views = mapped.tensors
    with torch.no_grad():
        for prefix, module in model.named_modules():
            if isinstance(module, PackedLinear):
                module.panels = views[f"{prefix}.panels"]
                if module.bias is not None:
                    module.bias = views[f"{prefix}.bias"]
                continue
            for tensors in (module._parameters, module._buffers):
                for name, tensor in list(tensors.items()):
                    if tensor is None or tensor.layout is not torch.strided:
                        continue
                    view = views[f"{prefix}.{name}" if prefix else name]
                    tensors[name] = nn.Parameter(view, requires_grad=False) if isinstance(tensor, nn.Parameter) else view
        for group in {id(m.shared): m.shared for m in model.modules() if isinstance(m, PackedLinear) and m.shared is not None}.values():
            group.adopt_members()


def remove_superseded(checkpoint: str, key: str) -> int:
    """Deletes the files of the same checkpoint under other keys (an older release's, the checkpoint's content before
    it changed) that no worker is writing; returns how many. A worker that maps one keeps its pages until it exits."""
    removed = 0
    for other in directory(key).parent.glob("*/weights.bin"):
        if other.parent.name == key:
            continue
        try:
            with open(other, "rb") as f:
                head = f.read(HEADER_RESERVE)
                header = json.loads(f.read(int.from_bytes(head[8:], "little"))) if head[:8] == MAGIC else {}
        except (OSError, ValueError, UnicodeDecodeError):
            continue
        if header.get("checkpoint") != checkpoint:
            continue
        fd = os.open(other.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # not while another worker writes or checks it
            other.unlink()
            removed += 1
        except OSError:
            pass
        finally:
            os.close(fd)
    return removed


def share(model: nn.Module, key: str, pack, on_wait, checkpoint: str = "") -> str:
    """The model packed onto the box's file for `key`. pack(tensors) packs and groups the model's
    linears, taking each one's panels from `tensors` (the file's, by name) where given. With a valid
    file: packed from its tensors, and the rest adopted; else packed here, written, and adopted.
    Returns what happened, for the log."""
    path = weights_path(key)
    with exclusive(directory(key), on_wait):
        if path.exists():
            try:
                mapped = read(path, key)
                pack(mapped.tensors)
                why = fits(model, mapped)
                if why is None:
                    adopt(model, mapped)
                    return f"mapped the box's packed weights file {path} ({mapped.nbytes / 2**30:.2f} GiB)"
                # Each linear checked its own panels, so what is served is right; only not shared.
                log.warning("packed weights file %s not used for all tensors: %s", path, why)
                return f"packed weights file {path} used in part: {why}"
            except UnusableFile as exc:
                log.warning("packed weights file %s not used: %s; writing it anew", path, exc)
        pack(None)
        try:
            write(model, key, path, checkpoint)
        except OSError as exc:  # a read-only or full cache directory: served from this worker's own memory
            log.warning("packed weights not shared: writing %s failed: %s", path, exc)
            return f"packed weights kept in this worker's memory (writing {path} failed)"
        mapped = read(path, key)
        adopt(model, mapped)
        if checkpoint and remove_superseded(checkpoint, key):
            log.info("removed this checkpoint's packed weights files of other keys (another release or content)")
        return f"wrote the box's packed weights file {path} ({mapped.nbytes / 2**30:.2f} GiB) and mapped it"
