"""Runs INSIDE a target environment (vLLM, speculators): one generator, a row of generate() calls,
and after each what the scheduler and the worker still hold of the requests. A JSON report is
the last line of stdout.

    python worker_requests_driver.py --model DIR --calls 5,5,5,1

CALLS are patcher/demo/extract.py's batches (make_batches), by number. After each call: how many
results came back, how many requests the generator's scheduler still holds, and which ones the
worker's model runner still caches (vLLM's worker forgets a request only when a scheduler output
it executes names it finished, so a request finished where no step follows stays there for good).
The report: {"calls": [{"prompts", "results", "scheduler", "worker"}], "error": str or null}.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback

REPORT = "WORKER-REQUESTS-REPORT "


def worker_requests(worker) -> list[str]:
    """In the worker (collective_rpc sends it by value): the request ids its model runner caches."""
    return sorted(worker.model_runner.requests)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--calls", required=True)
    parser.add_argument("--extract", required=True, help="patcher/demo/extract.py (its make_batches)")
    args = parser.parse_args()
    report: dict = {"calls": [], "error": None}
    generator = None
    try:
        sys.path.insert(0, os.path.dirname(args.extract))
        from extract import config_vocab_size, make_batches
        from speculators.data_generation.vllm_hidden_states_generator import VllmHiddenStatesGenerator
        from transformers import AutoTokenizer

        batches = make_batches(AutoTokenizer.from_pretrained(args.model), config_vocab_size(args.model))
        generator = VllmHiddenStatesGenerator(
            args.model, layer_ids=[0, 2, 3], max_model_len=1024, gpu_memory_utilization=0.1
        )
        for number in args.calls.split(","):
            prompts = batches[int(number) - 1]
            results = generator.generate(prompts)
            (worker,) = generator.executor.collective_rpc(worker_requests)
            report["calls"].append(
                {
                    "prompts": len(prompts),
                    "results": len(results),
                    "scheduler": len(generator.scheduler.requests),
                    "worker": worker,
                }
            )
    except Exception as exc:  # the failure is the result: report it  # noqa: BLE001
        report["error"] = f"{type(exc).__name__}: {exc}"[:2000]
        traceback.print_exc(file=sys.stderr)
    if generator is not None:
        generator.executor.shutdown()
    sys.stdout.write(REPORT + json.dumps(report) + "\n")
    sys.stdout.flush()
    os._exit(0 if report["error"] is None else 1)


if __name__ == "__main__":  # vLLM starts its workers with spawn
    main()
