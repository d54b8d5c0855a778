"""Extract hidden states with speculators' VllmHiddenStatesGenerator and check them against
transformers' output_hidden_states of the same weights.

Runs INSIDE the demo environment (vLLM, speculators, transformers, torch), as a script:

    python extract.py --model DIR [--reference DIR] [--report PATH] [--calls all|N,N:K,...] [--noise]

One process, one generator, several generate() calls whose batches are what real training data
looks like and what broke 0.3.0 on newer vLLM:
  - prompts shorter and longer than one KV block (16 tokens);
  - prompts sharing a "chat template" prefix of more than 16 tokens, within a batch and across
    calls, and a prompt repeated from an earlier call;
  - a batch of eleven prompts of 900-1000 tokens (over 10,000 tokens in all, more than the
    step's token budget of max(8192, max_model_len) that speculators 0.3.0 sets), so that vLLM
    splits a prompt across scheduler steps;
  - a batch of seventy short prompts, more than twice the generator's max_num_seqs (32: the
    requests vLLM's scheduler runs at once), so that one call needs three rounds of requests.

For every prompt and requested layer: the result must have the prompt's full length, carry the
prompt's own input_ids, and match transformers within TOLERANCE. speculators captures
(hidden_states + residual) after layer i, which is transformers' hidden_states[i + 1] for a
non-final layer; for the final layer transformers returns the state after the model's norm, so
the capture is compared after applying that norm.

The report is JSON, printed as the last line of stdout (and written to --report if given):
{"ok": bool, "tolerance", "max_abs_diff", "max_rel_diff", "scale", "timings", "prompts_per_call",
 "max_num_seqs" (the generator's scheduler's, once it is built),
 "calls": [{"call": n, "prompts": [{"prompt_tokens", "rows" (one per layer), "max_abs_diff",
 "max_rel_diff", "input_ids_ok", "status" (ok, short, short-wrong, long, wrong), "rows_belong_to"
 (another prompt of the call whose rows these are, if any)}]}],
 "error": {"type", "module", "message", "phase", "where", "chain", "traceback"} or null}.
A failure inside speculators or vLLM is caught and reported with its exception type, message and
the innermost frame, so a test can assert the exact symptom. The exit status is 0 when ok.

The reference is transformers' model of --reference (default: the model directory itself, or the
directory a tiny checkpoint's tiny-model.json names: the Kimi-K2.5 wrappers of workbench/tiny_moe.py
keep a DeepseekV3ForCausalLM of their text weights in reference/). The report also gives
"median_rel_diff" (over every row of every prompt and layer; a wrong MoE expert, scale or
dequantization moves every row, a near-tied routing choice flipped by bfloat16 only a few), held to
the checkpoint's "median_tolerance" where its tiny-model.json sets one ("median_ok"), and, with
--noise, "noise": transformers' own bfloat16 run against its float32 run on the same prompts
({"max_rel_diff", "median_rel_diff"}): the band bfloat16 alone spans, beside the tolerance.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
import traceback

# vLLM runs the model in bfloat16 whatever we save: speculators passes dtype="auto", and vLLM's
# "auto" downcasts float32 checkpoints to the platform's first half type (bfloat16 on this CPU
# build). So the tiny model's weights are bfloat16 (exactly the same weights on both sides) and
# the reference is transformers in float32: the difference is vLLM's bfloat16 arithmetic.
# The measure is per row: max_j |captured - reference| / max_j |reference|. Measured on vLLM
# 0.16.0 CPU, every prompt and layer of the demo: at most 0.069 to 0.076 on two machines (call 3;
# the fifth call's 70 prompts 0.055), median 0.01-0.04; transformers' own bfloat16 run against its
# float32 run: at most 0.042 to 0.055. A row of another prompt (past their shared prefix): at
# least 0.66. 0.25 sits between them with a factor of about 3 to each side.
TOLERANCE = 0.25
TEMPLATE_TEXT = (
    "kalo mine rusa topo vide sa ba zi fe gu. mika lone ruto pasa deki viba zife gune. tokalo minesa rupo vi de po."
)


def make_batches(tokenizer, vocab_size: int, seed: int = 7) -> list[list[list[int]]]:
    """The generate() calls and their prompts (token ids)."""
    rng = random.Random(seed)
    first_free = max(tokenizer.all_special_ids, default=-1) + 1
    # a real checkpoint keeps its special and reserved tokens above the tokenizer's base vocabulary
    upper = min(vocab_size, getattr(tokenizer, "vocab_size", None) or vocab_size)

    def rand(n: int) -> list[int]:
        return [rng.randrange(first_free, upper) for _ in range(n)]

    # A "chat template": BOS and a system prompt shared by every templated sample.
    bos = [] if tokenizer.bos_token_id is None else [tokenizer.bos_token_id]
    template = bos + tokenizer.encode(TEMPLATE_TEXT, add_special_tokens=False)
    assert len(template) > 16, len(template)

    call1 = [
        rand(4),  # shorter than a block
        template + rand(5),  # shares the template with the two below
        rand(9),
        template + rand(20),
        template + rand(2),
        rand(100),
        rand(16),  # exactly one block
    ]
    call2 = [
        template + rand(12),  # template shared with call 1
        call1[3],  # repeated from call 1
        rand(33),
        template + rand(40),
        rand(5),
    ]
    # Eleven prompts of 900-1000 tokens: over the 8192-token step budget, so one is split.
    call3 = [
        (template + rand(rng.randint(900, 1000) - len(template))) if i % 3 == 0 else rand(rng.randint(900, 1000))
        for i in range(11)
    ]
    call4 = [
        template + rand(30),
        rand(17),
        call1[1],  # repeated again, after the long batch
        call3[1][:64],  # a prefix of a long prompt of call 3
    ]
    # Seventy short prompts: more than twice the 32 requests the generator's scheduler runs at once
    # (its max_num_seqs), so the call is done in three rounds; drawn after calls 1-4, which stay as
    # they were (the patches' declared symptoms name them).
    call5 = [(template + rand(rng.randint(1, 24))) if i % 4 == 0 else rand(rng.randint(3, 40)) for i in range(70)]
    call5[40] = call1[3]  # repeated from call 1, in the second round
    return [call1, call2, call3, call4, call5]


def tiny_marker(model: str) -> dict:
    """A tiny checkpoint's tiny-model.json (workbench/tiny_moe.py), or {}."""
    try:
        with open(os.path.join(model, "tiny-model.json")) as handle:
            marker = json.load(handle)
    except (OSError, ValueError):
        return {}
    return marker if isinstance(marker, dict) else {}


