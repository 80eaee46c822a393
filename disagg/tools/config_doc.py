"""docs/configuration.md, made from the argparse definitions of `disagg serve`, the router
and both workers, with every flag grouped by what it is for.

    python -m disagg.tools.config_doc --write   # rewrite docs/configuration.md
    python -m disagg.tools.config_doc           # print it

tests/test_config_doc.py fails when the file and this output differ. A new flag lands in
the group PURPOSES names it in, else in one its name's prefix picks, else in "Other flags":
name it in PURPOSES when you add it.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from dataclasses import dataclass
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
COMMAND = "python -m disagg.tools.config_doc --write"

# (short name used in the tables, the command a user types)
PROGRAMS = (
    ("serve", "disagg serve"),
    ("router", "python -m router"),
    ("prefill", "python -m prefill_worker"),
    ("decode", "python -m decode_worker"),
)

# Each group: (title, one line on what it covers, the flags in it, in the order shown).
PURPOSES: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("Model and dtype", "Which checkpoint, which backend and device, which dtype, how long a sequence may be.",
     ("--model", "--backend", "--device", "--dtype", "--max-seq-len")),
    ("Memory and batching", "How many sequences a decode worker runs together and the memory their KV blocks get.",
     ("--batch-size", "--max-batch-size", "--kv-cache-gib", "--block-size", "--lease-seconds")),
    ("KV transport", "How a prompt's KV moves from the prefill worker to the decode worker.",
     ("--kv-transport", "--nixl-backend", "--kv-piece-bytes", "--stream-kv", "--no-stream-kv", "--kv-staging-buffers")),
    ("Prefix caching", "Reusing the KV of prompts' shared leading blocks, and routing a prompt to where its prefix is.",
     ("--prefix-caching", "--prefix-cache-gib")),
    ("Workers and routing", "Which workers there are, how the router finds them, and running both phases in one worker.",
     ("--prefill-workers", "--decode-workers", "--colocated", "--prefill", "--decode", "--resolve-seconds")),
    ("Requests, queueing and the HTTP API", "Limits on requests, the admission queue, and the OpenAI-compatible HTTP edge.",
     ("--http-port", "--http-max-body-bytes", "--http-timeout-seconds", "--default-max-new-tokens", "--max-new-tokens-cap", "--max-queue")),
    ("Speed on CPU and GPU (torch backend)", "Threads, CPU pinning, the compiled and native steps, buckets, async mode.",
     ("--threads", "--device-cpus", "--decode-nice", "--bind-compute-threads", "--no-async", "--compile", "--prepack", "--share-weights", "--native-step",
      "--batch-buckets", "--token-buckets", "--global-topk")),
    ("Quantization", "Weights and KV blocks in fewer bits.", ()),
    ("Speculative decoding", "Proposing several tokens per step and verifying them in one.", ()),
    ("Structured output", "Grammars, JSON schemas and tool calls.", ("--max-constraint-chars", "--constraint-compile-seconds")),
    ("Neuron backend (NxD Inference)", "Trn1, Inf2 and Trn2: NeuronCores per worker, buckets, compiled artifacts, settings files (docs/neuron.md).",
     ("--tp", "--prefill-tp", "--decode-tp", "--neuron-cores", "--tp-degree", "--context-buckets", "--neuron-compiled-path",
      "--k-cache-transposed", "--worker-config", "--serving-properties")),
    ("Network, TLS and tokens", "Where each server listens, mutual TLS between the parts, TLS and a bearer token on the public API.",
     ("--host", "--bind-all", "--port", "--tls-cert", "--tls-key", "--tls-ca", "--tls-server-name", "--public-tls-cert", "--public-tls-key",
      "--auth-token")),
    ("Supervision and failures", "What `disagg serve` does when a part dies or is slow to start, and how long a request waits for a worker.",
     ("--restart-limit", "--restart-window", "--start-silence", "--worker-wait-seconds")),
    ("Logs, metrics, start-up and shutdown", "Logging, Prometheus, files a launcher reads, draining on SIGTERM.",
     ("--log-level", "--metrics-port", "--port-file", "--status-file", "--grace-seconds")),
)
# A flag PURPOSES does not name goes by its name's start, where one fits.
PREFIXES = (
    ("--quantiz", "Quantization"), ("--kv-cache-dtype", "Quantization"),
    ("--speculative", "Speculative decoding"), ("--num-speculative", "Speculative decoding"), ("--draft", "Speculative decoding"),
    ("--structured", "Structured output"), ("--grammar", "Structured output"), ("--guided", "Structured output"), ("--tool", "Structured output"),
    ("--restart", "Supervision and failures"), ("--max-restarts", "Supervision and failures"), ("--start", "Supervision and failures"),
    ("--chaos", "Supervision and failures"), ("--supervis", "Supervision and failures"),
    ("--http", "Requests, queueing and the HTTP API"), ("--tls", "Network, TLS and tokens"), ("--neuron", "Neuron backend (NxD Inference)"),
)
OTHER = "Other flags"
# Where argparse has no help text: what the flag does, in one line.
NO_HELP = {
    "--log-level": "logging level: DEBUG, INFO, WARNING, ERROR ($DISAGG_LOG_LEVEL, else INFO)",
    "--backend": "torch (CPU, CUDA) or neuron (NxD Inference on Trn1, Inf2, Trn2; docs/neuron.md)",
    "--prefill-workers": "prefill worker processes to start",
    "--decode-workers": "decode worker processes to start",
    "--default-max-new-tokens": "tokens generated when a request sets no limit (gRPC max_new_tokens 0, chat's max_tokens unset)",
    "--max-new-tokens-cap": "the most tokens one request may ask for",
    "--k-cache-transposed": "NxDI's k_cache_transposed KV layout",
}
# How a flag's value type reads in the table (argparse's type functions by name).
TYPE_NAMES = {"int": "int", "float": "float", "cpu_list": "CPUs: 1, 0,2 or 2-3", "bucket_list": "sizes: 128,512,2048"}
# The first lines of the page; the index below them is made from QUICK.
HEADER = f"""# Configuration

