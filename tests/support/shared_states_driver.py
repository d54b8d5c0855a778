"""Runs INSIDE a target environment (vLLM, speculators patched or not): one generator, the
situations tests/test_patch_v21_shared_states.py checks v21 in (speculators 0.3.0) and
tests/test_patch_v26_shared_states.py v26 (0.4.x), and a JSON report as the last line.

    python shared_states_driver.py MODE --model DIR [--dump FILE]

MODE:
- run: three generate() calls (prompts over one step's token budget in the second); each
  result's tensors must own their storage (not views of a shared buffer), in the caller's order;
  the first call's results are compared again after the later calls and after the generator is
  shut down and deleted. --dump saves the first call's results (torch.save) for comparing runs.
- worker-error: a call during whose transfer the worker raises: with v21, the step's request
  metadata one token short (v10's request-by-request check raises; while stepping that
  metadata goes with the steps' write, whose own check raises); with v26, which cuts as
  0.4's _get_captured_states does whatever the metadata says, one captured layer one row short
  (v26 refuses layers whose steps differ in rows); the report names the exception.
- sigint: one generator, one call per moment of MOMENTS in turn, each interrupted by a real
  SIGINT to this process at that moment of the captured states' RPC (by wrapping the executor's
  collective_rpc: the generator's code runs unchanged); the report's "moments" says, for each,
  whether the call was interrupted and whether the transfer's file is left.
- loop: generate() over and over, printing "calls N" after each; the test sends SIGINT.
- cuts (v26, no vLLM started, --model unused): v26's reply against 0.4's own _get_captured_states
  on the same random captured states (see cuts()).
sigint and loop refuse to run (exit 2, one line on stderr) where SIGINT is not default-handled
in this process (inherited as ignored: a background job of a shell without job control), since
their SIGINT would then interrupt nothing. Exit 0: the report's "ok"; 1: not ok.
The report: {"mode", "ok", "error": {"type", "message"} or null, "transfer", ...}.
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import traceback

REPORT = "SHARED-STATES-REPORT "
MOMENTS = {
    "before-reply": "just before the RPC is sent",
    "during-rpc": "while the caller waits: the worker, inside the RPC, signals the caller and goes on "
    "once the caller's interrupt has removed the file's name (it then opens a path that is gone)",
    "after-reply": "just after the worker's reply arrived (the file made and sized)",
}
WAIT_LIMIT = 120  # seconds for anything the driver or the worker waits on (a hang is a failure)
# The worker's side of the transfer, as collective_rpc sends it: v21's (0.3.0: after the steps,
# or while stepping, before each step and after the last, the first not interrupted), v26's
# (0.4.x). Each takes the
# file's path and the generator's mapped buffer as its last two arguments.
WRITES = ("_write_captured_states", "_write_request_states", "_write_steps")


def prompts(count: int, low: int, high: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(rng.randint(low, high))] for _ in range(count)]


def transfer_of(generator) -> dict:
    state = generator.__dict__.get("_shared_states")
    if not state:
        return {"path": "RPC queue"}
    transfer = {"path": "shared memory" if state.get("calls") else "RPC queue", "calls": state.get("calls", 0)}
    if state.get("stepped"):  # calls whose steps carried the transfer (v21 with v11's per-step RPC)
        transfer["while_stepping"] = state["stepped"]
    return transfer


def owns_storage(tensor) -> bool:
    return tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()


def interrupt_the_caller_then_write(worker, *args):
    """In the worker, as the captured states' RPC (cloudpickle sends it by value), with the
    write's own arguments then its name and the caller's pid: SIGINT to the caller, which is
    waiting for this reply; then, once the caller's interrupt has removed the file's name, the
    patch's own write, which must find the path gone (it opens it, never makes it)."""
    import importlib
    import os
    import signal
    import time

    *write_args, write, caller = args
    path = write_args[-2]
    os.kill(caller, signal.SIGINT)
    deadline = time.monotonic() + WAIT_LIMIT
    while os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.001)  # a poll, not a guess: the name goes as soon as the caller unwinds
    module = importlib.import_module("speculators.data_generation.vllm_hidden_states_generator")
    return getattr(module, write)(worker, *write_args)


def one_layer_a_row_short(worker):
    """In the worker, before v26's transfer: the last captured layer's last step loses its last
    row, which v26's write refuses (each step captures every layer at once)."""
    inner = getattr(worker, "worker", None)
    if inner is not None and hasattr(inner, "_reset_capture"):
        worker = inner
    if getattr(worker, "_captured_states", None):
        steps = worker._captured_states[-1]
        steps[-1] = steps[-1][:-1]


