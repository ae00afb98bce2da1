"""The `capserve` command: dataset-scale capture into sharded safetensors, and `serve`.

    capserve capture prompts.jsonl --out acts/ --hooks blocks.6.hook_resid_post --positions all
    capserve serve --model meta-llama/Llama-3.1-8B --num-replicas 8
    capserve export acts/ --out acts-saelens/ --hooks blocks.6.hook_resid_post   # for SAELens

`capture` talks to a running app (`serve run serve_config.yaml` or `capserve serve`) through
its Serve handle (`--app`, `--address`) or its HTTP API (`--http URL`). Rerunning the same
command with the same `--out` resumes. Exit status: 0 complete, 1 a line or the run failed
(finished shards are kept; rerun to resume), 2 bad arguments, input or output folder, 130
interrupted.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from provider.dataset.input import InputError, detect_format
from provider.dataset.options import SINKS

DTYPE_CHOICES = ("float32", "float16", "bfloat16")
POSITION_MODES = ("all", "prompt", "generated", "last_prompt")
EPILOG = """\
input: JSONL with one of "text", "prompt_token_ids" or "messages" per line (an optional "id" is
  kept in the index), or plain text, one prompt per line. Blank lines are skipped.
output: DIR/shard-NNNNNN.safetensors (one [rows, d_model] tensor per hook, plus row -> line,
  position and token id), DIR/shard-NNNNNN.jsonl (one record per line) and DIR/manifest.json.
  Load with: from provider.client import load_capture; cap = load_capture(DIR); cap[hook][i]
resume: rerun the same command; finished shards are kept, the rest is captured.
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="capserve", description="Activation capture at fleet scale on a capserve app.")
    commands = parser.add_subparsers(dest="command", required=True)
    _capture_parser(commands)
    _serve_parser(commands)
    _export_parser(commands)
    return parser