What this answers: every flag of `disagg serve`, the router and both workers, grouped by
what it is for, with its default and the programs that take it.

Generated from the argparse definitions by `{COMMAND}`; do not edit it by
hand (`tests/test_config_doc.py` fails when the two differ). The descriptions are the
programs' own `--help` texts; the few flags without one get a line from the generator.

Programs: **serve** is `disagg serve` (`./run.sh serve`: the router and one worker of each
kind on one machine; it passes `--dtype`, `--batch-size`, `--threads`, `--kv-transport`,
`--max-seq-len`, `--block-size`, `--prefix-caching`, `--kv-cache-gib` and `--prefix-cache-gib` on to the parts), **router** is
`python -m router` (`disagg-router`), **prefill** is `python -m prefill_worker`
(`disagg-prefill-worker`), **decode** is `python -m decode_worker` (`disagg-decode-worker`).
A worker flag that `disagg serve` lacks is set by running the parts yourself
([README](../README.md#running-the-parts-on-separate-machines)).
"""
# (what a user wants to set, the flag): the page's index; each flag must exist.
QUICK = (
    ("the model", "--model"),
    ("the dtype", "--dtype"),
    ("the KV transport (NIXL or gRPC)", "--kv-transport"),
    ("the batch size (decode slots)", "--batch-size"),
    ("the KV cache memory", "--kv-cache-gib"),
    ("the context length", "--max-seq-len"),
    ("prefix caching", "--prefix-caching"),
    ("the threads and CPUs", "--threads"),
    ("the compiled decode step", "--compile"),
    ("the workers the router uses", "--prefill"),
    ("the OpenAI HTTP port", "--http-port"),
    ("TLS and the bearer token", "--auth-token"),
    ("Prometheus metrics", "--metrics-port"),
    ("NeuronCores per worker", "--tp"),
)


# The CPU kernels' overrides: environment variables, not flags (each worker reads them at its first product; a
# value no build takes ends its start-up in one line, small_gemm.BadKernelSetting). Each: (variable, values, what).
KERNEL_VARIABLES = (
    ("DISAGG_F32_KERNEL", "avx512, avx2", "the float32 panels' build; default: the faster here at first use"),
    ("DISAGG_BF16_KERNEL", "dot, widen-avx512, widen", "the bf16 panels' build; default: the fastest here that the CPU runs"),
    ("DISAGG_INT8_KERNEL", "vnni, dot, widen", "`--quantization int8`'s build; default: the fastest here"),
    ("DISAGG_W8A8_KERNEL", "vnni, avxvnni, avx2", "`--quantization w8a8_int8`'s build; default: the fastest here"),
    ("DISAGG_PAIR_FROM", "a number of rows, 2 or more", "where the AVX-512 float32 blocks read their panels two at a time; "
     "default: from 2 or from 16, the faster here over 8 rows (the same bits either way)"),
    ("DISAGG_F32_WEIGHTS", "bf16, float32", "a float32 model whose weights are all bf16 numbers holds them in bf16 "
     "(the same products from half the bytes) unless float32"),
)


@dataclass(frozen=True)
class Flag:
    names: str  # as the table shows them: `--prefix-caching`, `--no-prefix-caching`
    key: str  # the first long option: what PURPOSES names
    values: str  # the choices or the metavar, '' for a switch
    default: str
    help: str


@contextlib.contextmanager
def without_disagg_environment():
    """Some defaults come from DISAGG_* variables (ports, the log level, the token): the page
    shows the code's own, whatever the environment of whoever runs this."""
    saved = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith("DISAGG_")}
    try:
        yield
    finally:
        os.environ.update(saved)


def parsers() -> dict[str, argparse.ArgumentParser]:
    """Each program's parser, built without parsing or starting anything."""
    from decode_worker.__main__ import build_parser as decode_parser
    from disagg.cli.main import add_serve_parser
    from prefill_worker.__main__ import build_parser as prefill_parser
    from router.__main__ import build_parser as router_parser

    with without_disagg_environment():
        sub = argparse.ArgumentParser(prog="disagg").add_subparsers()
        add_serve_parser(sub)
        return {"serve": sub.choices["serve"], "router": router_parser(), "prefill": prefill_parser(), "decode": decode_parser()}


def flags(parser: argparse.ArgumentParser) -> list[Flag]:
    out = []
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction) or action.help == argparse.SUPPRESS or not action.option_strings:
            continue
        key = next(s for s in action.option_strings if s.startswith("--"))
        help_text = action.help or NO_HELP.get(key, "")
        if "%(" in help_text:
            help_text = help_text % {**vars(action), "prog": parser.prog}
        out.append(Flag(names=", ".join(f"`{s}`" for s in action.option_strings), key=key, values=values(action),
                        default=default(action), help=help_text))
    return out


