"""Prometheus metrics of the server, in the text exposition format (version 0.0.4).

The speculative counters carry vLLM's names, so dashboards built for vLLM read them unchanged:

* ``vllm:spec_decode_num_drafts`` - row-steps whose proposal reached depth 1 or more;
* ``vllm:spec_decode_num_draft_tokens`` - proposed depth summed over those row-steps (a Medusa
  tree of depth k counts k, as a chain of k draft tokens does);
* ``vllm:spec_decode_num_accepted_tokens`` - accepted draft tokens (the bonus token not counted);
* ``vllm:spec_decode_num_accepted_tokens_per_pos{position}`` - the same per 0-based depth.

So ``accepted / draft_tokens`` is the acceptance rate and ``1 + accepted / drafts`` vLLM's mean
acceptance length: tokens per speculative row-step. It is not ``usage.speculative.tau`` (tokens per
step), which also counts the steps that verified no draft (the speculation gate's plain steps, a row's
last step with room for one token) and the steps of rows that stopped on a draft (an EOS, no token of
the step's own after it). Counters are exposed with the ``_total`` suffix, as prometheus_client does.

Latencies as vLLM defines them: ``vllm:inter_token_latency_seconds`` (and its older name
``vllm:time_per_output_token_seconds``) gets a sample per decoding step of a request after its first
token, the time since its last tokens (a speculative step brings several at once);
``vllm:request_time_per_output_token_seconds`` one per request, its mean time per token after the first.
"""

from __future__ import annotations

import math
import threading
from typing import Iterable

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
TOKEN_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)

Labels = tuple[tuple[str, str], ...]


class _Metric:
    kind = ""

    def __init__(self, name: str, help_text: str, labelnames: Iterable[str] = ()) -> None:
        self.name, self.help = name, help_text
        self.labelnames = tuple(labelnames)
        self._lock = threading.Lock()

    @property
    def family(self) -> str:
        """The name in the HELP and TYPE lines."""
        return self.name

    def samples(self) -> list[tuple[str, Labels, float]]:
        raise NotImplementedError

    def _key(self, labels: dict[str, object]) -> Labels:
        if set(labels) != set(self.labelnames):
            raise ValueError(f"{self.name} takes labels {self.labelnames}, got {tuple(labels)}")
        return tuple((name, str(labels[name])) for name in self.labelnames)


class Counter(_Metric):
    kind = "counter"

    def __init__(self, name: str, help_text: str, labelnames: Iterable[str] = ()) -> None:
        super().__init__(name, help_text, labelnames)
        self._values: dict[Labels, float] = {} if self.labelnames else {(): 0.0}

    def inc(self, amount: float = 1.0, **labels: object) -> None:
        if amount < 0:
            raise ValueError(f"counter {self.name} cannot decrease (got {amount})")
        key = self._key(labels)
        with self._lock:
            self._values[key] = self._values.get(key, 0.0) + amount

    def value(self, **labels: object) -> float:
        with self._lock:
            return self._values.get(self._key(labels), 0.0)

    def samples(self) -> list[tuple[str, Labels, float]]:
        with self._lock:
            return [(f"{self.name}_total", key, value) for key, value in sorted(self._values.items())]

    @property
    def family(self) -> str:
        return f"{self.name}_total"


class Gauge(_Metric):
    kind = "gauge"

    def __init__(self, name: str, help_text: str, labelnames: Iterable[str] = ()) -> None:
        super().__init__(name, help_text, labelnames)
        self._values: dict[Labels, float] = {} if self.labelnames else {(): 0.0}

    def set(self, value: float, **labels: object) -> None:
        key = self._key(labels)
        with self._lock:
            self._values[key] = float(value)

    def value(self, **labels: object) -> float:
        with self._lock:
            return self._values.get(self._key(labels), 0.0)

    def samples(self) -> list[tuple[str, Labels, float]]:
        with self._lock:
            return [(self.name, key, value) for key, value in sorted(self._values.items())]


