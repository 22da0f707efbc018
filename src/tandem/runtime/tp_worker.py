"""A tensor-parallel rank other than 0 (`--tp N`), started by rank 0 (runtime/tp.py `Ranks.start`):

    python -m tandem.runtime.tp_worker RANK SIZE PORT CPUS THREADS OPTIONS_JSON

It pins itself to CPUS, joins rank 0's store on 127.0.0.1:PORT, makes the plan and loads its slices, says it is
ready (with what it placed and uploaded), connects the groups and runs rank 0's steps until told to stop. An error
is written to the store for rank 0 to raise, and the rank exits."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence

import torch

from tandem.errors import TandemError
from tandem.runtime.runner import ModelRunner
from tandem.runtime.tp import (
    RankOptions,
    TPGroup,
    die_with_parent,
    load_rank,
    new_rank_pool,
    open_plan,
    serve_steps,
)
from tandem.runtime.tp_cores import pin_process


def main(argv: Sequence[str]) -> int:
    rank, size, port = int(argv[0]), int(argv[1]), int(argv[2])
    cpus = [int(c) for c in argv[3].split(",")]
    threads = int(argv[4]) or len(cpus)
    options = RankOptions.from_json(argv[5])
    die_with_parent()
    pin_process(cpus)
    group = TPGroup.join(rank, size, port)
    try:
        torch.tanh(torch.zeros(1))  # as tandem.api.initialise_vector_math: MKL's first call on one element
        f, _, plan = open_plan(options)
        loaded = load_rank(plan.ranks[rank], f, options, threads, group)
        runner = ModelRunner(loaded.model, new_rank_pool(loaded.model, options), graphs=False)
        report = loaded.report()
        group.store.set(f"ready/{rank}", json.dumps(report))
        group.connect(plan.backend)
        serve_steps(group, runner, report)
    except BaseException as e:  # noqa: BLE001 - every failure goes to rank 0, on one line
        message = str(e).splitlines()[0] if isinstance(e, TandemError) and str(e) else f"{type(e).__name__}: {e}"
        group.fail(message[:1000])
        sys.stderr.flush()
        os._exit(1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
