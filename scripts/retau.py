"""tau of a stored ``medusa-bench`` report under today's definition (tokens per decoding step, the prefill's
token no step's, ``(tokens - turns) / steps``), for reports written before commit c190c01, whose tau was
tokens per target forward (the prefill's forward and token counted too: ``tokens / (steps + turns)``).

Such a report keeps ``tokens``, ``turns`` and that tau rounded to 3 decimals per method; the steps are the
whole numbers consistent with them, one where the tokens are few enough (under about tau**2 thousand),
else a range. Hugging Face's assisted methods verified drafts in their first forward, whose tokens the old
report did not keep: theirs cannot be recomputed (n/a).

    python scripts/retau.py docs/tau40-128-xl-s32/report.json [...]
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

ASSISTED = ("hf-lookup", "hf-assisted")
PER_STEP_FOLDERS = ("demo-ec1ff2d",)
"""Stored reports (by their folder under docs/) written after commit c190c01 but before reports recorded
``settings.tau_definition``: already per step."""


def steps_range(tokens: int, turns: int, tau: float) -> range:
    """Decoding steps consistent with ``tau == round(tokens / (steps + turns), 3)``."""
    low = math.ceil(tokens / (tau + 0.0005) - 1e-9) - turns
    high = math.floor(tokens / (tau - 0.0005) + 1e-9) - turns
    return range(max(low, 0), high + 1)


def retau(method: str, row: dict, turns: int) -> str:
    """``turns``: the method's (reports before commit f8ca5fd keep only the run's, every method's)."""
    tokens, turns, tau = row["tokens"], row.get("turns", turns), row["tau"]
    if method in ASSISTED:
        return "n/a"
    if tokens == turns:  # every turn ended at its first token: no decoding step, no tau (medusa-bench's "-")
        return "-"
    if tau == 1.0:
        return "1.00"
    found = [(tokens - turns) / s for s in steps_range(tokens, turns, tau) if s > 0]
    if not found:
        return "?"
    low, high = min(found), max(found)
    return f"{low:.3f}" if round(low, 3) == round(high, 3) else f"{low:.3f}..{high:.3f}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("reports", nargs="+", type=Path)
    for path in parser.parse_args(argv).reports:
        try:
            report = json.loads(path.read_text())
            report["settings"], report["methods"]  # noqa: B018 (a report's: else no report)
        except (OSError, ValueError, KeyError, TypeError) as err:  # a traceback named neither the file nor the fix
            parser.error(f"{path} is no medusa-bench report.json ({type(err).__name__}: {err})")
        print(path)
        if report["settings"].get("tau_definition"):  # written knowing today's definition: nothing to convert
            print(f"its tau is already {report['settings']['tau_definition']}")
            continue
        if path.resolve().parent.name in PER_STEP_FOLDERS:
            print("its tau is already tokens per decoding step (written after commit c190c01)")
            continue
        print("| method | tokens | turns | tau then (per forward) | tau now (per step) |")
        print("|---|---|---|---|---|")
        for method, row in report["methods"].items():
            turns = row.get("turns", report["settings"].get("turns"))
            if turns is None:  # neither the method nor the run kept its turns: the steps cannot be recovered
                print(f"| {method} | {row['tokens']} | ? | {row.get('tau')} | ? (the report keeps no turns) |")
                continue
            if row.get("tau") is None:  # no step: nothing to convert
                print(f"| {method} | {row['tokens']} | {turns} | - | - |")
                continue
            print(f"| {method} | {row['tokens']} | {turns} | {row['tau']:.3f} | {retau(method, row, turns)} |")


if __name__ == "__main__":
    main()