def _capture_parser(commands: Any) -> None:
    p = commands.add_parser(
        "capture", help="capture activations of every prompt in a file into sharded safetensors",
        description="Capture activations of every prompt in INPUT into sharded safetensors in --out.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("input", type=Path, help="JSONL or plain-text prompts, one per line")
    p.add_argument("--out", required=True, help="output folder or fsspec URL, e.g. s3://bucket/acts (created; reused to resume)")
    p.add_argument("--hooks", required=True, help="comma-separated hook names, e.g. blocks.6.hook_resid_post,ln_final.hook_normalized")
    p.add_argument("--positions", default="all", help="all | prompt | generated | last_prompt | comma-separated ints "
                   "(negative count back from the prompt's end; write --positions=-2,-1); default all")
    p.add_argument("--reduce", choices=("none", "mean"), default="none", help="mean: one row per prompt, averaged over positions")
    p.add_argument("--dtype", choices=DTYPE_CHOICES, default="float32", help="dtype stored (default float32)")
    p.add_argument("--max-tokens", type=int, default=0, help="tokens to generate; 0 (default) runs the prompt only")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature when --max-tokens > 0 (default 0: greedy)")
    where = p.add_argument_group("where the app is")
    where.add_argument("--app", default="capserve", help="Serve application name (default capserve)")
    where.add_argument("--address", default=None, help="Ray cluster address (default: RAY_ADDRESS, else auto)")
    where.add_argument("--http", metavar="URL", default=None, help="use the HTTP API at URL instead of the Serve handle")
    where.add_argument("--api-key", default=None, help="bearer token for --http (default: CAPSERVE_API_KEY)")
    run = p.add_argument_group("how to run")
    run.add_argument("--shard-lines", "--shard-rows", dest="shard_lines", type=int, default=1024,
                     help="input lines per shard (default 1024); shard k holds lines [k*N, (k+1)*N)")
    run.add_argument("--concurrency", type=int, default=64, help="requests in flight (default 64)")
    run.add_argument("--retries", type=int, default=8, help="retries per line on transient failures (default 8)")
    run.add_argument("--skip-invalid", action="store_true", help="record a line the app rejects as invalid and go on")
    run.add_argument("--sink", choices=SINKS, default="auto",
                     help="who writes the shards: replica (each replica writes its own; needs --out reachable from "
                          "the replicas), driver (this process), auto (default: replica when the app runs on this "
                          "node and --out is a local folder, else driver)")
    run.add_argument("--shards-in-flight", type=int, default=0,
                     help="--sink replica: shard jobs in flight, captured or being written (default 0: enough for "
                          "--concurrency and 2 per replica, widened to what the replicas hold: sink.max_unwritten each)")
    run.add_argument("--format", choices=("auto", "jsonl", "text"), default="auto", help="input format (default: by suffix/content)")
    run.add_argument("--no-progress", action="store_true", help="no progress bar")


def _serve_parser(commands: Any) -> None:
    p = commands.add_parser(
        "serve", help="run the app: `serve run serve_config.yaml` with overrides",
        description="Run the capserve app in the foreground (`serve run` on serve_config.yaml with these overrides).",
    )
    p.add_argument("--config", type=Path, default=Path("serve_config.yaml"),
                   help="Serve config (default ./serve_config.yaml; built-in defaults when it does not exist)")
    p.add_argument("--model", default=None, help="HF folder or hub name (default: the config's, or the tiny built-in model)")
    p.add_argument("--num-replicas", default=None, help="engine replicas, or auto (one per GPU; 2 on CPU)")
    p.add_argument("--device", choices=("auto", "cpu", "gpu"), default=None)
    p.add_argument("--name", default=None, help="application name (default capserve)")
    p.add_argument("--host", default=None, help="HTTP host (default from the config: 127.0.0.1)")
    p.add_argument("--port", type=int, default=None, help="HTTP port (default from the config: 8000)")
    p.add_argument("--address", default=None, help="Ray cluster to run on (default: start a local one)")
    p.add_argument("--dry-run", action="store_true", help="print the config and the command instead of running")


def _export_parser(commands: Any) -> None:
    from provider.dataset.saelens_export import EXPORT_DTYPES, LAYOUTS

    p = commands.add_parser(
        "export", help="convert a capture folder into the dataset SAELens trains from",
        description="Convert a `capserve capture` folder into SAELens's cached-activations dataset "
                    "(LanguageModelSAERunnerConfig(use_cached_activations=True, cached_activations_path=OUT)). "
                    "Needs the `datasets` package: run it where SAELens is installed. See docs/saelens.md.",
    )
    p.add_argument("capture", type=Path, help="a complete `capserve capture --out` folder")
    p.add_argument("--out", type=Path, required=True, help="new folder for the dataset (must not exist, or be empty)")
    p.add_argument("--format", choices=("saelens",), default="saelens", help="output layout (default saelens)")
    p.add_argument("--hooks", default=None, help="comma-separated hooks to export, one column each (default: every captured hook)")
    p.add_argument("--context-size", type=int, default=None,
                   help="rows per sequence, SAELens's context_size (default: the rows per line, when every line has the same)")
    p.add_argument("--layout", choices=LAYOUTS, default="exact",
                   help="exact: each line is one sequence of --context-size rows; truncate: each line's first "
                        "--context-size rows; pack: all rows cut into sequences across lines (default exact)")
    p.add_argument("--dtype", choices=EXPORT_DTYPES, default="float32", help="stored dtype (default float32)")


# ---------------------------------------------------------------- capture


def parse_positions(text: str) -> str | tuple[int, ...]:
    if text in POSITION_MODES:
        return text
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise ValueError(f"--positions {text!r}: use one of {', '.join(POSITION_MODES)} or comma-separated ints like 0,-1") from None


def capture_options(args: argparse.Namespace, input_format: str) -> Any:
    from provider.dataset.options import CaptureOptions

    hooks = tuple(h.strip() for h in args.hooks.split(",") if h.strip())
    return CaptureOptions(
        hooks=hooks, positions=parse_positions(args.positions), reduce=args.reduce, dtype=args.dtype,
        max_tokens=args.max_tokens, temperature=args.temperature, shard_lines=args.shard_lines,
        input_format=input_format, concurrency=args.concurrency, retries=args.retries, skip_invalid=args.skip_invalid,
        sink=args.sink, shards_in_flight=args.shards_in_flight,
    )


def make_backend(args: argparse.Namespace) -> Any:
    from provider.dataset.backends import HandleBackend, HttpBackend

    if args.http:
        api_key = args.api_key or os.environ.get("CAPSERVE_API_KEY")
        return HttpBackend(args.http, api_key, connections=args.concurrency)
    return HandleBackend(args.app, args.address)


def cmd_capture(args: argparse.Namespace) -> int:
    from provider.dataset.manifest import ManifestMismatch
    from provider.dataset.options import LineFailed, SinkUnreachable
    from replicas.api.errors import InvalidRequestError

    if not args.input.is_file():
        return _fail(f"input {args.input} is not a file", 2)
    try:
        options = capture_options(args, detect_format(args.input) if args.format == "auto" else args.format)
    except ValueError as exc:
        return _fail(f"bad arguments: {exc}", 2)
    backend = make_backend(args)
    try:
        backend.connect()
        summary = asyncio.run(_run(args, options, backend))
    except (InputError, ManifestMismatch, SinkUnreachable, InvalidRequestError, ConnectionError, LookupError) as exc:
        return _fail(str(exc), 2)
    except LineFailed as exc:
        return _fail(f"{exc}\nFinished shards are kept; rerun the same command to resume.", 1)
    except KeyboardInterrupt:
        return _fail("interrupted; finished shards are kept, rerun the same command to resume", 130)
    print(summary.text(args.out), file=sys.stderr)
    return 0 if summary.complete else 1


async def _run(args: argparse.Namespace, options: Any, backend: Any) -> Any:
    from provider.dataset.run import run_capture

    try:
        return await run_capture(args.input, args.out, options, backend, progress=not args.no_progress)
    finally:
        await backend.close()


# ---------------------------------------------------------------- export


def cmd_export(args: argparse.Namespace) -> int:
    from provider.dataset.saelens_export import ExportError, export_saelens

    hooks = [h.strip() for h in args.hooks.split(",") if h.strip()] if args.hooks else None
    try:
        plan = export_saelens(args.capture, args.out, hooks, args.context_size, args.layout, args.dtype)
    except ExportError as exc:
        return _fail(str(exc), 2)
    columns = ", ".join(f"{c} d_in {plan.d_in[h]}" for h, c in zip(plan.hooks, plan.columns))
    print(f"capserve export: {plan.sequences} sequences x {plan.context_size} rows ({columns}; layout {plan.layout}, "
          f"{plan.dtype}; {plan.rows_dropped} rows left out) -> {args.out}", file=sys.stderr)
    return 0


# ---------------------------------------------------------------- serve


def serve_config(args: argparse.Namespace) -> dict[str, Any]:
    """The config `serve run` gets: the file's (or a minimal one), with the flags applied."""
    import yaml

    if args.config.is_file():
        config = yaml.safe_load(args.config.read_text()) or {}
    else:
        config = {"applications": [{"name": "capserve", "route_prefix": "/", "import_path": "deploy.app:build_app"}]}
    app = config["applications"][0]
    app_args = app.get("args") or {}
    for key, value in (("model", args.model), ("device", args.device), ("num_replicas", _replicas(args.num_replicas))):
        if value is not None:
            app_args[key] = value
    app["args"] = app_args
    if args.name:
        app["name"] = args.name
    http = config.get("http_options") or {}
    for key, value in (("host", args.host), ("port", args.port)):
        if value is not None:
            http[key] = value
    if http:
        config["http_options"] = http
    return config


def _replicas(value: str | None) -> int | str | None:
    return int(value) if value is not None and value != "auto" else value


def serve_command(config_path: Path, address: str | None) -> list[str]:
    serve_bin = shutil.which("serve", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    command = [serve_bin or "serve", "run", str(config_path)]
    return command + (["--address", address] if address else [])


def cmd_serve(args: argparse.Namespace) -> int:
    import yaml

    text = yaml.safe_dump(serve_config(args), sort_keys=False)
    if args.dry_run:
        print(text + "# " + " ".join(serve_command(Path("<this config>"), args.address)))
        return 0
    # A file `serve run` can read; it must outlive this process, which exec replaces.
    path = Path(tempfile.mkdtemp(prefix="capserve-serve-")) / "serve_config.yaml"
    path.write_text(text)
    command = serve_command(path, args.address)
    print(f"capserve serve: {' '.join(command)}", file=sys.stderr)
    if os.path.isabs(command[0]):
        os.execv(command[0], command)
    os.execvp(command[0], command)
    return 0  # not reached


# ---------------------------------------------------------------- entry point


def _fail(message: str, code: int) -> int:
    print(f"capserve: {message}", file=sys.stderr)
    return code


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "capture":
        return cmd_capture(args)
    if args.command == "export":
        return cmd_export(args)
    return cmd_serve(args)


if __name__ == "__main__":
    sys.exit(main())
