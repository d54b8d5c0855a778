"""On the GPU machine: what each part of the captured states' transfer and assembly costs, and how
much of it overlapping with the model's steps hides (issue 42's second item). torch alone, no vLLM,
so that each way of copying is timed on its own, on the same bytes, in one run.

    python3 bench/gpu/assembly_speed.py --out "$OUT" [--hidden 2048,7168] [--calls 3] [--step-ms 33]

One generate() call as extract_gpu.py's settings make it: 64 prompts of 1024 rows, layers 1,2,3
(bf16), 8192 rows a step (8 prompts), so 8 steps. A step's compute is a stand-in: bf16 matmuls
sized to --step-ms (what vLLM's step took on the H200: execute + sample per call over 8 steps,
bench/gpu/results/extract-0.26.0-speculators-0.4.0.1-h200x1). The host buffer is a /dev/shm file,
mapped and pinned with cudaHostRegister, as v21's worker makes it. torch runs on one thread, as
vLLM sets it in the generator's process; the per-prompt copies use 8 threads, as v21's do.

Ways, each timed over --calls calls after a warm-up (seconds per call, medians):
- steps: the 8 steps alone (the floor: what vLLM's prefill pays);
- d2h-end: after the steps, every layer's rows into the buffer, then a synchronise (v21 today);
- d2h-side-stream: each step's rows into the buffer on a side stream as soon as the step is done,
  while the next computes; what is left after the last step;
- assemble-clone: each prompt's rows out of the buffer with .clone() (v21 today), the previous
  call's results dropped first; assemble-clone-kept: every call's results kept (a caller that
  holds them); assemble-thp: torch.empty, madvise(MADV_HUGEPAGE) on it, then copy_;
  assemble-prefaulted: into tensors allocated and written beforehand (the copy alone);
- today: steps, d2h-end, assemble-clone in a row (v21's call);
- pipeline: steps with side-stream copies, and each step's prompts copied out in the pool as soon
  as that step's copy is done (an event per step), while later steps compute: the call ends when
  the last prompt is copied; pipeline-thp likewise with assemble-thp's destination.
Writes $OUT/assembly-speed.json and prints a table; the ratio of each call-long way to `steps`.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

PROMPTS, ROWS, LAYERS, STEP_ROWS, THREADS = 64, 1024, 3, 8192, 8
MADV_HUGEPAGE = 14
LIBC = ctypes.CDLL(None, use_errno=True)
HUGE = 2 << 20


def pinned_buffer(nbytes: int):
    """(mapping, uint8 tensor, pinned) over a /dev/shm file of nbytes, as v21's worker maps it."""
    path = f"/dev/shm/assembly-speed-{os.getpid()}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.posix_fallocate(fd, 0, nbytes)
        mapping = mmap.mmap(fd, nbytes)
    finally:
        os.close(fd)
        os.unlink(path)
    host = torch.frombuffer(mapping, dtype=torch.uint8)
    pinned = int(torch.cuda.cudart().cudaHostRegister(host.data_ptr(), nbytes, 0)) == 0
    return mapping, host, pinned


