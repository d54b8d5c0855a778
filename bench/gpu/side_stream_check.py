"""v21's writes while stepping, on CUDA without vLLM: the helpers the patch writes into speculators'
generator (read from patches/v21_shared_memory_states.py and patcher/shared_states.py, run as they
are), driven by a loop shaped like the patched generate() (the write RPC before each step, the fetch
after the last), with a worker whose "forward" keeps the GPU busy for --step-ms and captures
--layers clones of a hidden state of --hidden columns per scheduled token. The executor runs each
RPC in this process (no vLLM, no second process): the GPU side of the transfer is real (a pinned
shared-memory buffer, the side stream, its events, the allocator), the scheduling is a stand-in.

Checks (exit 1 where one fails): every prompt's rows bit-equal to the device tensors copied with
.cpu(); an interrupted call (KeyboardInterrupt after two steps) followed by calls whose results are
still equal; after the calls the device memory back where it was, no transfer file left, nothing
of a call kept by the worker, the buffer pinned and written on the side stream.

Speed, in one run with the same calls, three ways: `compute` (the steps alone, nothing captured:
vLLM's prefill here), `current-stream` (the copies queued on the compute stream: the step after
a write waits for its copies, as v21 did before the side stream; the baseline) and `side-stream`
(v21 as shipped). Ratios side-stream/current-stream and each over compute; for both ways with
copies, the final write's time in the worker and the wait for the copy-out after it, per call (a
prompt is reported complete one write later on the side stream: its copy-out may start later).

    python3 bench/gpu/side_stream_check.py --out "$OUT" [--hidden 7168] [--layers 3] \\
        [--prompts 64] [--prompt-len 1024] [--step-tokens 8192] [--step-ms 50] [--calls 5]

The machine's python3 and torch; standard library otherwise. --device cpu runs the same loop on
the CPU (no pinning, no stream: the check of the loop itself, which the suite runs).
"""

from __future__ import annotations

import argparse
import ast
import json
import logging
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(HERE))

from transfer_check import transfer_files  # noqa: E402  (beside this file)


def helpers_source() -> str:
    """The source v21 writes into the generator's module, read without importing the patch (no libcst
    on the GPU machine): BUFFER_SOURCE, then v21's CAPTURED_STATES_SOURCE and STEPS_SOURCE."""

    def constants(path: Path) -> dict:
        tree = ast.parse(path.read_text())
        return {
            node.targets[0].id: ast.literal_eval(node.value)
            for node in tree.body
            if isinstance(node, ast.Assign)
            and isinstance(node.targets[0], ast.Name)
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
        }

    shared = constants(ROOT / "patcher" / "shared_states.py")
    v21 = constants(ROOT / "patches" / "v21_shared_memory_states.py")
    return "\n\n".join([shared["BUFFER_SOURCE"], v21["CAPTURED_STATES_SOURCE"], v21["STEPS_SOURCE"]])


class Executor:
    """collective_rpc of one worker, in this process."""

    def __init__(self, worker):
        self.worker = worker

    def collective_rpc(self, method, args=(), unique_reply_rank=None):
        if isinstance(method, str):
            return getattr(self.worker, method)(*args)
        return method(self.worker, *args)


class Worker:
    """What v10/v21 read on speculators' worker, and a forward that computes, then captures."""

    def __init__(self, torch, device, hidden, layers, step_ms):
        self.torch, self.device, self.hidden, self.layers = torch, device, hidden, layers
        self._captured_states = None
        self._request_metadata = []
        self._current_request_metadata = None
        size = 4096 if device.type == "cuda" else 256
        self.weights = torch.randn(size, size, device=device, dtype=torch.bfloat16)
        self.repeats = 1
        if step_ms:
            self.repeats = max(1, round(step_ms / max(self._matmul_ms(), 1e-3)))

    def _matmul_ms(self):
        for _ in range(3):
            self.weights @ self.weights
        self._sync()
        started = time.perf_counter()
        for _ in range(20):
            self.weights @ self.weights
        self._sync()
        return (time.perf_counter() - started) * 1000 / 20

    def _sync(self):
        if self.device.type == "cuda":
            self.torch.cuda.current_stream(self.device).synchronize()

    def _reset_capture(self):
        self._captured_states = None
        self._request_metadata = []
        self._current_request_metadata = None

    def _set_request_metadata(self, request_metadata):
        self._current_request_metadata = dict(request_metadata)

    def forward(self, seed, capture):
        """One step: the compute, then (capture) each layer's rows cloned as speculators' hook does,
        then the sampler's wait for the step (vLLM's sample_tokens reads its tokens on the host)."""
        torch = self.torch
        out = self.weights
        for _ in range(self.repeats):
            out = self.weights @ out
        scheduled, self._current_request_metadata = self._current_request_metadata, None
        if capture:
            if self._captured_states is None:
                self._captured_states = [[] for _ in range(self.layers)]
            rows = sum(scheduled.values())
            for layer, steps in enumerate(self._captured_states):
                steps.append(hidden_rows(torch, self.device, seed + layer, rows, self.hidden).clone())
            self._request_metadata.append(list(scheduled.items()))
        float(out[0, 0])  # waits for the step, as the sampler's tokens on the host do


