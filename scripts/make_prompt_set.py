"""Build a shipped self-distillation prompt set from a larger one, by source quotas.

The repo ships prompts only from sources whose licence allows redistribution (data/README.md). This
script writes every row of an existing set (``--include``, whose rows must all be in ``--source``)
plus, for every source named in ``--quota``, a seeded sample of the larger file's other rows up to
that source's quota::

    python scripts/make_prompt_set.py --source ../shared/data/train_prompts.jsonl \\
        --include data/train_prompts.jsonl --output data/train_prompts_large.jsonl \\
        --quota gsm8k_train=1000 gpteacher_codegen=1000 gpteacher_roleplay=1000 dolly_open_qa=1000

Sources in ``--include`` but not in ``--quota`` keep their included rows only. Rows come out as
``medusa_train.distill.read_prompts`` reads them (``id`` as a string, ``source``, ``prompt``; other
fields, a licence say, are not kept), in ``--source``'s order, whatever order the seed drew them in.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from medusa_train.distill import read_prompts


def parse_quota(text: str) -> tuple[str, int]:
    source, sep, count = text.rpartition("=")
    if not sep or not source or not count.isdigit():
        raise argparse.ArgumentTypeError(f"quota {text!r} is not SOURCE=COUNT, e.g. gsm8k_train=1000")
    return source, int(count)


def build(source_rows: list[dict], included: list[dict], quotas: dict[str, int], seed: int) -> list[dict]:
    """The rows of ``source_rows`` that are in ``included`` or in a seeded sample per quota'd
    source, in ``source_rows``' order. Raises ``ValueError`` for a quota on an unknown source, a
    quota larger than its source, or an included row that ``source_rows`` lacks."""
    by_source: dict[str, list[dict]] = {}
    for row in source_rows:
        by_source.setdefault(row["source"], []).append(row)
    unknown = sorted(set(quotas) - set(by_source))
    if unknown:
        raise ValueError(f"quotas name sources not in the source rows: {unknown}; there: {sorted(by_source)}")
    chosen = {row["id"] for row in included}
    missing = sorted(chosen - {row["id"] for row in source_rows})
    if missing:
        raise ValueError(f"{len(missing)} included rows are not in the source rows, e.g. {missing[:3]}")
    for source, quota in quotas.items():
        have = sum(row["source"] == source for row in included)
        rest = [row for row in by_source[source] if row["id"] not in chosen]
        random.Random(f"{seed}:{source}").shuffle(rest)
        take = max(0, quota - have)
        if take > len(rest):
            raise ValueError(f"source {source} has {have + len(rest)} prompts, fewer than its quota {quota}")
        chosen.update(row["id"] for row in rest[:take])
    return [row for row in source_rows if row["id"] in chosen]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", type=Path, required=True, help="the larger prompt file")
    parser.add_argument("--include", type=Path, help="a set whose rows are all kept")
    parser.add_argument("--quota", type=parse_quota, nargs="+", required=True, help="SOURCE=COUNT ...")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path, required=True)
    args = parser.parse_args(argv)
    try:
        rows = build(read_prompts(args.source), read_prompts(args.include) if args.include else [],
                     dict(args.quota), args.seed)
    except (ValueError, OSError) as err:  # (a missing --source: a FileNotFoundError traceback)
        parser.error(str(err))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    with args.output.open("w", encoding="utf-8") as handle:
        for row in rows:
            handle.write(json.dumps(row, ensure_ascii=False) + "\n")
    counts: dict[str, int] = {}
    for row in rows:
        counts[row["source"]] = counts.get(row["source"], 0) + 1
    print(f"{args.output}: {len(rows)} rows", json.dumps(counts))


if __name__ == "__main__":
    main()