def cuts() -> dict:
    """v26's transfer against speculators 0.4's own _get_captured_states on the same captured
    states, no vLLM started: random steps (some empty), layers, dtypes, and step metadata that
    matches the rows, falls short of them or runs past them (0.4 clamps each cut as slicing does),
    a request cut in several steps. collective_rpc is called in this process on a real
    HiddenStatesWorkerExtension: what is compared is the reply, not vLLM's transport of it."""
    import random

    import torch
    from speculators.data_generation import vllm_hidden_states_generator as patched
    from speculators.data_generation.custom_worker import HiddenStatesWorkerExtension

    class InProcess:
        def __init__(self, worker) -> None:
            self.worker = worker

        def collective_rpc(self, method, args=(), unique_reply_rank=None):
            return method(self.worker, *args)

    class Generator:
        pass

    rng = random.Random(39)
    worker = HiddenStatesWorkerExtension()
    generator = Generator()
    generator.executor = InProcess(worker)
    report: dict = {"mode": "cuts", "cases": 0, "differ": []}
    for case in range(300):
        rows = [rng.randint(0, 12) for _ in range(rng.randint(1, 4))]
        dtype = rng.choice([torch.float32, torch.bfloat16])
        width = rng.choice([4, 8])
        layers = [[torch.randn(n, width).to(dtype) for n in rows] for _ in range(rng.randint(1, 3))]
        metadata = []
        for n in rows:
            step, left = [], n + rng.choice([0, 0, 0, -1, 1, 3])
            while left > 0:
                count = rng.randint(1, left)
                step.append((f"req_{rng.randrange(5)}", count))
                left -= count
            metadata.append(step)

        worker._captured_states = [list(steps) for steps in layers]
        worker._request_metadata = [list(step) for step in metadata]
        expected = worker._get_captured_states()
        worker._captured_states = [list(steps) for steps in layers]
        worker._request_metadata = [list(step) for step in metadata]
        got = patched._request_states_through_shared_memory(generator)
        same = list(got) == list(expected) and all(
            len(got[r]) == len(expected[r])
            and all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(got[r], expected[r]))
            for r in expected
        )
        owned = all(h.untyped_storage().nbytes() == h.numel() * h.element_size() for r in got for h in got[r])
        cleared = worker._captured_states is None and worker._request_metadata == []
        if not (same and owned and cleared):
            report["differ"].append({"case": case, "same": same, "owned": owned, "cleared": cleared})
        report["cases"] += 1
    report["transfer"] = transfer_of(generator)
    report["ok"] = report["cases"] == 300 and not report["differ"]
    return report