def hidden_rows(torch, device, seed, rows, hidden):
    """A step's hidden states for one layer, the same for the same seed."""
    generator = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(rows, hidden, generator=generator, device=device).to(torch.bfloat16)


class Generator:
    def __init__(self, worker):
        self.executor = Executor(worker)


def schedule(request_tokens: dict, budget: int) -> list[dict]:
    """Chunked prefill in order: each step up to budget tokens, a prompt split across steps."""
    steps, current, room = [], {}, budget
    for request_id, tokens in request_tokens.items():
        while tokens:
            take = min(tokens, room)
            current[request_id] = take
            tokens -= take
            room -= take
            if not room:
                steps.append(current)
                current, room = {}, budget
    if current:
        steps.append(current)
    return steps


def run_call(helpers, generator, worker, request_tokens, budget, mode, call_seed, interrupt_after=None):
    """One call shaped like the patched generate(); the prompts' rows (None in compute mode)."""
    worker._reset_capture()
    steps = schedule(request_tokens, budget)
    for number, scheduled in enumerate(steps):
        if interrupt_after is not None and number == interrupt_after:
            raise KeyboardInterrupt
        if mode == "compute":
            worker._set_request_metadata(scheduled)
        else:
            helpers["_states_while_stepping"](generator, request_tokens, scheduled)
        worker.forward(call_seed + 1000 * number, mode != "compute")
    if mode == "compute":
        return None
    layers = helpers["_captured_states_after_steps"](generator, request_tokens)
    spans = helpers["_spans"](request_tokens.values())
    return [helpers["_prompt_rows"](layers, start, stop) for start, stop in spans]