def config_vocab_size(model: str) -> int:
    """The vocabulary of config.json (a wrapper's: its text_config's), read without transformers."""
    with open(os.path.join(model, "config.json")) as handle:
        config = json.load(handle)
    return int(config.get("vocab_size") or config["text_config"]["vocab_size"])


def reference_dir(model: str) -> str:
    """The transformers reference of `model`: the directory a tiny checkpoint's tiny-model.json
    names, else the model directory itself."""
    return os.path.normpath(os.path.join(model, tiny_marker(model).get("reference", ".")))


class Reference:
    """transformers' hidden states of the same weights, float32 (or `dtype`) on `device`."""

    def __init__(self, model_path: str, layer_ids: list[int], device: str = "cpu", dtype: str = "float32"):
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        self.device = device
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype)).to(device)
        self.model.eval()
        self.num_layers = self.model.config.num_hidden_layers
        self.layer_ids = layer_ids
        self.cache: dict[tuple[int, ...], list] = {}

    def layers(self, ids: list[int]) -> list:
        """One [len(ids), hidden] tensor per requested layer, in speculators' terms."""
        key = tuple(ids)
        if key not in self.cache:
            torch = self.torch
            with torch.no_grad():
                out = self.model(torch.tensor([ids], device=self.device), output_hidden_states=True)
            hidden = [h[0].float().cpu() for h in out.hidden_states]
            self.cache[key] = [hidden[i + 1] for i in self.layer_ids]
        return self.cache[key]

    def comparable(self, layer_id: int, captured):
        """speculators' capture of `layer_id` in the form transformers reports it."""
        torch = self.torch
        if layer_id == self.num_layers - 1:
            norm = self.model.model.norm
            with torch.no_grad():
                normed = norm(captured.to(device=self.device, dtype=norm.weight.dtype))
            return normed.float().cpu()
        return captured.to(torch.float32)