def values(action: argparse.Action) -> str:
    if action.nargs == 0:
        return ""
    if action.choices is not None:
        choices = list(action.choices)
        if isinstance(action.choices, range) and len(choices) > 5:
            return f"{choices[0]}-{choices[-1]}"
        return " | ".join(str(c) for c in choices)
    if action.metavar:
        return str(action.metavar)
    name = getattr(action.type, "__name__", "")
    return TYPE_NAMES.get(name) or TYPE_NAMES.get(name.rsplit("_", 1)[-1], "text")  # positive_int reads as int


def default(action: argparse.Action) -> str:
    value = action.default
    if isinstance(action, argparse.BooleanOptionalAction):
        return "—" if value is None else "on" if value else "off"
    if action.nargs == 0:  # a switch: given or not
        return "—" if value is None else "not given"
    if value is None:
        return "—"
    if isinstance(value, list):
        return "none" if not value else ", ".join(map(str, value))
    return f"`{value}`"


def purpose_of(key: str) -> str:
    for title, _, names in PURPOSES:
        if key in names:
            return title
    for prefix, title in PREFIXES:
        if key.startswith(prefix):
            return title
    return OTHER


def order_in(title: str, key: str) -> int:
    names = next((names for t, _, names in PURPOSES if t == title), ())
    return names.index(key) if key in names else len(names)


def cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def anchor(title: str) -> str:
    import re

    return re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")


def generate() -> str:
    rows: dict[str, list[tuple[Flag, list[str]]]] = {}
    for program, parser in parsers().items():
        for flag in flags(parser):
            group = rows.setdefault(purpose_of(flag.key), [])
            same = next((row for row in group if row[0] == flag), None)
            if same is not None:
                same[1].append(program)
            else:
                group.append((flag, [program]))
    known = {flag.key for group in rows.values() for flag, _ in group}
    missing = [name for _, name in QUICK if name not in known]
    assert not missing, f"QUICK names flags no program has: {missing}"

    titles = [title for title, _, _ in PURPOSES if title in rows] + ([OTHER] if OTHER in rows else [])
    lines = [HEADER, "## Where to set what", "", "| to choose | flag | section |", "|---|---|---|"]
    for what, name in QUICK:
        title = purpose_of(name)
        lines.append(f"| {what} | `{name}` | [{title}](#{anchor(title)}) |")
    lines.append("")
    notes = {title: note for title, note, _ in PURPOSES} | {OTHER: "Flags no group above names yet."}
    for title in titles:
        lines += [f"## {title}", "", notes[title], "", "| flag | values | default | on | what it does |", "|---|---|---|---|---|"]
        group = sorted(rows[title], key=lambda row: order_in(title, row[0].key))
        for flag, programs in group:
            lines.append(f"| {flag.names} | {cell(flag.values)} | {flag.default} | {', '.join(programs)} | {cell(flag.help)} |")
        lines.append("")
    lines += ["## CPU kernels (environment variables)", "",
              "Which build of the CPU kernels the workers use is measured at each worker's first product and logged; these name one "
              "instead (benchmarks, a host where the measurement misleads). A value no build takes ends the worker's start-up with one line.",
              "", "| variable | values | what it sets |", "|---|---|---|"]
    lines += [f"| `{variable}` | {cell(values)} | {cell(what)} |" for variable, values, what in KERNEL_VARIABLES]
    lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m disagg.tools.config_doc", description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help=f"rewrite {DOC.relative_to(DOC.parents[1])} instead of printing it")
    args = parser.parse_args(argv)
    text = generate()
    if args.write:
        DOC.write_text(text)
        print(f"wrote {DOC}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
