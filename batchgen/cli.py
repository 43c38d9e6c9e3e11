"""Command line: ``python -m batchgen job CONFIG``, ``verify OUT``, ``demo``, ``make-model``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

# The demo's rows share a few-shot header several KV blocks long: its blocks are computed once and
# then found in the prefix cache, and each row's samples or beams share them copy-on-write.
DEMO_HEADER = (
    "You answer questions about batchgen in one short sentence.\n"
    "Q: What does batchgen turn a dataset of prompts into?\nA: A dataset of generations.\n"
    "Q: How does the engine keep the KV cache?\nA: In fixed-size blocks, shared copy-on-write.\n"
    "Q: Which sequences share blocks?\nA: Samples, beams and requests whose prompts start alike.\n"
)
DEMO_QUESTIONS = [
    "What keeps the batch full?",
    "What happens when blocks run out?",
    "What is two plus two?",
    "Translate to French: the cat sat on the mat.",
    "Who spoke in riddles and numbers?",
    "What does the quick brown fox jump over?",
    "Where does beam search run?",
    "What is a block table?",
]


def demo_rows(count: int = 64) -> list[dict]:
    """Rows of the demo dataset: sampled rows, every eighth a beam-search row (a per-row override),
    every sixteenth an empty prompt (a bad row: it gets an error and the job goes on)."""
    rows = []
    for i in range(count):
        question = DEMO_QUESTIONS[i % len(DEMO_QUESTIONS)]
        prompt = "" if i % 16 == 15 else f"{DEMO_HEADER}Q: {question}\nA:"
        params = {"beam_width": 3} if i % 8 == 3 else None
        rows.append({"id": f"row-{i:03d}", "prompt": prompt, "params": params})
    return rows


def cmd_job(args: argparse.Namespace) -> int:
    """Exit codes: 0 done, 1 the run failed (output not writable, input changed under it),
    2 refused before any work (config errors, another config's output, a directory in use),
    128 + signal number when SIGTERM / SIGINT stopped it (finished rows saved)."""
    from batchgen.job.config import ConfigError
    from batchgen.job.lifecycle import JobIncomplete, JobInterrupted, JobRefused
    from batchgen.job.local_replicas import ReplicaJobRunner, machine_plan
    from batchgen.job.preflight import load_job_config
    from batchgen.job.runner import JobRunner
    from batchgen.job.source import InputChanged
    from batchgen.job.store import OutputLocked, OutputUnavailable, OutputWriteError
    from batchgen.storage import StorageError

    try:
        cfg = load_job_config(args.config, args.set)
        if args.no_progress:
            from dataclasses import replace

            cfg = replace(cfg, run=replace(cfg.run, progress=False))
        runner = JobRunner
        if cfg.run.executor == "ray":
            try:
                import ray.data  # noqa: F401
            except ImportError:
                raise ConfigError(
                    "run.executor: ray needs Ray Data; install it with pip install -e '.[ray]' (or 'ray[data]')"
                ) from None
            from batchgen.job.ray_executor import RayJobRunner

            runner = RayJobRunner
        plan = machine_plan(cfg.run.replicas) if cfg.run.replicas != 1 and cfg.run.executor == "local" else []
        if len(plan) > 1:
            report = ReplicaJobRunner(cfg, args.config, args.set or [], plan, overwrite=args.overwrite).run()
        else:
            report = runner(cfg, overwrite=args.overwrite).run()
    except JobInterrupted as e:
        print(f"batchgen: {e}", file=sys.stderr)
        return e.exit_code
    except (ConfigError, JobRefused, OutputLocked, OutputUnavailable) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (OutputWriteError, InputChanged, JobIncomplete, StorageError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except ValueError as e:  # model directory problems and the like
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(report.render())
    how = ""
    if cfg.output.format == "parquet":
        how = "   (one dataset: pandas.read_parquet(path), datasets.load_dataset('parquet', data_dir=path))"
    print(f"  output                       {cfg.output.path}{how}")
    limit = cfg.run.max_failed_fraction
    if report.rows_in_output and report.failed_in_output > limit * report.rows_in_output:
        print(
            f"error: {report.failed_in_output} of {report.rows_in_output} rows failed, more than "
            f"run.max_failed_fraction ({limit}); the rows are kept in {cfg.output.path}",
            file=sys.stderr,
        )
        return 1
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    """Exit codes: 0 every input row exactly once in the output, 1 not, 2 cannot tell (no config)."""
    from batchgen.job.config import ConfigError
    from batchgen.job.verify import combined_report, verify
    from batchgen.storage import StorageError

    try:
        result = verify(args.out, args.config)
    except (ConfigError, ValueError, OSError, StorageError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(result.render())
    combined_report(args.out, result)
    return 0 if result.ok else 1


def ensure_demo_inputs(root: Path) -> None:
    from batchgen.tiny import make_model

    model = root / "models" / "demo"
    if not (model / "config.json").exists():
        print(f"building a small random-weight Llama model in {model} ...")
        make_model(
            model,
            "llama",
            seed=0,
            vocab_size=512,
            hidden_size=128,
            intermediate_size=256,
            num_layers=4,
            num_heads=4,
            num_kv_heads=2,
            max_positions=2048,
            initializer_range=0.05,
        )
    data = root / "data" / "demo.parquet"
    if not data.exists():
        import pyarrow as pa
        import pyarrow.parquet as pq

        data.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.Table.from_pylist(demo_rows()), data)


def cmd_demo(args: argparse.Namespace) -> int:
    import pyarrow.dataset as pads

    ensure_demo_inputs(Path.cwd())
    config = Path(args.config)
    if not config.exists():  # outside a checkout: the job that the package ships
        config = Path(__file__).resolve().parent / "demo.yaml"
    from batchgen.job.preflight import load_job_config

    out_dir = Path(load_job_config(str(config), args.set).output.path)
    if out_dir.exists():  # the demo always starts fresh
        import shutil

        shutil.rmtree(out_dir)
    ns = argparse.Namespace(config=str(config), set=args.set, overwrite=True, no_progress=False)
    rc = cmd_job(ns)
    if rc == 0:
        rows = sorted(pads.dataset(str(out_dir), format="parquet").to_table().to_pylist(), key=lambda r: r["id"])
        sampled = next(r for r in rows if not r["error"] and not r.get("params"))
        beams = next((r for r in rows if not r["error"] and r.get("params")), None)
        failed = next((r for r in rows if r["error"]), None)
        print(f"\nsome rows of {out_dir} (the text is gibberish: the model's weights are random):")
        for label, row in (("sampled, n=4", sampled), ("beam search, width 3", beams), ("a bad row", failed)):
            if row is None:
                continue
            prompt = "\n".join(row["prompt"].split("\n")[-2:])
            print(f"  {row['id']} ({label}): {'... ' if row['prompt'] else ''}{prompt!r}")
            if row["error"]:
                print(f"      error: {row['error']}")
            for c in row["completions"] or []:
                score = f"score {c['score']:.3f}  " if c["score"] is not None else ""
                print(f"      [{c['index']}] {score}{c['text'][:50]!r}")
    return rc


def cmd_make_model(args: argparse.Namespace) -> int:
    from batchgen.tiny import make_bench_model, make_bench_moe_model, make_model

    if args.bench:
        path = make_bench_moe_model(args.path) if args.arch == "qwen3_moe" else make_bench_model(args.path)
    else:
        path = make_model(args.path, args.arch, seed=args.seed)
    print(path)
    return 0


def _config_keys() -> str:
    """The job config's sections and keys with their defaults, for ``job --help``."""
    from dataclasses import MISSING, fields

    from batchgen.config import EngineConfig
    from batchgen.job.config import InputConfig, LoRAConfig, OutputConfig, RayConfig, RunConfig
    from batchgen.storage import StorageOptions

    def keys(cls, skip=()) -> str:
        out = []
        for f in fields(cls):
            if f.name in skip:
                continue
            if f.default is not MISSING:
                default = repr(f.default)
            else:
                default = "required" if f.default_factory is MISSING else repr(f.default_factory())
            out.append(f"{f.name}={default}")
        return ", ".join(out)

    return "\n".join(
        [
            "config keys (see the README's Jobs section; every problem is listed at once, exit 2):",
            "  model: a local Hugging Face model directory or a hub id, from the Hugging Face cache (required)",
            f"  input: {keys(InputConfig)}",
            f"  output: {keys(OutputConfig)}",
            "  task: generate (default) or score (each row's input.continuation_column scored after its prompt)",
            "  generation: SamplingParams (n, temperature, top_p, max_tokens, seed, logprobs, prompt_logprobs, "
            "thinking_token_budget, ...) or BeamSearchParams (beam_width, length_penalty, early_stopping, ...) "
            "keys; reasoning_parser (qwen3, deepseek_r1, gpt_oss); chat_template_kwargs (per row too); "
            "task score: logprobs and chat_template_kwargs only",
            f"  engine: {keys(EngineConfig, skip=('model',))}",
            f"  run: {keys(RunConfig)}",
            f"  ray (run.executor: ray): {keys(RayConfig)}",
            f"  lora (input.lora_column names one per row): {keys(LoRAConfig)}",
            f"  storage (s3:// paths; credentials from AWS_* variables, a profile or a role): {keys(StorageOptions)}",
            "exit codes: 0 done, 1 failed (output, input, too many failed rows), 2 refused before any "
            "work, 128 + signal when stopped by SIGTERM / SIGINT (finished rows saved)",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="batchgen", description="Offline batch generation on a paged engine."
    )
    from batchgen import __version__

    parser.add_argument("--version", action="version", version=f"batchgen {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    job = sub.add_parser(
        "job",
        help="run a job config (YAML or TOML)",
        epilog=_config_keys(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    job.add_argument("config")
    job.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config value, e.g. --set generation.max_tokens=32",
    )
    job.add_argument(
        "--overwrite", action="store_true", help="discard an output directory made with another config"
    )
    job.add_argument("--no-progress", action="store_true", help="no progress bar")
    job.set_defaults(func=cmd_job)
    ver = sub.add_parser(
        "verify",
        help="check that the shards of every worker cover each input row exactly once; write the combined report",
    )
    ver.add_argument("out", help="the job's output directory")
    ver.add_argument("--config", default=None, help="the job config (default: the one its manifests name)")
    ver.set_defaults(func=cmd_verify)
    demo = sub.add_parser("demo", help="build a small local model and prompts, then run jobs/demo.yaml")
    demo.add_argument("--config", default="jobs/demo.yaml")
    demo.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    demo.set_defaults(func=cmd_demo)
    mm = sub.add_parser("make-model", help="write a small random-weight model directory")
    mm.add_argument("path")
    from batchgen.tiny import ALL_ARCHS

    mm.add_argument("--arch", default="llama", choices=list(ALL_ARCHS))
    mm.add_argument("--seed", type=int, default=0)
    mm.add_argument(
        "--bench",
        action="store_true",
        help="the bench-56m model of docs/benchmarks.md (with --arch qwen3_moe: workload M's MoE model)",
    )
    mm.set_defaults(func=cmd_make_model)
    args = parser.parse_args(argv)
    return args.func(args)