def max_diff(a, b) -> float:
    """Largest absolute difference over the rows both have."""
    n = min(a.shape[0], b.shape[0])
    if n == 0:
        return float("inf")
    return float((a[:n] - b[:n]).abs().max())


def row_rel_diffs(captured, expected):
    """Per-row relative difference, max_j |c - e| / max_j |e|, over the rows both have."""
    n = min(captured.shape[0], expected.shape[0])
    diff = (captured[:n] - expected[:n]).abs().max(dim=1).values
    return diff / expected[:n].abs().max(dim=1).values.clamp_min(1e-12)


def max_rel_diff(captured, expected) -> float:
    """Largest per-row relative difference, max_j |c - e| / max_j |e|, over the rows both have."""
    if min(captured.shape[0], expected.shape[0]) == 0:
        return float("inf")
    return float(row_rel_diffs(captured, expected).max())


def median(values: list[float]) -> float | None:
    ordered = sorted(values)
    if not ordered:
        return None
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def all_finite(tensors) -> bool:
    return all(bool(t.isfinite().all()) for t in tensors)


def check_rows(layer_ids: list[int], prompts: list[list[int]], results: list[dict]) -> list[dict]:
    """Without a reference: every prompt's rows whole, its own input_ids, every value finite."""
    if len(results) != len(prompts):
        raise AssertionError(f"generate() returned {len(results)} results for {len(prompts)} prompts")
    out = []
    for index, (ids, result) in enumerate(zip(prompts, results)):
        rows = [int(h.shape[0]) for h in result["hidden_states"]]
        same_ids = result["input_ids"].tolist() == ids
        finite = all_finite(result["hidden_states"])
        if any(r < len(ids) for r in rows) or len(rows) != len(layer_ids):
            status = "short"
        elif any(r > len(ids) for r in rows):
            status = "long"
        elif not finite:
            status = "not-finite"
        elif not same_ids:
            status = "wrong"
        else:
            status = "ok"
        out.append(
            {
                "index": index,
                "prompt_tokens": len(ids),
                "rows": rows,
                "input_ids_ok": same_ids,
                "finite": finite,
                "status": status,
                "rows_belong_to": None,
            }
        )
    return out


def check_call(reference: Reference, prompts: list[list[int]], results: list[dict]) -> list[dict]:
    rows_out = []
    if len(results) != len(prompts):
        raise AssertionError(f"generate() returned {len(results)} results for {len(prompts)} prompts")
    for index, (ids, result) in enumerate(zip(prompts, results)):
        finite = all_finite(result["hidden_states"])
        captured = [reference.comparable(layer, h) for layer, h in zip(reference.layer_ids, result["hidden_states"])]
        expected = reference.layers(ids)
        rows = [int(h.shape[0]) for h in captured]
        per_layer = [max_diff(c, e) for c, e in zip(captured, expected)]
        per_layer_rel = [max_rel_diff(c, e) for c, e in zip(captured, expected)]
        scale = max(float(e.abs().max()) for e in expected)
        same_ids = result["input_ids"].tolist() == ids
        row_diffs = [float(x) for c, e in zip(captured, expected) for x in row_rel_diffs(c, e)]
        full = all(r == len(ids) for r in rows) and len(captured) == len(reference.layer_ids)
        match = all(d <= TOLERANCE for d in per_layer_rel)
        if full and match and same_ids and finite:
            status = "ok"
        elif any(r < len(ids) for r in rows):
            status = "short" if match else "short-wrong"
        elif any(r > len(ids) for r in rows):
            status = "long"
        elif not finite:
            status = "not-finite"
        else:
            status = "wrong"
        belongs_to = None
        if status != "ok" and rows and rows[0] > 0:
            # Whose rows are these? Another prompt of the same call, matched on the overlap.
            for other, other_ids in enumerate(prompts):
                if other == index:
                    continue
                other_expected = reference.layers(other_ids)
                if all(max_rel_diff(c, e) <= TOLERANCE for c, e in zip(captured, other_expected)):
                    belongs_to = other
                    break
        rows_out.append(
            {
                "index": index,
                "prompt_tokens": len(ids),
                "rows": rows,
                "max_abs_diff": max(per_layer) if per_layer else None,
                "max_abs_diff_per_layer": per_layer,
                "max_rel_diff": max(per_layer_rel) if per_layer_rel else None,
                "max_rel_diff_per_layer": per_layer_rel,
                "median_rel_diff": median(row_diffs),
                "_row_rel_diffs": row_diffs,
                "scale": scale,
                "input_ids_ok": same_ids,
                "finite": finite,
                "status": status,
                "rows_belong_to": belongs_to,
            }
        )
    return rows_out


