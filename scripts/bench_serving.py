"""Serving benchmark: throughput and latency of ``medusa-serve`` with speculation on and off.

For each method (the speculative one with its speculation gate measuring, then with the gate off,
then ``autoregressive``) the script starts a server on 127.0.0.1 in a subprocess, sends
``--requests`` streamed chat requests at each concurrency level (at most that many in flight), and
measures per request the time to first token (TTFT), the time per output token after the first
(TPOT) and the end-to-end latency; per level the output throughput, the mean number of rows in a
decoding step's forward and the share of steps the gate made plain. Requests are greedy unless
``--temperatures`` says otherwise (request i takes the i-th temperature, round robin; 0 is greedy), and
every greedy request must get the same text from every method: the table says whether it did.

    python scripts/bench_serving.py --method lookup --requests 16 --max-tokens 64 --output bench.json
    python scripts/bench_serving.py --method medusa --heads runs/demo/heads --output bench.json
    python scripts/bench_serving.py --method lookup --temperatures 0 0.4 0.7 1 --ignore-eos --output mixed.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import numpy as np

from medusa_infer.serving.testing import metric_value

PROMPTS = [
    "What is the capital of France?",
    "Repeat this sentence exactly: The quick brown fox jumps over the lazy dog near the river bank.",
    "Write a Python function that returns the factorial of a number.",
    "Summarize in one sentence: Speculative decoding lets a small proposer suggest several tokens that "
    "the large model then checks in a single forward pass, so more than one token can be produced per step.",
    "List three fruits that are red.",
    "Fix the spelling in this sentence: I recieved the pakage yesterday and it was definately broken.",
    "Explain what a hash table is in two sentences.",
    "Translate to French: Good morning, how are you today?",
    "Rewrite this in the past tense: She walks to the market, buys bread and comes home.",
    "Give me a short poem about the sea.",
    "What are the three primary colors?",
    "Copy the following list and number each item: apples, bananas, cherries, dates, elderberries.",
    "How many days are there in a leap year?",
    "Write a SQL query that selects all users older than 30 from a table named users.",
    "Continue the sequence: Monday, Tuesday, Wednesday,",
    "Describe a cat to someone who has never seen one.",
]
SERVER_START_TIMEOUT_S = 600


@dataclass
class RequestResult:
    ok: bool
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    tokens: int = 0
    tau: float = 1.0
    text: str = ""
    error: str = ""
    temperature: float = 0.0

    @property
    def tpot_s(self) -> float:
        return (self.e2e_s - self.ttft_s) / (self.tokens - 1) if self.tokens > 1 else 0.0


@dataclass
class LevelResult:
    method: str
    concurrency: int
    requests: int
    ok: int
    wall_s: float
    output_tokens: int
    throughput_tok_s: float
    requests_per_s: float
    tau: float
    rows_per_step: float
    plain_step_share: float
    ttft_p50_ms: float
    ttft_p90_ms: float
    tpot_p50_ms: float
    tpot_p90_ms: float
    e2e_p50_s: float
    e2e_p90_s: float
    texts: list[str | None] = field(default_factory=list, repr=False)
    temperatures: list[float] = field(default_factory=list, repr=False)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None,
                        help="base model (default-model name, folder, Hub id; default: the one the heads name, else "
                             "medusa-serve's default model)")
    parser.add_argument("--heads", help="Medusa heads folder (for --method medusa); every server loads it, the "
                        "baseline too (Medusa-2 heads merge their adapter into the model: the baseline is that model)")
    parser.add_argument("--method", default=None,
                        help="speculative method compared with autoregressive (default: medusa with --heads, "
                             "else lookup)")
    parser.add_argument("--no-datastore", dest="datastore", action="store_false",
                        help="with --heads: the speculative server's lookup drafts leave out the heads' datastore "
                             "(medusa-serve --no-datastore; --method lookup, or medusa with --lookup-tokens)")
    parser.add_argument("--requests", type=int, default=16, help="requests per concurrency level")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--ignore-eos", action="store_true", help="always generate --max-tokens tokens")
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0], metavar="T",
                        help="the requests' temperatures, round robin (default: 0, greedy): with several, the rows "
                             "of one batch sample with settings of their own")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads of each server")
    parser.add_argument("--gate", choices=("measured", "off", "both"), default="both",
                        help="the speculative server's --speculation-gate: measured, off, or both in turn "
                             "(default: both)")
    parser.add_argument("--server-arg", action="append", default=[],
                        help="extra argument for the speculative servers' medusa-serve (repeatable), e.g. "
                             "--server-arg=--draft-tokens=4 or --server-arg=--draft-model=NAME")
    parser.add_argument("--baseline-arg", action="append", default=[],
                        help="extra argument for the plain-decoding server's medusa-serve (repeatable): give one "
                             "that both should take (say --max-prefill-tokens) to both flags")
    parser.add_argument("--output", type=Path, default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    if args.method is None:
        args.method = "medusa" if args.heads else "lookup"
    if args.method == "medusa" and not args.heads:
        parser.error("--method medusa needs --heads (or use --method lookup)")
    if not args.datastore and not args.heads:
        parser.error("--no-datastore leaves out the heads' datastore, and no --heads is given: drop --no-datastore")
    if args.requests < 1 or min(args.concurrency) < 1 or args.max_tokens < 1:
        parser.error("--requests, --concurrency and --max-tokens must be positive")
    bad = [t for t in args.temperatures if not 0 <= t <= 2]  # (OpenAI's range; NaN is not in it)
    if bad:
        parser.error(f"--temperatures {bad[0]} is outside OpenAI's range, 0 to 2 (0: greedy)")
    if args.method == "autoregressive" and args.server_arg:  # (no speculative server to take them)
        parser.error("--method autoregressive runs the plain-decoding server alone: give its arguments with "
                     "--baseline-arg, not --server-arg")
    from medusa_infer.serving.cli import parse_args as serve_args

    for method, gate in runs(args):  # each server's command, checked before any starts (a baseline given the
        try:  # speculative servers' --draft-tokens exited after their runs had taken their time)
            serve_args(server_command(args, method, gate, port=1)[3:])
        except SystemExit:
            flag = "--baseline-arg" if method == "autoregressive" else "--server-arg"
            alone = argparse.Namespace(**{**vars(args), "server_arg": [], "baseline_arg": []})
            try:  # the extra arguments to blame only where the command without them is taken
                with contextlib.redirect_stderr(io.StringIO()):
                    serve_args(server_command(alone, method, gate, port=1)[3:])
                blame = f"its {flag}"
            except SystemExit:
                blame = "the setting named there"
            parser.error(f"the {method} server's medusa-serve refuses its arguments (above): mend {blame}")
    return args


def runs(args: argparse.Namespace) -> list[tuple[str, str]]:
    """The servers measured, ``(method, gate)``, in turn: the method's (under each gate asked for), then plain
    decoding's, the baseline."""
    gates = ("measured", "off") if args.gate == "both" else (args.gate,)
    if args.method == "autoregressive":
        return [("autoregressive", "off")]
    return [(args.method, gate) for gate in gates] + [("autoregressive", "off")]