class Histogram(_Metric):
    kind = "histogram"

    def __init__(self, name: str, help_text: str, buckets: Iterable[float] = LATENCY_BUCKETS) -> None:
        super().__init__(name, help_text)
        self.buckets = tuple(sorted(buckets))
        self._counts = [0] * (len(self.buckets) + 1)  # the last one is +Inf
        self._sum = 0.0

    def observe(self, value: float) -> None:
        if not math.isfinite(value):
            return
        index = next((i for i, bound in enumerate(self.buckets) if value <= bound), len(self.buckets))
        with self._lock:
            self._counts[index] += 1
            self._sum += value

    @property
    def count(self) -> int:
        with self._lock:
            return sum(self._counts)

    def samples(self) -> list[tuple[str, Labels, float]]:
        with self._lock:
            counts, total = list(self._counts), self._sum
        out: list[tuple[str, Labels, float]] = []
        cumulative = 0
        for bound, count in zip([*map(_number, self.buckets), "+Inf"], counts):
            cumulative += count
            out.append((f"{self.name}_bucket", (("le", bound),), float(cumulative)))
        out.append((f"{self.name}_sum", (), total))
        out.append((f"{self.name}_count", (), float(cumulative)))
        return out


class ServingMetrics:
    """Every metric the server exports; thread-safe (the engine thread and the event loop write).

    Args:
        model_name: added as the ``model_name`` label to every sample, as vLLM does.
    """

    def __init__(self, model_name: str) -> None:
        self.const_labels: Labels = (("model_name", model_name),)
        self.spec_drafts = Counter("vllm:spec_decode_num_drafts", "Row-steps with a proposal of depth >= 1.")
        self.spec_draft_tokens = Counter(
            "vllm:spec_decode_num_draft_tokens", "Proposal depth summed over speculative row-steps.")
        self.spec_accepted_tokens = Counter(
            "vllm:spec_decode_num_accepted_tokens", "Accepted draft tokens (bonus token not counted).")
        self.spec_accepted_per_pos = Counter(
            "vllm:spec_decode_num_accepted_tokens_per_pos", "Accepted draft tokens by 0-based depth.", ("position",))
        self.running = Gauge("vllm:num_requests_running", "Requests being prefilled or decoded.")
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests queued, not yet decoding.")
        self.request_success = Counter(
            "vllm:request_success", "Requests that finished, by OpenAI finish reason.", ("finished_reason",))
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens prefilled.")
        self.generation_tokens = Counter("vllm:generation_tokens", "Tokens generated.")
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Arrival to first token.")
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Arrival to last token.")
        # vLLM's meanings: a sample per decoding step of a request (inter-token latency; the older name is
        # vLLM's deprecated alias of it), and one per request (its mean time per token after the first)
        self.itl = Histogram("vllm:inter_token_latency_seconds",
                             "Per decoding step of a request after its first token: seconds since its last tokens.",
                             TOKEN_LATENCY_BUCKETS)
        self.itl_alias = Histogram("vllm:time_per_output_token_seconds",
                                   "vllm:inter_token_latency_seconds under its older name.", TOKEN_LATENCY_BUCKETS)
        self.tpot = Histogram("vllm:request_time_per_output_token_seconds",
                              "Per request: time per output token after the first.", TOKEN_LATENCY_BUCKETS)
        self.batch_steps = Counter("medusa:batch_steps", "Decoding steps (one forward of a batch each).")
        self.batch_row_steps = Counter("medusa:batch_row_steps",
                                       "Rows decoded, summed over steps (divided by batch_steps: mean batch size).")
        self.gated_steps = Counter("medusa:gated_steps",
                                   "Steps the speculation gate decoded plainly: it measured speculation slower, or "
                                   "checked the plain step's time.")
        self.batch_joins = Counter("medusa:batch_joins", "Newly prefilled requests that joined a running batch.")
        self.aborted = Counter("medusa:requests_aborted",
                               "Requests ended early, by reason (disconnect, timeout, error, shutdown).", ("reason",))
        self.http_requests = Counter("medusa:http_requests", "HTTP requests by route and status.",
                                     ("method", "path", "status"))

    def all(self) -> list[_Metric]:
        return [value for value in vars(self).values() if isinstance(value, _Metric)]

    def render(self) -> str:
        lines: list[str] = []
        for metric in self.all():
            lines.append(f"# HELP {metric.family} {metric.help}")
            lines.append(f"# TYPE {metric.family} {metric.kind}")
            for name, labels, value in metric.samples():
                lines.append(f"{name}{_labels(self.const_labels + labels)} {_number(value)}")
        return "\n".join(lines) + "\n"


def _labels(labels: Labels) -> str:
    if not labels:
        return ""
    escaped = (f'{name}="{_escape(value)}"' for name, value in labels)
    return "{" + ",".join(escaped) + "}"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(value: float) -> str:
    if value == math.inf:
        return "+Inf"
    return repr(float(value))