def thp_empty(shape, dtype):
    """torch.empty, its 2 MiB-aligned interior advised as huge pages before the first write."""
    tensor = torch.empty(shape, dtype=dtype)
    start = -(-tensor.data_ptr() // HUGE) * HUGE
    stop = (tensor.data_ptr() + tensor.numel() * tensor.element_size()) // HUGE * HUGE
    if stop > start:
        LIBC.madvise(ctypes.c_void_p(start), ctypes.c_size_t(stop - start), MADV_HUGEPAGE)
    return tensor


class Call:
    """One call's bytes: the captured rows on the device, the pinned buffer, the stand-in step."""

    def __init__(self, hidden: int, step_ms: float) -> None:
        self.hidden = hidden
        self.rows = PROMPTS * ROWS
        self.captured = [torch.randn(self.rows, hidden, device="cuda", dtype=torch.bfloat16) for _ in range(LAYERS)]
        self.layer_bytes = self.rows * hidden * 2
        self.mapping, self.host, self.pinned = pinned_buffer(self.layer_bytes * LAYERS)
        self.views = [
            self.host[i * self.layer_bytes : (i + 1) * self.layer_bytes].view(torch.bfloat16).view(self.rows, hidden)
            for i in range(LAYERS)
        ]
        self.a = torch.randn(STEP_ROWS, 4096, device="cuda", dtype=torch.bfloat16)
        self.b = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
        self.matmuls = 1
        self.calibrate(step_ms)
        self.side = torch.cuda.Stream()
        self.pool = ThreadPoolExecutor(max_workers=THREADS)
        self.kept: list = []

    def calibrate(self, step_ms: float) -> None:
        for _ in range(3):
            self.step()
        torch.cuda.synchronize()
        started = time.perf_counter()
        for _ in range(5):
            self.step()
        torch.cuda.synchronize()
        per = (time.perf_counter() - started) / 5
        self.matmuls = max(1, round(step_ms / 1000 / per))
        self.step_s = per * self.matmuls

    def step(self) -> None:
        for _ in range(self.matmuls):
            torch.mm(self.a, self.b)

    def steps(self, side_copies: bool) -> None:
        for s in range(self.rows // STEP_ROWS):
            if side_copies:
                self.step_and_copy(s, [])
            else:
                self.step()

    def d2h_end(self) -> None:
        for view, layer in zip(self.views, self.captured):
            view.copy_(layer, non_blocking=self.pinned)
        torch.cuda.synchronize()

    def spans(self, first: int = 0, count: int = PROMPTS):
        return [(p * ROWS, (p + 1) * ROWS) for p in range(first, first + count)]

    def assemble(self, how: str, destinations=None):
        def copy(span):
            if how != "prefaulted":
                return self.copy_one(how, span)
            outs = destinations[span]
            for out, v in zip(outs, self.views):
                out.copy_(v[span[0] : span[1]])
            return outs

        return list(self.pool.map(copy, self.spans()))

    def pipeline(self, how: str) -> list:
        events: list = []
        futures = []
        per_step = STEP_ROWS // ROWS
        steps = self.rows // STEP_ROWS
        # the side stream's copies are queued with each step; the pool copies each step's prompts out
        # as soon as that step's event says its rows are in the buffer
        for s in range(steps):
            self.step_and_copy(s, events)
            futures.append(self.pool.submit(self.after, events[s], how, self.spans(s * per_step, per_step)))
        return [f.result() for f in futures]

    def step_and_copy(self, s: int, events: list) -> None:
        """Step s, then its rows into the buffer on the side stream once the step is done."""
        self.step()
        done = torch.cuda.Event()
        done.record()
        with torch.cuda.stream(self.side):
            self.side.wait_event(done)
            rows = slice(s * STEP_ROWS, (s + 1) * STEP_ROWS)
            for view, layer in zip(self.views, self.captured):
                view[rows].copy_(layer[rows], non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(self.side)
        events.append(copied)

    def after(self, event, how: str, spans):
        event.synchronize()
        return [self.copy_one(how, span) for span in spans]

    def copy_one(self, how: str, span):
        if how == "clone":
            return [v[span[0] : span[1]].clone() for v in self.views]
        outs = [thp_empty((span[1] - span[0], self.hidden), torch.bfloat16) for _ in self.views]
        for out, v in zip(outs, self.views):
            out.copy_(v[span[0] : span[1]])
        return outs


def timed(fn, calls: int, before=None) -> float:
    """Median seconds of fn over calls, after one warm-up; before() runs untimed ahead of each."""
    times = []
    for i in range(calls + 1):
        if before is not None:
            before()
        started = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        if i:
            times.append(time.perf_counter() - started)
    return statistics.median(times)


def measure(hidden: int, calls: int, step_ms: float) -> dict:
    call = Call(hidden, step_ms)
    results: dict = {}

    def drop():
        results.pop("held", None)

    out: dict = {
        "hidden": hidden,
        "pinned": call.pinned,
        "bytes_per_call": call.layer_bytes * LAYERS,
        "step_s": call.step_s,
        "matmuls_per_step": call.matmuls,
    }
    out["steps"] = timed(lambda: call.steps(False), calls)
    out["d2h-end"] = timed(call.d2h_end, calls)

    def side_stream_rest():
        call.steps(True)
        torch.cuda.synchronize()

    out["steps+d2h-side-stream"] = timed(side_stream_rest, calls)
    out["d2h-side-stream"] = max(0.0, out["steps+d2h-side-stream"] - out["steps"])
    call.d2h_end()
    out["assemble-clone"] = timed(lambda: results.__setitem__("held", call.assemble("clone")), calls, drop)
    drop()
    out["assemble-clone-kept"] = timed(lambda: call.kept.append(call.assemble("clone")), calls)
    call.kept.clear()
    out["assemble-thp"] = timed(lambda: results.__setitem__("held", call.assemble("thp")), calls, drop)
    drop()
    destinations = {
        span: [torch.ones(ROWS, hidden, dtype=torch.bfloat16) for _ in range(LAYERS)] for span in call.spans()
    }
    out["assemble-prefaulted"] = timed(lambda: call.assemble("prefaulted", destinations=destinations), calls)
    destinations.clear()

    def today():
        call.steps(False)
        call.d2h_end()
        results["held"] = call.assemble("clone")

    out["today"] = timed(today, calls, drop)
    drop()
    out["pipeline"] = timed(lambda: results.__setitem__("held", call.pipeline("clone")), calls, drop)
    drop()
    out["pipeline-thp"] = timed(lambda: results.__setitem__("held", call.pipeline("thp")), calls, drop)
    drop()
    # the pipeline's rows equal the buffer's, which equal the device's: the same bytes, another order
    held = call.pipeline("thp")
    expected = [layer.cpu() for layer in call.captured]
    out["pipeline_equal"] = all(
        torch.equal(rows[i], expected[i][p * ROWS : (p + 1) * ROWS])
        for s, step in enumerate(held)
        for k, rows in enumerate(step)
        for p in [s * (STEP_ROWS // ROWS) + k]
        for i in range(LAYERS)
    )
    out["ratios_over_steps"] = {k: out[k] / out["steps"] for k in ("today", "pipeline", "pipeline-thp")}
    call.pool.shutdown()
    if call.pinned:
        torch.cuda.cudart().cudaHostUnregister(call.host.data_ptr())
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--hidden", default="2048,7168")
    parser.add_argument("--calls", type=int, default=3)
    parser.add_argument("--step-ms", type=float, default=33.0)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # as vLLM sets it in the generator's process
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    record: dict = {
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(),
        "cpus": os.cpu_count(),
        "thp": thp.read_text().strip() if thp.exists() else "unknown",
        "shapes": [],
    }
    for hidden in [int(h) for h in args.hidden.split(",")]:
        record["shapes"].append(measure(hidden, args.calls, args.step_ms))
        torch.cuda.empty_cache()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "assembly-speed.json").write_text(json.dumps(record, indent=2) + "\n")
    for shape in record["shapes"]:
        print(f"hidden {shape['hidden']}: {shape['bytes_per_call'] >> 20} MiB a call, pinned {shape['pinned']}")
        for key, value in shape.items():
            if isinstance(value, float):
                print(f"  {key:28} {value:8.4f}")
        print(f"  over steps: {shape['ratios_over_steps']}  pipeline equal: {shape['pipeline_equal']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