def noise_band(reference: Reference, model_path: str, batches: list[list[list[int]]], device: str) -> dict:
    """transformers' own bfloat16 run against its float32 run (`reference`) on the same prompts."""
    low = Reference(model_path, reference.layer_ids, device=device, dtype="bfloat16")
    rows: list[float] = []
    for prompts in batches:
        for ids in prompts:
            # the final layer: transformers reports both after the model's norm
            for b, a in zip(low.layers(ids), reference.layers(ids)):
                rows.extend(float(x) for x in row_rel_diffs(b, a))
    return {"max_rel_diff": max(rows, default=None), "median_rel_diff": median(rows), "rows": len(rows)}


def summarize(report: dict) -> None:
    all_rows = [x for c in report["calls"] for p in c["prompts"] for x in p.pop("_row_rel_diffs", [])]
    report["median_rel_diff"] = median(all_rows)
    good = [p for c in report["calls"] for p in c["prompts"] if p["status"] == "ok"]
    report["max_abs_diff"] = max((p["max_abs_diff"] for p in good if "max_abs_diff" in p), default=None)
    report["max_rel_diff"] = max((p["max_rel_diff"] for p in good if "max_rel_diff" in p), default=None)
    report["prompts_checked"] = sum(len(c["prompts"]) for c in report["calls"])
    report["prompts_ok"] = len(good)
    report["scale"] = max((p["scale"] for c in report["calls"] for p in c["prompts"] if "scale" in p), default=None)
    limit = report.get("median_tolerance")
    # held only where compared: without a reference (--no-reference) there is no median to hold
    report["median_ok"] = (
        limit is None
        or report.get("compared") is False
        or (report["median_rel_diff"] is not None and report["median_rel_diff"] <= limit)
    )
    report["ok"] = (
        report["error"] is None
        and len(report["calls"]) == report["planned_calls"]
        and all(p["status"] == "ok" for c in report["calls"] for p in c["prompts"])
        and report["median_ok"]
    )


def error_record(exc: BaseException, phase: str) -> dict:
    chain: list = []
    cur: BaseException | None = exc
    while cur is not None and len(chain) < 5:
        chain.append({"type": type(cur).__name__, "message": str(cur)[:3000]})
        cur = cur.__cause__ or cur.__context__
    frames = traceback.extract_tb(exc.__traceback__)
    where = f"{os.path.basename(frames[-1].filename)}:{frames[-1].name}" if frames else ""
    return {
        "type": type(exc).__name__,
        "module": type(exc).__module__,
        "message": str(exc)[:3000],
        "phase": phase,
        "where": where,  # the innermost frame, e.g. block_pool.py:cache_full_blocks
        "chain": chain,
        "traceback": traceback.format_exc()[-4000:],
    }


def worker_model_runner(worker) -> str:
    """In a worker (collective_rpc sends it): the class of the model runner it drives, V1's
    (vllm.v1.worker.gpu_model_runner) or Model Runner V2's (vllm.v1.worker.gpu.model_runner)."""
    runner = getattr(getattr(worker, "worker", worker), "model_runner", None)
    return f"{type(runner).__module__}.{type(runner).__qualname__}"


