"""The host buffer that carries captured hidden states from vLLM's worker to speculators' generator.

A patch writes this source into the generator's module (it runs there, in the generator's
process and, sent by collective_rpc, in the worker's), together with its own part: what the
worker copies into the buffer and how the generator reads it back. v21 writes it for speculators
0.3.0, v26 for 0.4.x. The mechanism, and why it is built so, is in the patches' docstrings; in short:

- the generator makes one empty file on a tmpfs per call and sends only its path through the RPC;
  its name exists only while that call's reply is in flight (made and removed by the generator, in
  a `finally`; the worker opens it, never creates it): no exception and no Ctrl-C leaves one;
- the worker that captured (tensor parallel rank 0) keeps one host buffer for later calls and
  makes a new one (that file, sized with posix_fallocate, mapped, pinned where CUDA is) only when
  a call needs more room or the generator has not mapped the one it has;
- the generator maps the buffer the worker made and copies each prompt's rows out of it into
  tensors of their own, several prompts at a time.

`patcher.upstream.row_keys.row_key` keys a recorded row by the definitions of this module a patch
imports, as it does by the patch modules a patch imports from.
"""

from __future__ import annotations

import libcst as cst

# The part both lines share: worker side (_capturing_worker, _shared_states_buffer, _layer_layout,
# _no_buffer), generator side (_shared_states_call, _buffer_views, _copy_rows and _owned_rows with
# the parts v21 also uses, _count_call).
# Module globals it uses: `torch` and `log` (the generator's PipelineLogger).
BUFFER_SOURCE = '''\
_SHARED_STATES_ALIGNMENT = 4096  # each layer starts on a page boundary (any dtype, DMA friendly)


def _shared_states_folder():
    """/dev/shm (a tmpfs) where it can be written, else tempfile's folder."""
    import os
    import tempfile

    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK | os.X_OK):
        return "/dev/shm"
    return tempfile.gettempdir()


def _release_shared_states(buffer):
    """Unpin and unmap a worker's buffer (its file has no name any more)."""
    if buffer.pop("pinned", False):
        torch.cuda.cudart().cudaHostUnregister(buffer["host"].data_ptr())
    buffer.pop("host", None)
    mapping = buffer.pop("mapping", None)
    if mapping is not None:
        try:
            mapping.close()
        except BufferError:  # a view of it is still alive: unmapped when that goes
            pass


def _map_shared_states(path, size, pin):
    """(mapping, uint8 tensor over it, pinned) of the file at path, sized to size bytes."""
    import mmap
    import os

    fd = os.open(path, os.O_RDWR)  # never O_CREAT: only the generator makes the name
    try:
        if hasattr(os, "posix_fallocate"):
            os.posix_fallocate(fd, 0, size)  # a full tmpfs fails here, not with SIGBUS later
        else:
            os.ftruncate(fd, size)
        mapping = mmap.mmap(fd, size)
    finally:
        os.close(fd)
    host = torch.frombuffer(mapping, dtype=torch.uint8)
    pinned = False
    if pin:
        try:
            pinned = int(torch.cuda.cudart().cudaHostRegister(host.data_ptr(), size, 0)) == 0
        except (AssertionError, AttributeError, RuntimeError):
            pinned = False  # pageable: the same bytes, copied more slowly
    return mapping, host, pinned


def _capturing_worker(worker):
    """The worker itself: vLLM hands a callable its WorkerWrapperBase, which reads through to the
    worker but keeps what is assigned to it, so the states are taken from, and cleared on, the
    worker."""
    inner = getattr(worker, "worker", None)
    if inner is not None and hasattr(inner, "_reset_capture"):
        return inner
    return worker


def _shared_states_buffer(worker, size, path, mapped_buffer, pin):
    """In the worker: (its host buffer for size bytes, whether it is new). The one it keeps where
    that is large enough and is the one the generator maps (mapped_buffer), else the file at path
    (which the generator made and removes) sized, mapped and, where pin, pinned. OSError where
    no buffer can be made (a full tmpfs, the path gone)."""
    import os

    buffer = getattr(worker, "_speculators_shared_states", None)
    if buffer is not None and buffer["size"] >= size and buffer["id"] == mapped_buffer:
        return buffer, False
    if buffer is not None:
        _release_shared_states(buffer)
        worker._speculators_shared_states = None
    size = max(size, _SHARED_STATES_ALIGNMENT)
    mapping, host, pinned = _map_shared_states(path, size, pin)
    made_count = getattr(worker, "_speculators_shared_states_made", 0) + 1
    worker._speculators_shared_states_made = made_count
    buffer = worker._speculators_shared_states = {
        "id": f"{os.getpid()}-{made_count}",
        "size": size,
        "mapping": mapping,
        "host": host,
        "pinned": pinned,
    }
    return buffer, True


def _shared_states_of(generator):
    """The generator's side of the transfer: the buffer it maps, whether it warned, its calls."""
    return generator.__dict__.setdefault(
        "_shared_states", {"buffer": None, "host": None, "warned": False, "calls": 0}
    )


def _shared_states_call(generator, write, args):
    """collective_rpc(write, args=(*args, path, mapped buffer), unique_reply_rank=0): the reply
    of the worker that captured, with generator._shared_states["host"] mapping the buffer it
    wrote. path names an empty file (mode 0600) on a tmpfs that exists only during this call:
    made here and removed here whatever happens, so neither an exception nor Ctrl-C can leave it
    (the worker opens it, never creates it). None where nothing was captured, or where no buffer
    could be made (said once in the log: the RPC queue carries the states then).
    generator._shared_states["wrapped"] says whether the executor wrapped the reply in a list.
    """
    import mmap
    import os
    import secrets

    state = _shared_states_of(generator)
    path = os.path.join(_shared_states_folder(), "speculators-states-" + secrets.token_hex(16))
    fd = None
    try:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
        except FileExistsError:
            path = None  # another's file (128 random bits: never seen): not ours to remove
            raise
        reply = generator.executor.collective_rpc(
            write, args=(*args, path, state["buffer"]), unique_reply_rank=0
        )
        state["wrapped"] = isinstance(reply, list)  # vLLM 0.11.0 wraps the single reply in a list
        if state["wrapped"]:
            reply = reply[0]
        if reply is not None and reply.get("made"):
            state["host"] = None  # the old buffer goes once no view of it is left
            state["host"] = torch.frombuffer(mmap.mmap(fd, reply["size"]), dtype=torch.uint8)
            state["buffer"] = reply["buffer"]
    finally:
        if fd is not None:
            os.close(fd)
        if path is not None:
            try:
                os.unlink(path)
            except FileNotFoundError:  # interrupted before it was made
                pass
    if reply is None:
        return None
    if "unavailable" in reply:
        if not state["warned"]:
            state["warned"] = True
            log.warning(
                "captured states travel through vLLM's RPC queue (slow): no shared buffer, "
                f"{reply['unavailable']}; give that folder more room (docker run --shm-size)"
            )
        return None
    if reply["buffer"] != state["buffer"]:
        raise RuntimeError(
            f"the worker wrote buffer {reply['buffer']}, the generator maps {state['buffer']}"
        )
    return reply


def _layer_layout(layers):
    """Where layers ((dtype, shape) each) lie in the buffer, one after another, each on a page
    boundary: ([{"dtype", "shape", "offset"}], the bytes they take)."""
    import math

    layout = []
    end = 0
    for dtype, shape in layers:
        layout.append({"dtype": str(dtype).removeprefix("torch."), "shape": list(shape), "offset": end})
        nbytes = math.prod(shape) * dtype.itemsize
        end += -(-nbytes // _SHARED_STATES_ALIGNMENT) * _SHARED_STATES_ALIGNMENT
    return layout, end


def _buffer_views(host, layout):
    """The layers of a _layer_layout as views of the mapped buffer host."""
    import math

    views = []
    for layer in layout:
        dtype = getattr(torch, layer["dtype"])
        nbytes = math.prod(layer["shape"]) * dtype.itemsize
        views.append(host[layer["offset"] : layer["offset"] + nbytes].view(dtype).view(layer["shape"]))
    return views


def _no_buffer(error, size, path):
    """The worker's reply where no buffer could be made for size bytes at path."""
    import os

    size = max(size, _SHARED_STATES_ALIGNMENT)
    return {"unavailable": f"{type(error).__name__}: {error} ({size >> 20} MiB in {os.path.dirname(path)})"}


def _spans(counts):
    """[(start, stop)] of consecutive runs of rows, one per count."""
    spans = []
    start = 0
    for count in counts:
        spans.append((start, start + count))
        start += count
    return spans


def _copy_pool():
    """Threads that copy rows out of the buffer: vLLM runs the caller's torch on one thread
    (set_multiprocessing_worker_envs), so copying prompts one by one is the slow part."""
    import os
    from concurrent.futures import ThreadPoolExecutor

    return ThreadPoolExecutor(max_workers=max(1, min(8, os.cpu_count() or 1)))


def _owned_rows(layers, span):
    """Every layer's rows span[0]:span[1], as tensors of their own."""
    return _rows_into(_empty_rows(layers, span), layers, span)


def _empty_rows(layers, span):
    """Tensors of their own, not yet written, for every layer's rows span[0]:span[1], their pages
    advised as huge ones: most of a copy into fresh memory is the kernel's first touch of each 4 KiB
    page (bench/gpu/assembly_speed.py on the H200's host: 0.226 s a call at hidden 7168 by
    .clone(), 0.130 s so)."""
    rows = []
    for layer in layers:
        owned = torch.empty((span[1] - span[0], *layer.shape[1:]), dtype=layer.dtype)
        _advise_huge_pages(owned)
        rows.append(owned)
    return rows


def _rows_into(rows, layers, span):
    """Every layer's rows span[0]:span[1] copied into rows (_empty_rows's tensors)."""
    for owned, layer in zip(rows, layers):
        owned.copy_(layer[span[0] : span[1]])
    return rows


_MADVISE = []  # libc's madvise once looked up: [function], [None] where there is none


def _advise_huge_pages(tensor):
    """madvise(MADV_HUGEPAGE) on the whole 2 MiB pages inside a CPU tensor not yet written (Linux;
    elsewhere, or where the kernel says no, its pages stay as they are). madvise is looked up once
    and called with the GIL held: a lookup per tensor (a dlopen), and a release of the GIL around
    a call that only marks pages, let the generator's thread that busy-waits for the worker's reply
    hold up each copy thread (bench/copy_contention.py)."""
    if not _MADVISE:
        _MADVISE.append(_libc_madvise())
    madvise = _MADVISE[0]
    if madvise is None:
        return
    huge = 2 << 20
    start = -(-tensor.data_ptr() // huge) * huge
    stop = (tensor.data_ptr() + tensor.numel() * tensor.element_size()) // huge * huge
    if stop > start:
        madvise(start, stop - start, 14)  # MADV_HUGEPAGE


def _libc_madvise():
    """libc's madvise as a ctypes function that keeps the GIL; None off Linux."""
    import ctypes
    import sys

    if not sys.platform.startswith("linux"):
        return None
    madvise = ctypes.PyDLL(None).madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise


def _copy_rows(layers, spans):
    """_owned_rows for each span, several spans at a time."""
    import functools

    with _copy_pool() as pool:
        return list(pool.map(functools.partial(_owned_rows, layers), spans))


def _count_call(state, layers, reply, started):
    """One call through the buffer counted in the generator's state, and what it moved."""
    import time

    state["calls"] += 1
    state["last"] = {
        "seconds": time.perf_counter() - started,
        "worker_seconds": reply["seconds"],
        "bytes": sum(h.numel() * h.element_size() for h in layers),
        "buffer_bytes": reply["size"],
        "pinned": reply["pinned"],
        "made": reply["made"],
    }
'''


def defines_function(module: cst.Module, name: str) -> bool:
    """Whether the module defines a top-level function of that name (a patch's helpers are in)."""
    return any(isinstance(s, cst.FunctionDef) and s.name.value == name for s in module.body)


def with_helpers_before_first_class(module: cst.Module, source: str) -> cst.Module:
    """The module with `source`'s statements inserted before its first class (at its end where it
    has none), two blank lines either side. Parsed after a first statement, so that the opening
    comment of `source` stays with the code it describes (a module's leading comments would
    otherwise become its header)."""
    helpers = list(cst.parse_module("_ = None\n" + source).body[1:])
    body = list(module.body)
    index = next((i for i, s in enumerate(body) if isinstance(s, cst.ClassDef)), len(body))
    blank = [cst.EmptyLine(), cst.EmptyLine()] if index else []
    helpers[0] = helpers[0].with_changes(leading_lines=[*blank, *helpers[0].leading_lines])
    if index < len(body):
        body[index] = body[index].with_changes(leading_lines=[cst.EmptyLine(), cst.EmptyLine()])
    return module.with_changes(body=[*body[:index], *helpers, *body[index:]])
