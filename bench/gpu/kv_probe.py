"""On the GPU machine, after gpu_run.py: what the KV cache speculators' generator drives looks like
on Model Runner V2, patched with and without v28, step by step.

    python3 /tmp/run/kv_probe.py --out "$OUT" [--model /tmp/model] [--budget 300] [--variants with-v28,...]

gpu_run.py leaves /tmp/site installed and rolled back; each variant applies the patches (without
verification: gpu_run.py verified them), runs the tiny model's four generate() calls of
patcher/run_check/extract.py in a child with CUDA_LAUNCH_BLOCKING=1, and rolls back:
- with-v28: every patch; the KV cache is allocated whole (enable_extensible_kv_cache False);
- without-v28: the extensible KV cache as vLLM 0.34 resolves it, only its first granule backed
  (gpu_run.py --leave-out v28 --leave-out-calls 3 shows its end: not run unless --variants names it);
- without-v28-extended: the same, then the generator asks the workers to back all its blocks
  (executor.extend_kv_cache(num_blocks), what vLLM's engine core does after warm-up); its
  worker_after_init holds the facts without-v28 would show (blocks committed and backed).
The child records, before any step runs, the workers' KV cache (extensible or not, blocks
committed and backed, kernel block sizes, block table widths, the caches' shapes) and the
scheduler's (block size, blocks), then before every step the block ids the scheduler hands out
(new and continued requests, the highest id), tokens scheduled and computed: if a worker dies,
the last step recorded is the one that killed it. One file comes back: kv-probe.json.
Standard library only here; the child imports torch, vLLM and speculators from /tmp/site.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SITE = Path("/tmp/site")
WORK = Path("/tmp/kv-probe")
VARIANTS = {
    "with-v28": ([], False),
    "without-v28": (["--skip", "v28"], False),
    "without-v28-extended": (["--skip", "v28"], True),
}


def worker_facts(wrapper) -> dict:
    """In a worker (collective_rpc sends it): its KV cache as the model runner holds it."""
    import torch

    worker = getattr(wrapper, "worker", wrapper)
    runner = worker.model_runner
    cache_config = worker.vllm_config.cache_config
    out: dict = {
        "runner": f"{type(runner).__module__}.{type(runner).__qualname__}",
        "enable_extensible_kv_cache": getattr(cache_config, "enable_extensible_kv_cache", "absent"),
        "block_size": cache_config.block_size,
        "num_gpu_blocks": cache_config.num_gpu_blocks,
        "max_model_len": getattr(runner, "max_model_len", None),
        "max_num_reqs": getattr(runner, "max_num_reqs", None),
        "max_num_tokens": getattr(runner, "max_num_tokens", None),
        "kernel_block_sizes": [int(x) for x in getattr(runner, "kernel_block_sizes", None) or []],
        "mem_free_total": list(torch.cuda.mem_get_info()),
    }
    try:
        out["layout"] = str(cache_config.get_resolved_kv_cache_layout())
    except Exception as exc:  # noqa: BLE001
        out["layout"] = f"? {type(exc).__name__}: {exc}"
    config = getattr(runner, "kv_cache_config", None)
    if config is not None:
        out["kv_cache_config"] = {
            "num_blocks": config.num_blocks,
            "groups": [
                {
                    "block_size": g.kv_cache_spec.block_size,
                    "spec": type(g.kv_cache_spec).__name__,
                    "layers": len(g.layer_names),
                }
                for g in config.kv_cache_groups
            ],
            "tensors": [
                {k: getattr(t, k, None) for k in ("size", "offset", "layer_stride", "block_stride")}
                | {"layers": len(t.layers)}
                for t in config.kv_cache_tensors[:3]
            ],
            "num_tensors": len(config.kv_cache_tensors),
        }
    tables = getattr(runner, "block_tables", None)
    if tables is not None:
        out["block_tables"] = {
            "block_sizes": list(tables.block_sizes),
            "shapes": [list(t.gpu.shape) for t in tables.block_tables],
        }
    caches = getattr(runner, "kv_caches", None) or []
    out["kv_caches"] = {
        "count": len(caches),
        "first": [
            {
                "shape": list(c.shape),
                "stride": list(c.stride()),
                "dtype": str(c.dtype),
                "storage_bytes": c.untyped_storage().nbytes(),
            }
            for c in caches[:2]
        ],
    }
    extensible = getattr(runner, "extensible_kv_cache", None)
    if extensible is None:
        out["extensible"] = None
    else:
        granule = extensible.buffer.granularity
        committed = extensible.num_committed_blocks
        strides = list(extensible.segment_strides)
        # blocks a commit of `committed` really backs: each segment is mapped in whole granules
        backed = min((-(-committed * s // granule) * granule) // s for s in strides) if strides else 0
        out["extensible"] = {
            "capacity_blocks": extensible.capacity_blocks,
            "num_committed_blocks": committed,
            "backed_blocks_with_granule_rounding": backed,
            "granule_bytes": granule,
            "segments": len(strides),
            "segment_strides": strides[:4],
            "physical_bytes": extensible.physical_bytes,
        }
    return out


def step_facts(output) -> dict:
    """Before a step: what the scheduler hands the workers."""
    new = []
    highest = -1
    for req in output.scheduled_new_reqs:
        ids = [b for group in req.block_ids for b in group]
        highest = max([highest, *ids])
        new.append(
            {
                "req": req.req_id,
                "prompt_len": len(req.prompt_token_ids or req.prefill_token_ids or []),
                "computed": req.num_computed_tokens,
                "scheduled": output.num_scheduled_tokens.get(req.req_id),
                "blocks": len(ids),
                "max_block": max(ids, default=-1),
            }
        )
    cached = []
    reqs = output.scheduled_cached_reqs
    for index, req_id in enumerate(reqs.req_ids):
        added = reqs.new_block_ids[index]
        ids = [b for group in (added or ()) for b in group]
        highest = max([highest, *ids])
        cached.append(
            {
                "req": req_id,
                "computed": reqs.num_computed_tokens[index],
                "scheduled": output.num_scheduled_tokens.get(req_id),
                "new_blocks": len(ids),
                "max_block": max(ids, default=-1),
            }
        )
    return {
        "tokens": output.total_num_scheduled_tokens,
        "new": new,
        "cached": cached,
        "finished": len(output.finished_req_ids),
        "max_block": highest,
        "zero_blocks": len(getattr(output, "new_block_ids_to_zero", None) or []),
    }


def child(args) -> int:
    import traceback

    from transformers import AutoTokenizer

    from patcher.run_check.extract import config_vocab_size, make_batches

    report: dict = {"variant": args.variant, "extend": args.extend, "steps": [], "calls": [], "ok": False}
    path = Path(args.report)

    def save() -> None:
        path.write_text(json.dumps(report, indent=1, default=str) + "\n")

    generator = None
    phase = "init"
    try:
        tokenizer = AutoTokenizer.from_pretrained(args.model, trust_remote_code=True)
        batches = make_batches(tokenizer, config_vocab_size(args.model))
        from speculators.data_generation.vllm_hidden_states_generator import VllmHiddenStatesGenerator

        generator = VllmHiddenStatesGenerator(
            args.model, layer_ids=[0, 2, 3], max_model_len=1024, gpu_memory_utilization=0.1, tensor_parallel_size=1
        )
        config = generator.vllm_config
        scheduler = generator.scheduler
        report["driver"] = {
            "block_size": config.cache_config.block_size,
            "num_gpu_blocks": config.cache_config.num_gpu_blocks,
            "enable_extensible_kv_cache": getattr(config.cache_config, "enable_extensible_kv_cache", "absent"),
            "enable_prefix_caching": config.cache_config.enable_prefix_caching,
            "max_model_len": config.model_config.max_model_len,
            "max_num_batched_tokens": config.scheduler_config.max_num_batched_tokens,
            "scheduler_num_blocks": scheduler.kv_cache_config.num_blocks,
            "scheduler_block_size": getattr(scheduler, "block_size", None),
            "pool_blocks": scheduler.kv_cache_manager.block_pool.num_gpu_blocks,
            "groups": [
                {"block_size": g.kv_cache_spec.block_size, "spec": type(g.kv_cache_spec).__name__}
                for g in scheduler.kv_cache_config.kv_cache_groups
            ],
        }
        report["worker_after_init"] = generator.executor.collective_rpc(worker_facts)[0]
        save()
        if args.extend:
            phase = "extend"
            generator.executor.extend_kv_cache(scheduler.kv_cache_config.num_blocks)
            report["worker_after_extend"] = generator.executor.collective_rpc(worker_facts)[0]
            save()
        execute_model = generator.executor.execute_model
        current = {"call": 0}

        def recorded(output, *more, **named):
            step = step_facts(output)
            step["call"] = current["call"]
            report["steps"].append(step)
            save()
            print(f"step call {step['call']}: {json.dumps(step)[:600]}", flush=True)
            return execute_model(output, *more, **named)

        generator.executor.execute_model = recorded
        for number, prompts in enumerate(batches, 1):
            phase = f"generate {number}"
            current["call"] = number
            started = time.monotonic()
            results = generator.generate(prompts)
            rows = [int(r["hidden_states"][0].shape[0]) for r in results]
            finite = all(bool(h.float().isfinite().all()) for r in results for h in r["hidden_states"])
            report["calls"].append(
                {
                    "call": number,
                    "seconds": round(time.monotonic() - started, 2),
                    "rows_whole": rows == [len(p) for p in prompts],
                    "finite": finite,
                    "max_block": max((s["max_block"] for s in report["steps"] if s["call"] == number), default=-1),
                }
            )
            report[f"worker_after_call_{number}"] = {
                k: v
                for k, v in generator.executor.collective_rpc(worker_facts)[0].items()
                if k in ("extensible", "mem_free_total", "num_gpu_blocks")
            }
            save()
        report["ok"] = all(c["rows_whole"] and c["finite"] for c in report["calls"])
    except Exception as exc:  # noqa: BLE001  (the failure is the finding)
        report["error"] = {"phase": phase, "type": type(exc).__name__, "message": str(exc)[:1500]}
        report["traceback"] = traceback.format_exc()[-3000:]
    save()
    if generator is not None:
        try:
            generator.executor.shutdown()
        except Exception as exc:  # noqa: BLE001  (the report is written; say it and go)
            print(f"shutdown: {type(exc).__name__}: {exc}", flush=True)
    return 0 if report["ok"] else 1


def patcher(*args: str, env: dict) -> dict:
    command = [sys.executable, "-m", "patcher.cli", *args, "--python", sys.executable, "--json"]
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=tempfile.gettempdir(), timeout=300)
    return {"command": " ".join(args), "exit": done.returncode, "stderr": done.stderr[-600:]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/gpu-out")))
    parser.add_argument("--model", default="/tmp/model")
    parser.add_argument("--budget", type=int, default=300, help="seconds for all variants (default 300)")
    parser.add_argument("--variants", default="with-v28,without-v28-extended", help=f"of {', '.join(VARIANTS)}")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--variant", help=argparse.SUPPRESS)
    parser.add_argument("--extend", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--report", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args)

    unknown = sorted({v for v in args.variants.split(",") if v} - set(VARIANTS))
    if unknown:
        parser.error(f"--variants: unknown {', '.join(unknown)}; known: {', '.join(VARIANTS)}")
    started = time.monotonic()
    args.out.mkdir(parents=True, exist_ok=True)
    WORK.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=str(SITE), PYTHONUNBUFFERED="1", CUDA_LAUNCH_BLOCKING="1")
    env.setdefault("NCCL_NVLS_ENABLE", "0")
    probe: dict = {"variants": {}}
    result = args.out / "kv-probe.json"
    for name in [v for v in args.variants.split(",") if v]:
        skip, extend = VARIANTS[name]
        left = args.budget - (time.monotonic() - started)
        if left < 60:
            probe["variants"][name] = {"skipped": f"{left:.0f} s of the budget left"}
            continue
        entry: dict = {"apply": patcher("apply", "--no-verify", *skip, env=env)}
        report = WORK / f"{name}.json"
        report.unlink(missing_ok=True)
        command = [sys.executable, str(Path(__file__).resolve()), "--child", "--variant", name, "--report", str(report)]
        command += ["--model", args.model] + (["--extend"] if extend else [])
        print(f"== kv-probe {name}: {' '.join(command)}", flush=True)
        t0 = time.monotonic()
        try:
            done = subprocess.run(
                command, capture_output=True, text=True, env=env, cwd=tempfile.gettempdir(), timeout=max(30, left - 30)
            )
            code, output = done.returncode, done.stdout + done.stderr
        except subprocess.TimeoutExpired as error:
            code, output = 124, f"{error.stdout or ''}{error.stderr or ''}\ntimed out"
            output = output if isinstance(output, str) else output.decode(errors="replace")
        entry["exit"] = code
        entry["seconds"] = round(time.monotonic() - t0, 1)
        try:
            entry["report"] = json.loads(report.read_text())
        except (OSError, ValueError):
            entry["report"] = None
        # the worker's own last words (CUDA errors are printed, not raised)
        entry["output_tail"] = [
            line
            for line in output.splitlines()
            if any(k in line for k in ("CUDA error", "illegal", "Error", "error", "Extended KV", "Committed", "died"))
        ][-25:]
        entry["rollback"] = patcher("rollback", env=env)
        probe["variants"][name] = entry
        result.write_text(json.dumps(probe, indent=1, default=str) + "\n")
        rep = entry["report"] or {}
        worker = rep.get("worker_after_init") or {}
        print(
            f"   {name}: exit {code} in {entry['seconds']} s; ok {rep.get('ok')}; error {rep.get('error')}; "
            f"extensible {worker.get('enable_extensible_kv_cache')} {worker.get('extensible')}; "
            f"num_blocks {(worker.get('kv_cache_config') or {}).get('num_blocks')}; kernel block sizes "
            f"{worker.get('kernel_block_sizes')}; block tables {worker.get('block_tables')}; calls "
            f"{[(c['call'], c['rows_whole'], c['max_block']) for c in rep.get('calls', [])]}; last step max block "
            f"{(rep.get('steps') or [{}])[-1].get('max_block')}",
            flush=True,
        )
        for line in entry["output_tail"][-5:]:
            print(f"   | {line[:300]}", flush=True)
    probe["seconds"] = round(time.monotonic() - started, 1)
    result.write_text(json.dumps(probe, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