def served_model(args: argparse.Namespace) -> str:
    """The base model the servers load without --model: the one the heads name (as medusa-serve reads either
    layout), else medusa-serve's default; "?" where the heads cannot be read here."""
    from medusa_infer.cli import DEFAULT_MODEL
    from medusa_infer.interop import base_model_name
    from medusa_infer.model import heads_folder

    if not args.heads:
        return DEFAULT_MODEL
    try:
        return base_model_name(heads_folder(args.heads)) or "?"
    except (OSError, ValueError):
        return "?"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def server_command(args: argparse.Namespace, method: str, gate: str, port: int) -> list[str]:
    """The command line of the ``method`` server (``gate``: its --speculation-gate) on ``port``."""
    command = [sys.executable, "-m", "medusa_infer.serving", "--method", method, "--host", "127.0.0.1",
               "--port", str(port), "--max-batch", str(max(args.concurrency)),
               "--max-queue", str(args.requests + 8), "--request-timeout", "0", "--log-level", "warning",
               "--served-model-name", "bench"]
    if args.model:
        command += ["--model", args.model]
    if args.heads:  # (the baseline on the bare base model compared Medusa-2 heads against another model)
        command += ["--heads", args.heads]
    if not args.datastore and method != "autoregressive":  # (the baseline refuses it: it drafts nothing)
        command += ["--no-datastore"]
    if args.threads:
        command += ["--threads", str(args.threads)]
    if method != "autoregressive":
        return command + ["--speculation-gate", gate] + args.server_arg
    return command + args.baseline_arg


