"""A before/after comparison of source trees on one GPU: one timing command run in each tree, in its own process, in
an interleaved order (by default before, after, after, before, so that a drifting clock moves both alike), each run's
JSON rows kept, and per shape the medians side by side.

    git archive HEAD cs336_systems cs336-basics scripts tests pyproject.toml | tar -x -C .before   # the old tree
    python scripts/ab_trees.py --tree before=.before --tree after=. --out $OUT -- \\
        python3 $PWD/scripts/hopper_backward_tiles.py --tiles rule --orders rule --rounds 2 --shapes 1,16,16384,64

A tree is ``LABEL=DIR`` or ``LABEL=DIR:NAME=VALUE,...``: the command runs with ``DIR`` as its working directory,
``PYTHONPATH=DIR:DIR/cs336-basics`` (so that it imports that tree's package) and the variables set (an experiment's
switches: ``--tree s3=.:ALT_STAGES=3``). A relative path in the command resolves in each tree; give the timing script
by absolute path to run the same one in all. Each run's lines that start with ``{`` (JSON rows; rows with a
``"check"`` key dropped) go to ``OUT/<run>_<label>.jsonl``, its other output to ``OUT/runs.log``. The summary
takes ``--metric`` from each row (``row[metric][provider]`` when it is a dictionary, else ``row[metric]``), keyed by
the row's ``shape``, and prints each label's values and its median over the first label's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from typing import NamedTuple


class Tree(NamedTuple):
    label: str
    directory: str
    variables: dict[str, str]


def parse_tree(text: str) -> Tree:
    """``LABEL=DIR[:NAME=VALUE,...]`` as a :class:`Tree`; a ``ValueError`` names what is wrong."""
    label, sep, rest = text.partition("=")
    if not sep or not label or not rest:
        raise ValueError(f"a tree is LABEL=DIR[:NAME=VALUE,...], got {text!r}")
    directory, _, assignments = rest.partition(":")
    variables = {}
    for assignment in filter(None, assignments.split(",")):
        name, sep, value = assignment.partition("=")
        if not sep or not name:
            raise ValueError(f"a tree's variables are NAME=VALUE, got {assignment!r} in {text!r}")
        variables[name] = value
    return Tree(label, directory, variables)


def rows_of(output: str) -> list[dict]:
    """The JSON rows of a run's output, without the rows of checks."""
    rows = [json.loads(line) for line in output.splitlines() if line.startswith("{")]
    return [row for row in rows if "check" not in row]


def metric_of(row: dict, metric: str, provider: str) -> float | None:
    value = row.get(metric)
    if isinstance(value, dict):
        value = value.get(provider)
    return value if isinstance(value, (int, float)) else None


def summary(runs: list[tuple[str, list[dict]]], metric: str, provider: str) -> list[str]:
    """Per shape, each label's values of ``metric`` in run order and its median over the first label's."""
    labels = list(dict.fromkeys(label for label, _ in runs))
    values: dict[str, dict[str, list[float]]] = {}
    for label, rows in runs:
        for row in rows:
            value = metric_of(row, metric, provider)
            if value is not None:
                values.setdefault(json.dumps(row.get("shape")), {}).setdefault(label, []).append(value)
    lines = []
    for shape, by_label in values.items():
        base = by_label.get(labels[0])
        parts = []
        for label in labels:
            if label not in by_label:
                continue
            median = statistics.median(by_label[label])
            ratio = f" ({median / statistics.median(base):.3f}x)" if base and label != labels[0] else ""
            parts.append(f"{label} {', '.join(f'{v:.4g}' for v in by_label[label])}{ratio}")
        lines.append(f"{shape}: " + " | ".join(parts))
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", action="append", required=True, type=parse_tree, help="LABEL=DIR[:NAME=VALUE,...]")
    parser.add_argument("--order", nargs="+", help="labels in run order (default: the first two trees as A B B A)")
    parser.add_argument("--out", default=os.environ.get("OUT", "."), help="where the runs' files go (default $OUT)")
    parser.add_argument("--metric", default="backward_ms")
    parser.add_argument("--provider", default="rule/rule", help="the key of a dictionary-valued metric")
    parser.add_argument("--timeout", type=float, default=300, help="seconds per run")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the timing command")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the timing command after --")
    trees = {tree.label: tree for tree in args.tree}
    if len(trees) != len(args.tree):
        parser.error("tree labels must differ")
    if args.order:
        order = args.order
    elif len(args.tree) >= 2:
        first, second = args.tree[0].label, args.tree[1].label
        order = [first, second, second, first]
    else:
        parser.error("with one tree, give --order")
    for label in order:
        if label not in trees:
            parser.error(f"--order names {label!r}, which no --tree defines")
    os.makedirs(args.out, exist_ok=True)
    runs = []
    failed = 0
    for i, label in enumerate(order, start=1):
        tree = trees[label]
        directory = os.path.abspath(tree.directory)
        env = {**os.environ, **tree.variables,
               "PYTHONPATH": os.pathsep.join([directory, os.path.join(directory, "cs336-basics")])}
        try:
            done = subprocess.run(command, cwd=directory, env=env, capture_output=True, text=True,
                                  timeout=args.timeout)
            output, status = done.stdout, done.returncode
            other = done.stderr
        except subprocess.TimeoutExpired as timeout:
            output = timeout.stdout.decode() if isinstance(timeout.stdout, bytes) else (timeout.stdout or "")
            other, status = f"timed out after {args.timeout} s\n", "timeout"
        rows = rows_of(output)
        stem = os.path.join(args.out, f"{i}_{label}")
        with open(stem + ".jsonl", "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)
        with open(os.path.join(args.out, "runs.log"), "a") as f:
            text = "\n".join(line for line in output.splitlines() if not line.startswith("{"))
            f.write(f"# run {i} {label}: exit {status}\n{text}\n{other}")
        failed += status != 0
        print(f"# run {i} {label}: exit {status}, {len(rows)} rows", flush=True)
        runs.append((label, rows))
    print("\n".join(summary(runs, args.metric, args.provider)))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