def worker_requests_held(worker) -> int:
    """In a worker (collective_rpc sends it): how many requests its model runner keeps state for,
    Model Runner V2's request slots (req_states) or V1's cached request states (requests)."""
    runner = getattr(getattr(worker, "worker", worker), "model_runner", None)
    slots = getattr(runner, "req_states", None)
    if slots is not None:
        return len(slots.req_id_to_index)
    return len(getattr(runner, "requests", {}))


def requests_held(generator) -> int | None:
    """The most requests any rank's model runner still keeps after a call (None: not readable).
    A call's requests must all be gone by then: Model Runner V2 has max_num_seqs slots and a call
    that finds them taken fails `No free indices`; V1 keeps the states until the process ends."""
    try:
        replies = generator.executor.collective_rpc(worker_requests_held)
    except Exception:  # noqa: BLE001  (an older worker API: the call's rows are still checked)
        return None
    return max(int(reply) for reply in replies) if replies else None


def model_runner_of(generator) -> str:
    """Which model runner the generator's workers run (the record says it: vLLM picks it)."""
    try:
        reply = generator.executor.collective_rpc(worker_model_runner, unique_reply_rank=0)
    except Exception as exc:  # noqa: BLE001  (a record without it is still a record)
        return f"unknown ({type(exc).__name__}: {exc})"
    return str(reply[0] if isinstance(reply, list) else reply)


def transfer_of(generator) -> dict:
    """How the captured states reached the generator: through the shared buffer (v21) in every
    call, or vLLM's RPC queue."""
    state = generator.__dict__.get("_shared_states")
    if not state or not state.get("calls"):
        return {"path": "RPC queue"}
    return {"path": "shared memory", "calls": state["calls"]}


