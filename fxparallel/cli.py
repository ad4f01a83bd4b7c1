"""Command line: ``fxparallel plan MODEL --tp N`` prints the sharding plan without any process group.

MODEL is a hub id (only its config is fetched), a local checkpoint directory, or a
config.json path. ``--sp`` plans sequence parallelism on top, ``--ep`` / ``--no-ep`` whole or split experts
(default: the planner's choice). Exit codes: 0 done, 1 the library refused the input (a one-line message on
stderr, no traceback), 2 bad command line.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

from .errors import FxParallelError

DTYPES = ("float32", "bfloat16", "float16")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fxparallel", description="Automatic tensor parallelism for Hugging Face "
                                     "causal LMs, planned from the FX graph.")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    plan = commands.add_parser(
        "plan", help="print the sharding plan of a model (no GPU, no process group, no weights)",
        description="Capture the model on the meta device and print the placement of every parameter (grouped by "
                    "layer pattern), each collective with its bytes per token, parameter memory per rank, and what "
                    "is left replicated and why.")
    plan.add_argument("model", metavar="MODEL", help="hub id, local checkpoint directory, or config.json path")
    plan.add_argument("--tp", type=_positive_int, required=True, help="tensor-parallel size")
    plan.add_argument("--sp", action="store_true", help="sequence parallelism: activations outside attention and "
                      "MLP sharded along the sequence (reduce-scatter / all-gather instead of all-reduce)")
    plan.add_argument("--ep", action=argparse.BooleanOptionalAction, default=None,
                      help="expert parallelism: whole experts of each mixture-of-experts layer per rank (--ep) or a "
                      "slice of every expert (--no-ep); default: the planner's choice (whole experts with "
                      "transformers' grouped_mm experts kernel, its default off CPU)")
    plan.add_argument("--dtype", choices=DTYPES, default=None, help="parameter dtype (default: the config's, else "
                      "float32)")
    plan.add_argument("--layers", type=_positive_int, default=None, metavar="K",
                      help="override num_hidden_layers (a quick look at a deep model)")
    plan.add_argument("--json", metavar="PATH", default=None, help="also write the plan as JSON to PATH")
    plan.add_argument("--revision", default=None, help="hub revision (branch, tag or commit)")
    plan.add_argument("--trust-remote-code", action="store_true", help="allow a model's own code from the hub")
    return parser


def override_layers(config, layers: int) -> None:
    """Set num_hidden_layers and resize per-layer lists (e.g. ``layer_types``) by repeating their pattern."""
    old = getattr(config, "num_hidden_layers", None)
    if old is None:
        raise FxParallelError(f"--layers: config {type(config).__name__} has no num_hidden_layers to override")
    for key, value in list(vars(config).items()):
        if isinstance(value, (list, tuple)) and len(value) == old and old > 0 and key != "architectures":
            resized = [value[i % old] for i in range(layers)]
            setattr(config, key, type(value)(resized))
    config.num_hidden_layers = layers


def _plan(args):
    from .api import plan_model
    from .load import resolve_dtype, resolve_source
    from .load.source import StrictDataclassError, invalid_config_error

    source = resolve_source(args.model, revision=args.revision, trust_remote_code=args.trust_remote_code)
    config = source.config
    try:
        if args.layers is not None:
            override_layers(config, args.layers)
        dtype = resolve_dtype(args.dtype) if args.dtype else None
        plan, _ = plan_model(config, args.tp, dtype=dtype, trust_remote_code=args.trust_remote_code,
                             sequence_parallel=args.sp, expert_parallel=args.ep)
    except StrictDataclassError as err:  # transformers refused a value (e.g. set by --layers)
        raise invalid_config_error(err, repr(args.model), getattr(config, "model_type", None),
                                   type(config).__name__, list(config.to_dict())) from err
    return plan


def one_line(err: Exception) -> str:
    """The error's message on one line (the CLI prints one line per error, never a traceback)."""
    return " ".join(line.strip() for line in str(err).splitlines() if line.strip()) or type(err).__name__


def run_plan(args) -> int:
    if "TRANSFORMERS_VERBOSITY" not in os.environ:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
    start = time.perf_counter()
    try:
        plan = _plan(args)
    except FxParallelError as err:
        print(f"fxparallel: error: {one_line(err)}", file=sys.stderr)
        return 1
    print(plan)
    if args.json:
        try:
            plan.save(args.json)
        except OSError as err:
            print(f"fxparallel: error: cannot write --json {args.json!r}: {err}", file=sys.stderr)
            return 1
        print(f"plan written to {args.json}", file=sys.stderr)
    print(f"planned in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    return 0


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "plan":
        try:
            return run_plan(args)
        except BrokenPipeError:  # e.g. piped into `head`: stop quietly
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 1
    parser.print_help(sys.stderr)
    return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