class Server:
    """``python -m medusa_infer.serving`` on a free loopback port, its output in a log file."""

    def __init__(self, args: argparse.Namespace, method: str, log_dir: Path, gate: str = "measured") -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        command = server_command(args, method, gate, self.port)
        self.log_path = log_dir / f"server-{method}-{gate}.log"
        self.log = self.log_path.open("w")
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT)

    def wait_ready(self) -> None:
        deadline = time.monotonic() + SERVER_START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited ({self.process.returncode}):\n{self.tail()}")
            try:
                if httpx.get(self.base_url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"the server did not become healthy in {SERVER_START_TIMEOUT_S} s:\n{self.tail()}")

    def metrics(self) -> str:
        return httpx.get(self.base_url + "/metrics", timeout=10).text

    def tail(self, lines: int = 30) -> str:
        self.log.flush()
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()


def request_temperature(args: argparse.Namespace, i: int) -> float:
    """Request i's temperature: ``--temperatures`` round robin."""
    return args.temperatures[i % len(args.temperatures)]


async def one_request(client: httpx.AsyncClient, prompt: str, args: argparse.Namespace,
                      temperature: float = 0.0) -> RequestResult:
    body = {"model": "bench", "messages": [{"role": "user", "content": prompt}], "max_tokens": args.max_tokens,
            "temperature": temperature, "stream": True, "stream_options": {"include_usage": True},
            "ignore_eos": args.ignore_eos}
    start = time.perf_counter()
    result = RequestResult(ok=False, temperature=temperature)
    text: list[str] = []
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    result.error = event["error"]["message"]
                    return result
                choice = event["choices"][0] if event["choices"] else {}
                if choice.get("delta", {}).get("content"):
                    if not text:
                        result.ttft_s = time.perf_counter() - start
                    text.append(choice["delta"]["content"])
                if event.get("usage"):
                    result.tokens = event["usage"]["completion_tokens"]
                    result.tau = event["usage"]["speculative"]["tau"]
    except httpx.HTTPError as error:
        result.error = f"{type(error).__name__}: {error}"
        return result
    result.e2e_s = time.perf_counter() - start
    result.text = "".join(text)
    result.ok = True
    if not text:  # nothing but an end of sequence: the first token is the end
        result.ttft_s = result.e2e_s
    return result


async def run_level(base_url: str, args: argparse.Namespace, concurrency: int) -> tuple[list[RequestResult], float]:
    limit = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)

    async with httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(None, connect=10), limits=limits) as client:
        async def bounded(i: int) -> RequestResult:
            async with limit:
                return await one_request(client, PROMPTS[i % len(PROMPTS)], args, request_temperature(args, i))

        start = time.perf_counter()
        results = await asyncio.gather(*(bounded(i) for i in range(args.requests)))
        return list(results), time.perf_counter() - start


def summarize(method: str, concurrency: int, results: list[RequestResult], wall_s: float,
              plain_step_share: float, rows_per_step: float = float("nan")) -> LevelResult:
    ok = [r for r in results if r.ok]

    def pct(values: list[float], q: float, scale: float = 1.0) -> float:
        return round(float(np.percentile(values, q)) * scale, 3) if values else float("nan")

    ttft, tpot, e2e = [r.ttft_s for r in ok], [r.tpot_s for r in ok if r.tokens > 1], [r.e2e_s for r in ok]
    tokens = sum(r.tokens for r in ok)
    return LevelResult(
        method=method, concurrency=concurrency, requests=len(results), ok=len(ok), wall_s=round(wall_s, 3),
        output_tokens=tokens, throughput_tok_s=round(tokens / wall_s, 2), requests_per_s=round(len(ok) / wall_s, 3),
        tau=round(float(np.mean([r.tau for r in ok])), 3) if ok else float("nan"),  # per request, then the mean
        rows_per_step=round(rows_per_step, 2), plain_step_share=round(plain_step_share, 3),
        ttft_p50_ms=pct(ttft, 50, 1000), ttft_p90_ms=pct(ttft, 90, 1000),
        tpot_p50_ms=pct(tpot, 50, 1000), tpot_p90_ms=pct(tpot, 90, 1000),
        e2e_p50_s=pct(e2e, 50), e2e_p90_s=pct(e2e, 90),
        texts=[r.text if r.ok else None for r in results],  # a failed request matches nothing
        temperatures=[r.temperature for r in results],
    )


def same_text(level: LevelResult, baseline: LevelResult) -> tuple[int, int]:
    """(greedy requests of ``level`` whose text is the baseline's, greedy requests): sampled ones draw apart."""
    pairs = [(a, b) for a, b, t in zip(level.texts, baseline.texts, level.temperatures) if t == 0]
    return sum(a is not None and a == b for a, b in pairs), len(pairs)