def cpu_thread_binding(tensor_parallel_size: int, cpus: list[int] | None = None) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for vLLM's CPU build at this tensor parallel size: the CPUs this
    process may run on (os.sched_getaffinity), one contiguous share a rank, shared in turn where
    there are fewer CPUs than ranks. vLLM's default ("auto") binds rank N to NUMA node N, and a
    machine with fewer nodes than ranks fails its assertion."""
    cpus = sorted(cpus if cpus is not None else os.sched_getaffinity(0))
    ranks = tensor_parallel_size
    if len(cpus) >= ranks:
        share = len(cpus) // ranks
        groups = [cpus[rank * share : (rank + 1) * share] for rank in range(ranks)]
    else:
        groups = [[cpus[rank % len(cpus)]] for rank in range(ranks)]
    return "|".join(",".join(str(cpu) for cpu in group) for group in groups)


def bind_cpu_threads(tensor_parallel_size: int) -> str | None:
    """Set VLLM_CPU_OMP_THREADS_BIND for several ranks on a host without CUDA, unless the caller
    set it; the value set, or None."""
    if tensor_parallel_size < 2 or "VLLM_CPU_OMP_THREADS_BIND" in os.environ:
        return None
    import torch

    if torch.cuda.is_available():
        return None
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cpu_thread_binding(tensor_parallel_size)
    return os.environ["VLLM_CPU_OMP_THREADS_BIND"]


def prepare_calls(args, report: dict) -> tuple[str, list[int], list]:
    """The import phase's reading: the tokenizer, the reference's folder and the generate() calls
    asked for (--calls), each named in the report; (reference folder, call numbers, their prompts)."""
    from transformers import AutoTokenizer

    # a checkpoint on disk may ship its own tokenizer code (Kimi-K2.5's): the user's own files
    tokenizer = AutoTokenizer.from_pretrained(args.model, trust_remote_code=True)

    reference_path = args.reference or reference_dir(args.model)
    report["reference"] = None if args.no_reference else reference_path
    # MoE checkpoints: a wrong expert, scale or dequantization moves every row less than the
    # per-row tolerance sees, but moves the median (workbench/tiny_moe.py's docstring)
    report["median_tolerance"] = tiny_marker(args.model).get("median_tolerance")
    vocab_size = config_vocab_size(args.model)
    batches = make_batches(tokenizer, vocab_size)
    numbers = list(range(1, len(batches) + 1))
    if args.calls != "all":
        # "N" is call N; "N:K" its first K prompts (5:33: one prompt past max_num_seqs)
        chosen = [item.partition(":") for item in args.calls.split(",")]
        numbers = [int(number) for number, _, _ in chosen]
        batches = [batches[int(n) - 1][: int(k)] if k else batches[int(n) - 1] for n, _, k in chosen]
    report["call_numbers"] = numbers
    report["planned_calls"] = len(batches)
    report["prompts_per_call"] = [len(b) for b in batches]
    report["tokens_per_call"] = [sum(len(p) for p in b) for b in batches]
    return reference_path, numbers, batches


def generate_calls(args, report: dict, state: dict, generator_class, numbers: list[int], batches: list) -> list:
    """The init and generate phases: the generator (kept in state["generator"]), then each call,
    and what each left behind in the workers and the scheduler; the calls' outputs."""
    state["phase"] = "init"
    report["cpu_thread_binding"] = bind_cpu_threads(args.tensor_parallel_size)
    t0 = time.monotonic()
    generator = state["generator"] = generator_class(
        args.model,
        layer_ids=args.layers,
        max_model_len=args.max_model_len,
        gpu_memory_utilization=args.memory_utilization,
        tensor_parallel_size=args.tensor_parallel_size,
    )
    report["timings"]["init_s"] = round(time.monotonic() - t0, 2)
    report["model_runner"] = model_runner_of(generator)
    # what a call must exceed to need more than one round of requests (speculators' MAX_NUM_SEQS)
    scheduler_config = getattr(getattr(generator, "vllm_config", None), "scheduler_config", None)
    report["max_num_seqs"] = getattr(scheduler_config, "max_num_seqs", None)

    outputs = []
    report["worker_requests_after_call"] = held = []
    report["scheduler_requests_after_call"] = scheduled = []
    for number, prompts in zip(numbers, batches):
        state["phase"] = f"generate {number}"
        t0 = time.monotonic()
        outputs.append(generator.generate(prompts))
        report["timings"][f"generate_{number}_s"] = round(time.monotonic() - t0, 2)
        held.append(requests_held(generator))
        scheduled.append(len(getattr(getattr(generator, "scheduler", None), "requests", {})))
    # checked after every call has run: a leak that breaks a later call shows as that call's error
    leaked = [(n, w or 0, s) for n, w, s in zip(numbers, held, scheduled) if w or s]
    if leaked:
        number, workers, scheduler = leaked[0]
        state["phase"] = f"generate {number}"
        raise RuntimeError(
            f"generate {number} left {workers} requests in the workers' model runner and {scheduler} in "
            f"the generator's scheduler (after each call: {held}, {scheduled}); nothing of a call may "
            "stay for the next"
        )
    return outputs


def compare_calls(
    args, report: dict, state: dict, reference_path: str, numbers: list[int], batches: list, outputs: list
) -> None:
    """The reference (and noise) phases: every call's rows against transformers' own states where
    the reference loads, else checked alone (check_rows); the noise band where asked."""
    state["phase"] = "reference"
    t0 = time.monotonic()
    reference = None
    if args.no_reference:
        report["reference_skipped"] = args.no_reference
    else:
        try:
            reference = Reference(reference_path, args.layers, device=args.reference_device)
        except Exception as exc:  # only where asked (--reference-optional): the rows are still checked
            if not args.reference_optional:
                raise
            report["reference_skipped"] = (
                f"transformers cannot load {reference_path} as a causal LM: {type(exc).__name__}: "
                f"{str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ''}"
            )
    report["compared"] = reference is not None
    for number, prompts, results in zip(numbers, batches, outputs):
        checked = (
            check_call(reference, prompts, results)
            if reference is not None
            else check_rows(args.layers, prompts, results)
        )
        report["calls"].append({"call": number, "prompts": checked})
    report["timings"]["reference_s"] = round(time.monotonic() - t0, 2)
    if args.noise and reference is not None:
        state["phase"] = "noise"
        t0 = time.monotonic()
        report["noise"] = noise_band(reference, reference_path, batches, args.reference_device)
        report["timings"]["noise_s"] = round(time.monotonic() - t0, 2)


