"""Run in a target with v21 applied: a Ctrl-C that lands while a copy thread starts (inside
ThreadPoolExecutor.submit, after the thread runs but before the pool records it) must leave no
thread that the interpreter waits for at exit. The step's RPC runs in this process against a
worker object holding one captured step (the executor is not what is checked: the copy threads'
end is); the interrupt is raised where a real one can land, right after the thread's start.
Prints "interrupted" and exits 0; with a thread left behind the process never exits."""

from __future__ import annotations

import threading
import types

import torch
from speculators.data_generation import vllm_hidden_states_generator as generator_module


class Worker:
    def __init__(self) -> None:
        rows = torch.arange(8 * 4, dtype=torch.float32).reshape(8, 4)
        self._captured_states = [[rows], [rows + 1]]  # two layers, one step of 8 rows
        self._request_metadata = [[("a", 4), ("b", 4)]]

    def _set_request_metadata(self, scheduled) -> None:
        self._request_metadata.append(scheduled)


class Executor:
    def __init__(self) -> None:
        self.worker = Worker()

    def collective_rpc(self, method, args=(), unique_reply_rank=None):
        return method(self.worker, *args)


GENERATORS = []  # alive at exit, as a program's generator is: its copy pool is not collected


def main() -> None:
    real_start = threading.Thread.start

    def start_then_interrupt(thread: threading.Thread) -> None:
        real_start(thread)
        if thread.name.startswith("ThreadPoolExecutor"):
            threading.Thread.start = real_start  # type: ignore[method-assign]
            raise KeyboardInterrupt

    threading.Thread.start = start_then_interrupt  # type: ignore[method-assign]
    generator = types.SimpleNamespace(executor=Executor())
    GENERATORS.append(generator)
    try:
        generator_module._states_while_stepping(generator, {"a": 4, "b": 4}, [("a", 0)])
    except KeyboardInterrupt:
        print("interrupted", flush=True)
    else:
        raise SystemExit("no copy was started: the interrupt was never raised")


if __name__ == "__main__":
    main()
