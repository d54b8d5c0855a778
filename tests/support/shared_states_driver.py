"""Runs INSIDE a target environment (vLLM, speculators patched or not): one generator, the
situations tests/test_v21_shared_states.py checks v21 in, and a JSON report as the last line.

    python shared_states_driver.py MODE --model DIR [--dump FILE]

MODE:
- run: three generate() calls (prompts over one step's token budget in the second); each
  result's tensors must own their storage (not views of a shared buffer), in the caller's order;
  the first call's results are compared again after the later calls and after the generator is
  shut down and deleted. --dump saves the first call's results (torch.save) for comparing runs.
- worker-error: a call whose prompt can never be scheduled (KV cache smaller than the prompt):
  the worker raises inside the transfer; the report names the exception.
- sigint-before-reply / sigint-during-rpc / sigint-after-reply: a real SIGINT to this process
  just before the captured states' RPC is sent, 2 ms after (while the caller waits for the
  worker), or just after its reply arrived (the file made and sized), by wrapping the
  executor's collective_rpc (the generator's code runs unchanged); then exit.
- loop: generate() over and over, printing "calls N" after each; the test sends SIGINT.
The report: {"mode", "ok", "error": {"type", "message"} or null, "transfer", ...}.
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import threading
import time
import traceback

REPORT = "SHARED-STATES-REPORT "


def prompts(count: int, low: int, high: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(rng.randint(low, high))] for _ in range(count)]


def transfer_of(generator) -> dict:
    state = generator.__dict__.get("_shared_states")
    if not state:
        return {"path": "RPC queue"}
    return {"path": "shared memory" if state.get("calls") else "RPC queue", "calls": state.get("calls", 0)}


def owns_storage(tensor) -> bool:
    return tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()


def run(model: str, mode: str, dump: str | None) -> dict:
    import torch
    from speculators.data_generation.vllm_hidden_states_generator import VllmHiddenStatesGenerator

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
        if dump:
            torch.save([r["hidden_states"] for r in first], dump)
        report["ok"] = all(report[k] for k in ("order_ok", "rows_ok", "own_storage", "valid_after_close"))
        return report
    if mode == "worker-error":
        # the step's request metadata one token short: the worker's request-by-request check (v10)
        # raises inside the transfer, on any machine (a KV cache too small to start the prompt
        # depended on the host's free memory)
        real_rpc = executor.collective_rpc

        def one_token_short(method, *args, **kwargs):
            if method == "_set_request_metadata":
                (scheduled,) = kwargs["args"]
                kwargs["args"] = ({request: count - 1 for request, count in scheduled.items()},)
            return real_rpc(method, *args, **kwargs)

        executor.collective_rpc = one_token_short
        try:
            generator.generate(prompts(1, 1000, 1000, 4))
        except Exception as error:  # the symptom is the result  # noqa: BLE001
            report["error"] = {"type": type(error).__name__, "message": str(error)[:2000]}
        report["transfer"] = transfer_of(generator)
        report["ok"] = "error" in report
        executor.shutdown()
        return report
    if mode in ("sigint-before-reply", "sigint-during-rpc", "sigint-after-reply"):
        real = executor.collective_rpc

        def interrupting(method, *args, **kwargs):
            if callable(method) and getattr(method, "__name__", "") == "_write_captured_states":
                report["rpc_file"] = kwargs.get("args", (None, None))[1]
                if mode == "sigint-before-reply":
                    os.kill(os.getpid(), signal.SIGINT)
                if mode == "sigint-during-rpc":  # while the caller waits for the worker's reply
                    threading.Timer(0.002, os.kill, (os.getpid(), signal.SIGINT)).start()
                reply = real(method, *args, **kwargs)
                report["reply_made_file"] = bool(reply and reply.get("made"))
                if mode == "sigint-after-reply":
                    os.kill(os.getpid(), signal.SIGINT)
                return reply
            return real(method, *args, **kwargs)

        executor.collective_rpc = interrupting
        try:
            generator.generate(prompts(11, 900, 1000, 5))
        except KeyboardInterrupt:
            report["interrupted"] = True
        time.sleep(2)  # a worker still busy with the reply opens the path now, or finds it gone
        report["file_left"] = bool(report.get("rpc_file") and os.path.exists(report["rpc_file"]))
        report["ok"] = report.get("interrupted", False) and not report["file_left"]
        executor.collective_rpc = real
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