def expected_rows(torch, worker, request_tokens, budget, call_seed):
    """Each prompt's rows as the RPC path would hand them over (device tensors copied with .cpu())."""
    per_request = {request_id: [[] for _ in range(worker.layers)] for request_id in request_tokens}
    for number, scheduled in enumerate(schedule(request_tokens, budget)):
        rows = sum(scheduled.values())
        layers = [
            hidden_rows(torch, worker.device, call_seed + 1000 * number + layer, rows, worker.hidden)
            for layer in range(worker.layers)
        ]
        start = 0
        for request_id, count in scheduled.items():
            for layer, parts in enumerate(per_request[request_id]):
                parts.append(layers[layer][start : start + count].cpu())
            start += count
    return [[torch.cat(parts) for parts in per_request[request_id]] for request_id in request_tokens]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--step-tokens", type=int, default=8192)
    parser.add_argument("--step-ms", type=float, default=50.0)
    parser.add_argument("--calls", type=int, default=5, help="timed calls of each way")
    args = parser.parse_args(argv)
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("side_stream_check: no CUDA device here; run it on the GPU machine or pass --device cpu", file=sys.stderr)
        return 2
    device = torch.device(args.device)
    namespace = {"torch": torch, "log": logging.getLogger("side_stream_check")}
    exec(compile(helpers_source(), "<v21 helpers>", "exec"), namespace)  # noqa: S102  (the patch's own source)
    shipped_stream = namespace["_copy_stream"]
    worker = Worker(torch, device, args.hidden, args.layers, args.step_ms if device.type == "cuda" else 0)
    # after the worker's timing matmuls: cuBLAS keeps its workspace (32 MiB on Hopper) from the first
    before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    generator = Generator(worker)
    request_tokens_of = lambda call: {f"req_{call}_{i}": args.prompt_len - (i % 7) for i in range(args.prompts)}  # noqa: E731
    report: dict = {
        "config": vars(args) | {"out": str(args.out)},
        "device": str(torch.cuda.get_device_name(device)) if device.type == "cuda" else "cpu",
        "problems": [],
    }
    report["config"]["matmuls_per_step"] = worker.repeats

    # correctness, the side stream on: an interrupted call between whole ones
    checked = 0
    for call in range(4):
        request_tokens = request_tokens_of(call)
        if call == 1:
            try:
                run_call(
                    namespace,
                    generator,
                    worker,
                    request_tokens,
                    args.step_tokens,
                    "side-stream",
                    call * 10**6,
                    interrupt_after=2,
                )
            except KeyboardInterrupt:
                pass
            continue
        results = run_call(namespace, generator, worker, request_tokens, args.step_tokens, "side-stream", call * 10**6)
        expected = expected_rows(torch, worker, request_tokens, args.step_tokens, call * 10**6)
        for number, (got, want) in enumerate(zip(results, expected)):
            checked += 1
            if not all(torch.equal(g, w) for g, w in zip(got, want)):
                report["problems"].append(f"call {call}, prompt {number}: rows differ from the device's")
            if any(g.untyped_storage().nbytes() != g.numel() * g.element_size() for g in got):
                report["problems"].append(f"call {call}, prompt {number}: a result does not own its storage")
        del results, expected
    report["prompts_checked"] = checked

    # speed: the same calls three ways, interleaved
    timings: dict = {"compute": [], "current-stream": [], "side-stream": []}
    # after the last step: the final write (the worker's wait for the copies) and the copy-out's tail
    tails: dict = {mode: {"final_write_s": [], "copy_wait_s": []} for mode in timings if mode != "compute"}
    for call in range(args.calls + 1):
        request_tokens = request_tokens_of(call)
        for mode, seconds_of in timings.items():
            namespace["_copy_stream"] = (
                (lambda worker, tensor: torch.cuda.current_stream(tensor.device) if tensor.is_cuda else None)
                if mode == "current-stream"
                else shipped_stream
            )
            started = time.perf_counter()
            results = run_call(namespace, generator, worker, request_tokens, args.step_tokens, mode, call * 10**6)
            seconds = time.perf_counter() - started
            del results
            if call:  # the first is the warm-up
                seconds_of.append(seconds)
                if mode in tails:
                    last = generator._shared_states["last"]
                    tails[mode]["final_write_s"].append(round(last["worker_seconds"], 4))
                    tails[mode]["copy_wait_s"].append(round(last["copy_wait_seconds"], 4))
    namespace["_copy_stream"] = shipped_stream
    tokens = sum(request_tokens_of(0).values())
    report["seconds_per_call"] = {mode: [round(s, 4) for s in values] for mode, values in timings.items()}
    speed = {mode: tokens * len(values) / sum(values) for mode, values in timings.items()}
    report["tokens_per_s"] = {mode: round(value) for mode, value in speed.items()}
    report["after_the_last_step"] = tails
    report["ratios"] = {
        "side-stream/current-stream": round(speed["side-stream"] / speed["current-stream"], 3),
        "side-stream/compute": round(speed["side-stream"] / speed["compute"], 3),
        "current-stream/compute": round(speed["current-stream"] / speed["compute"], 3),
    }

    # what is left once the calls are over
    worker._reset_capture()
    shared = getattr(worker, "_speculators_shared_states", None) or {}
    report["pinned"] = shared.get("pinned")
    report["copy_stream"] = getattr(worker, "_speculators_copy_stream", None) is not None
    report["steps_left"] = getattr(worker, "_speculators_steps", None) is not None
    report["files_left"] = transfer_files()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        report["cuda_allocated_after"] = torch.cuda.memory_allocated(device)
        report["cuda_allocated_before"] = before
        if report["cuda_allocated_after"] > before + 2**20:
            report["problems"].append(f"device memory held after the calls: {report['cuda_allocated_after']} bytes")
        if not (report["pinned"] and report["copy_stream"]):
            report["problems"].append("the buffer is not pinned or was not written on the side stream")
    if report["steps_left"]:
        report["problems"].append("the worker keeps a call's progress")
    if report["files_left"]:
        report["problems"].append(f"transfer files left: {report['files_left']}")
    report["passed"] = not report["problems"]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "side-stream-check.json").write_text(json.dumps(report, indent=1) + "\n")
    print(
        json.dumps(
            {k: report[k] for k in ("passed", "problems", "prompts_checked", "tokens_per_s", "ratios")}, indent=1
        )
    )
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