def step_counts(server: Server) -> tuple[float, float, float]:
    """The server's (decoding steps, steps the speculation gate made plain, rows decoded summed over steps) so
    far."""
    text = server.metrics()
    return (metric_value(text, "medusa:batch_steps_total"), metric_value(text, "medusa:gated_steps_total"),
            metric_value(text, "medusa:batch_row_steps_total"))


def bench_method(args: argparse.Namespace, method: str, log_dir: Path, gate: str = "measured") -> list[LevelResult]:
    server = Server(args, method, log_dir, gate)
    label = method if method == "autoregressive" or gate == "measured" else f"{method} (gate off)"
    try:
        print(f"[bench] starting {label} server on port {server.port} ...", file=sys.stderr, flush=True)
        server.wait_ready()
        asyncio.run(run_level(server.base_url, argparse.Namespace(**{**vars(args), "requests": 2}), 2))  # warm-up
        levels = []
        for concurrency in args.concurrency:
            steps_before, gated_before, rows_before = step_counts(server)
            results, wall = asyncio.run(run_level(server.base_url, args, concurrency))
            steps, gated, rows = step_counts(server)
            share = (gated - gated_before) / (steps - steps_before) if steps > steps_before else 0.0
            per_step = (rows - rows_before) / (steps - steps_before) if steps > steps_before else float("nan")
            level = summarize(label, concurrency, results, wall, share, per_step)
            failed = [r.error for r in results if not r.ok]
            if failed:
                print(f"[bench] {label} c={concurrency}: {len(failed)} failed, e.g. {failed[0]}", file=sys.stderr)
            print(f"[bench] {label} c={concurrency}: {level.throughput_tok_s} tok/s, tau {level.tau}, "
                  f"rows per step {level.rows_per_step}, plain steps {share:.0%}",
                  file=sys.stderr, flush=True)
            levels.append(level)
        return levels
    finally:
        server.stop()


def markdown(levels: list[LevelResult], baseline: dict[int, LevelResult],
             same: dict[tuple[str, int], tuple[int, int]]) -> str:
    rows = ["| method | conc. | ok | tok/s | speed-up | tau (mean per request) | rows per step | plain steps "
            "| TTFT p50 / p90 (ms) | TPOT p50 / p90 (ms) | E2E p50 / p90 (s) | greedy text same as AR |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for level in levels:
        base = baseline.get(level.concurrency)
        speedup = f"{level.throughput_tok_s / base.throughput_tok_s:.2f}x" if base and base.throughput_tok_s else "-"
        matched, greedy = same.get((level.method, level.concurrency), (0, 0))
        rows.append(
            f"| {level.method} | {level.concurrency} | {level.ok}/{level.requests} | {level.throughput_tok_s:.1f} "
            f"| {speedup} | {level.tau:.2f} | {level.rows_per_step:.2f} | {level.plain_step_share:.0%} "
            f"| {level.ttft_p50_ms:.0f} / {level.ttft_p90_ms:.0f} "
            f"| {level.tpot_p50_ms:.1f} / {level.tpot_p90_ms:.1f} | {level.e2e_p50_s:.2f} / {level.e2e_p90_s:.2f} "
            f"| {f'{matched}/{greedy}' if greedy else '-'} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model = args.model or served_model(args)  # (before the servers: a failure here lost the whole run's report)
    with tempfile.TemporaryDirectory(prefix="bench-serving-") as tmp:
        try:
            levels = [level for method, gate in runs(args) for level in bench_method(args, method, Path(tmp), gate)]
        except RuntimeError as error:
            print(f"bench_serving: error: {error}", file=sys.stderr)
            return 1
    baseline = {lv.concurrency: lv for lv in levels if lv.method == "autoregressive"}
    same = {(lv.method, lv.concurrency): same_text(lv, baseline[lv.concurrency])
            for lv in levels if lv.concurrency in baseline}
    table = markdown(levels, baseline, same)
    print(table)
    if args.output:
        settings = {k: v for k, v in vars(args).items() if k != "output"}
        settings["model"] = model  # what the servers loaded, not None
        record = {"settings": settings, "cpu_count": os.cpu_count(),
                  "results": [{k: v for k, v in asdict(lv).items() if k != "texts"} for lv in levels],
                  "same_greedy_text_as_autoregressive": {f"{m}@{c}": {"same": n, "greedy": g}
                                                         for (m, c), (n, g) in same.items()},
                  "table": table}
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(record, indent=2, default=str) + "\n")
        print(f"[bench] wrote {args.output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