def run(model: str, mode: str, dump: str | None) -> dict:
    import torch
    from speculators.data_generation.vllm_hidden_states_generator import VllmHiddenStatesGenerator

    if mode == "cuts":
        return cuts()
    report: dict = {"mode": mode}
    utilization = 0.1
    generator = VllmHiddenStatesGenerator(
        model, layer_ids=[0, 2, 3], max_model_len=1024, gpu_memory_utilization=utilization
    )
    executor = generator.executor
    report["transfer_before"] = transfer_of(generator)
    if mode == "run":
        calls = [prompts(7, 4, 100, 1), prompts(11, 900, 1000, 2), prompts(5, 10, 60, 3)]
        outputs = [generator.generate(batch) for batch in calls]
        first = outputs[0]
        report["order_ok"] = all(
            r["input_ids"].tolist() == ids for batch, out in zip(calls, outputs) for ids, r in zip(batch, out)
        )
        report["rows_ok"] = all(
            h.shape[0] == len(ids)
            for batch, out in zip(calls, outputs)
            for ids, r in zip(batch, out)
            for h in r["hidden_states"]
        )
        report["own_storage"] = all(owns_storage(h) for out in outputs for r in out for h in r["hidden_states"])
        report["devices"] = sorted({str(h.device) for out in outputs for r in out for h in r["hidden_states"]})
        copies = [[h.clone() for h in r["hidden_states"]] for r in first]
        report["transfer"] = transfer_of(generator)
        executor.shutdown()
        del generator, executor
        import gc

        gc.collect()
        report["valid_after_close"] = all(
            torch.equal(h, c) for r, cs in zip(first, copies) for h, c in zip(r["hidden_states"], cs)
        )
        if dump:  # the first call (one step) and the second (two steps, a prompt split across them)
            torch.save([r["hidden_states"] for r in first + outputs[1]], dump)
        report["ok"] = all(report[k] for k in ("order_ok", "rows_ok", "own_storage", "valid_after_close"))
        return report
    if mode == "worker-error":
        # an exception in the worker inside the transfer, on any machine (a KV cache too small to
        # start the prompt depended on the host's free memory)
        real_rpc = executor.collective_rpc

        def one_token_short(method, *args, **kwargs):
            # v21: the step's request metadata one token short: v10's request-by-request check raises
            # (while stepping it goes with the steps' write: its check raises after the last step)
            if method == "_set_request_metadata":
                (scheduled,) = kwargs["args"]
                kwargs["args"] = ({request: count - 1 for request, count in scheduled.items()},)
            elif getattr(method, "__name__", "") == "_write_steps" and kwargs["args"][2] is not None:
                tokens, call, scheduled, *rest = kwargs["args"]
                kwargs["args"] = (tokens, call, {request: count - 1 for request, count in scheduled.items()}, *rest)
            return real_rpc(method, *args, **kwargs)

        def a_row_short(method, *args, **kwargs):
            # v26: one captured layer one row short, just before the transfer
            if getattr(method, "__name__", "") == "_write_request_states":
                real_rpc(one_layer_a_row_short)
            return real_rpc(method, *args, **kwargs)

        module = sys.modules[type(generator).__module__]
        executor.collective_rpc = a_row_short if hasattr(module, "_write_request_states") else one_token_short
        try:
            generator.generate(prompts(1, 1000, 1000, 4))
        except Exception as error:  # the symptom is the result  # noqa: BLE001
            report["error"] = {"type": type(error).__name__, "message": str(error)[:2000]}
        report["transfer"] = transfer_of(generator)
        report["ok"] = "error" in report
        executor.shutdown()
        return report
    if mode == "sigint":
        real = executor.collective_rpc
        batch = prompts(11, 900, 1000, 5)
        report["moments"] = {}
        for moment in MOMENTS:
            seen: dict = report["moments"].setdefault(moment, {})

            def interrupting(method, *args, seen=seen, moment=moment, **kwargs):
                write = getattr(method, "__name__", "") if callable(method) else ""
                if write not in WRITES or seen.get("rpc_file"):
                    return real(method, *args, **kwargs)
                if write == "_write_steps" and not seen.pop("first_step_passed", False):
                    # the first step write comes before the first step, with nothing captured: the
                    # one to interrupt is the next, which makes and sizes the buffer
                    seen["first_step_passed"] = True
                    return real(method, *args, **kwargs)
                seen["rpc_file"] = kwargs["args"][-2]
                if moment == "before-reply":
                    os.kill(os.getpid(), signal.SIGINT)
                if moment == "during-rpc":
                    method = interrupt_the_caller_then_write
                    kwargs["args"] = (*kwargs["args"], write, os.getpid())
                    seen["rpc_sent"] = True
                reply = real(method, *args, **kwargs)
                seen["reply_made_file"] = bool(reply and reply.get("made"))
                if moment == "after-reply":
                    os.kill(os.getpid(), signal.SIGINT)
                return reply

            executor.collective_rpc = interrupting
            try:
                generator.generate(batch)
            except KeyboardInterrupt:
                seen["interrupted"] = True
            executor.collective_rpc = real
            if seen.pop("rpc_sent", False) and seen.get("interrupted"):
                # The interrupted call's reply is still on its way and collective_rpc does not
                # drop it (the next call would take it for its own): read it. Once it is here the
                # worker is done with the path, so what is left now stays left.
                status, late = executor.response_mqs[0].dequeue(timeout=WAIT_LIMIT)
                seen["late_reply"] = {"status": str(status), "reply": late}
            seen["file_left"] = bool(seen.get("rpc_file") and os.path.exists(seen["rpc_file"]))
        report["ok"] = all(
            s.get("interrupted") and s.get("rpc_file") and not s["file_left"] for s in report["moments"].values()
        )
        executor.shutdown()
        return report
    if mode == "loop":
        batch = prompts(11, 900, 1000, 6)
        count = 0
        print(f"transfer {json.dumps(transfer_of(generator))}", flush=True)
        while True:
            generator.generate(batch)
            count += 1
            print(f"calls {count} {json.dumps(transfer_of(generator))}", flush=True)
    raise SystemExit(f"unknown mode {mode}")


def main() -> None:
    mode, model = sys.argv[1], sys.argv[sys.argv.index("--model") + 1]
    handler = signal.getsignal(signal.SIGINT)
    if mode in ("sigint", "loop") and handler is not signal.default_int_handler:
        # Python installs its handler only where SIGINT was default-handled at its start
        inherited = "ignored" if handler == signal.SIG_IGN else f"handled by {handler!r}"
        print(
            f"shared_states_driver: {mode} needs SIGINT default-handled, and this process inherited it {inherited} "
            "(as a background job of a shell without job control does); start it with "
            "preexec_fn=tests.support.terminal.sigint_as_at_a_terminal",
            file=sys.stderr,
        )
        raise SystemExit(2)
    dump = sys.argv[sys.argv.index("--dump") + 1] if "--dump" in sys.argv else None
    try:
        report = run(model, mode, dump)
    except Exception as error:  # noqa: BLE001
        traceback.print_exc()
        report = {"mode": mode, "ok": False, "error": {"type": type(error).__name__, "message": str(error)[:2000]}}
    sys.stderr.flush()
    print("\n" + REPORT + json.dumps(report), flush=True)
    if mode != "loop":
        os._exit(0 if report.get("ok") else 1)


if __name__ == "__main__":  # vLLM starts its workers with spawn
    main()