def run(args) -> dict:
    """One extraction, phase by phase (import, init, generate N, shutdown, reference, noise): the
    report, with the phase an error stopped it in (error_record) and the generator where one is
    still up ("_generator")."""
    report: dict = {
        "ok": False,
        "error": None,
        "tolerance": TOLERANCE,
        "layer_ids": args.layers,
        "tensor_parallel_size": args.tensor_parallel_size,
        "calls": [],
        "timings": {},
    }
    state: dict = {"phase": "import", "generator": None}
    started = time.monotonic()
    try:
        reference_path, numbers, batches = prepare_calls(args, report)

        from speculators.data_generation.vllm_hidden_states_generator import VllmHiddenStatesGenerator

        report["timings"]["import_s"] = round(time.monotonic() - started, 2)
        outputs = generate_calls(args, report, state, VllmHiddenStatesGenerator, numbers, batches)

        if args.dump:
            import torch

            torch.save({"batches": batches, "outputs": outputs}, args.dump)

        report["transfer"] = transfer_of(state["generator"])
        # vLLM's idle worker polls its queue and would slow the reference down: stop it first.
        state["phase"] = "shutdown"
        t0 = time.monotonic()
        state["generator"].executor.shutdown()
        state["generator"] = None
        report["timings"]["shutdown_s"] = round(time.monotonic() - t0, 2)

        compare_calls(args, report, state, reference_path, numbers, batches, outputs)
    except Exception as exc:  # the symptom is the result: report it  # noqa: BLE001
        report["error"] = error_record(exc, state["phase"])
        traceback.print_exc(file=sys.stderr)
    report.setdefault("planned_calls", 0)
    report["timings"]["total_s"] = round(time.monotonic() - started, 2)
    summarize(report)
    report["_generator"] = state["generator"]
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--layers", default="0,2,3", type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument(
        "--memory-utilization",
        type=float,
        default=0.1,
        help="the generator's gpu_memory_utilization: its KV cache takes 0.2 of this share of the "
        "free device memory (host memory on the CPU build, with v9); 0.1 is ample for the demo",
    )
    parser.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="ranks the model is split over: GPUs, or CPU processes on the CPU build (default 1)",
    )
    parser.add_argument(
        "--calls",
        default="all",
        help="which calls to run, in this order, e.g. 1,2; N:K is call N's first K prompts (default all)",
    )
    parser.add_argument(
        "--reference",
        help="transformers checkpoint of the same weights (default: the model's own, or the one its "
        "tiny-model.json names)",
    )
    parser.add_argument("--reference-device", default="cpu", help="where transformers runs (default cpu)")
    parser.add_argument(
        "--no-reference",
        metavar="REASON",
        help="compare with no transformers reference (the reason is reported): rows whole, in order, finite",
    )
    parser.add_argument(
        "--reference-optional",
        action="store_true",
        help="where transformers cannot load the reference, check the rows alone and say why",
    )
    parser.add_argument(
        "--noise", action="store_true", help="also measure transformers' own bfloat16 against float32 spread"
    )
    parser.add_argument("--report", help="also write the JSON report to this file")
    parser.add_argument("--dump", help="save the prompts and generate() results (torch.save) here")
    args = parser.parse_args()

    report = run(args)
    generator = report.pop("_generator")
    text = json.dumps(report)
    if args.report:
        with open(args.report, "w") as handle:
            handle.write(text + "\n")
    # vLLM's workers may still log while shutting down: the report goes out last.
    if generator is not None:
        try:
            generator.executor.shutdown()
        except Exception:  # noqa: BLE001, S110 - a failed shutdown must not hide the report
            pass
    sys.stderr.flush()
    sys.stdout.flush()
    sys.stdout.write(text + "\n")
    sys.stdout.flush()
    os._exit(0 if report["ok"] else 1)


if __name__ == "__main__":  # vLLM starts its workers with spawn
    main()
