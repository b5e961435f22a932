"""Issue 56's acceptance matrix: every strategy x layout x mask on 1-4 ranks, on the mpi and
torch engines, MHA/GQA/MQA, forward and training, against the float64 reference.

The masks: full, causal, a window (with and without sinks, causal or not), 1, 3 and 17
packed documents (one longer than a rank's share, the rest shorter), a window with sinks
inside documents, and joint text (replicated on every rank, or sharded with the image: the
``replicated_text`` and ``contiguous`` layouts). The length (37) is one no rank count divides
and the head count (6) one 4 ranks do not: a pair that cannot run is asserted refused
(``InfeasibleConfigError`` before any process starts, with its reason) instead of run. Every
run's output, and in training dQ, dK and dV, must be within the engine's tolerance of the
reference (``Engine.tolerance``, today's: 2e-5 relative in fp32); and for every mask, a run of
a perturbed mask (one token off) must fail that check, so the reference check would catch an
engine running another mask.

``tests/test_mask_matrix.py`` runs a slice of it (every mask and configuration once, the
layout, heads and mode rotated) in the suite; this script runs all of it and writes the
counts, the largest error against its tolerance and any failure::

    python benchmarks/mask_matrix.py --out benchmarks/results/mask_matrix-DATE.txt
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np
from _provenance import command, commit

import cptune
from cptune.config import STRATEGIES, CPConfig
from cptune.engines import get_engine
from cptune.errors import InfeasibleConfigError
from cptune.feasibility import feasibility
from cptune.layout import normal, runnable_layouts
from cptune.reference import (
    make_inputs,
    make_output_gradient,
    reference_attention,
    reference_gradients,
    relative_error,
)
from cptune.workload import Workload

SEQ_LEN, HEADS, HEAD_DIM = 37, 6, 8
#: 17 documents in 37 tokens: one of 12 (more than a rank's share on 2-4 ranks), 16 of 1-3.
SEVENTEEN = [12, 1, 2, 1, 2, 1, 2, 1, 2, 1, 2, 1, 2, 1, 2, 1, 3]
THREE = [5, 20, 12]
#: name -> the mask's Workload fields.
MASKS: dict[str, dict[str, object]] = {
    "full": {},
    "causal": {"causal": True},
    "window": {"window": (4, 3)},
    "window-sinks": {"window": (4, 3), "sinks": 2},
    "causal-window": {"causal": True, "window": (5, 0)},
    "causal-window-sinks": {"causal": True, "window": (5, 0), "sinks": 2},
    "1-document": {"causal": True, "documents": [SEQ_LEN]},
    "3-documents": {"causal": True, "documents": THREE},
    "3-documents-full": {"documents": THREE},
    "17-documents": {"causal": True, "documents": SEVENTEEN},
    "3-documents-window-sinks": {"causal": True, "window": (4, 0), "sinks": 1, "documents": THREE},
    "text": {"text": 6},
}
#: name -> KV heads of the 6 query heads.
HEAD_KINDS = {"mha": 6, "gqa": 2, "mqa": 1}
MODES = ("forward", "train")
ENGINES = ("mpi", "torch")
#: Every strategy and head group on 4, 3, 2 and 1 ranks, largest first (an engine's pool starts once);
#: a head group that does not divide the 6 heads (4) padded, the one form it runs in.
CONFIGS = [CPConfig(strategy, ranks, u, pad_heads=HEADS % u != 0)
           for ranks in (4, 3, 2, 1) for strategy in STRATEGIES
           for u in range(1, ranks + 1) if ranks % u == 0 and (strategy != "ulysses" or u == ranks)]


def workload(mask: str, kind: str, mode: str) -> Workload:
    return Workload(SEQ_LEN, HEADS, HEAD_DIM, kv_heads=HEAD_KINDS[kind], dtype="fp32", mode=mode,
                    **MASKS[mask])  # type: ignore[arg-type]


@dataclass(frozen=True)
class Case:
    engine: str
    mask: str
    kind: str
    mode: str
    config: CPConfig

    @property
    def workload(self) -> Workload:
        return workload(self.mask, self.kind, self.mode)

    def describe(self) -> str:
        return f"{self.engine} {self.mask} {self.kind} {self.mode} {self.config.label} on {self.config.ranks}"


def layouts(wl: Workload, config: CPConfig) -> list[CPConfig]:
    """``config`` in every layout that deals ``wl`` out (the default named as none)."""
    return [normal(wl, config.with_layout(layout)) for layout in runnable_layouts(wl, config)]


def full_matrix(engines: tuple[str, ...] = ENGINES) -> Iterator[Case]:
    """Every case: engine x mask x heads x mode x configuration x layout."""
    for engine, mask, kind, mode in itertools.product(engines, MASKS, HEAD_KINDS, MODES):
        wl = workload(mask, kind, mode)
        for config in CONFIGS:
            for laid in layouts(wl, config):
                yield Case(engine, mask, kind, mode, laid)


def slice_matrix(engines: tuple[str, ...] = ENGINES) -> Iterator[Case]:
    """Every engine x mask x configuration once, its layout, heads and mode rotated through
    (so every layout, head kind and mode meets every mask and strategy across the slice)."""
    turn = itertools.count()
    for engine, mask in itertools.product(engines, MASKS):
        for config in CONFIGS:
            j = next(turn)
            kind, mode = list(HEAD_KINDS)[j % 3], MODES[(j // 3) % 2]
            wl = workload(mask, kind, mode)
            choices = layouts(wl, config)
            yield Case(engine, mask, kind, mode, choices[j % len(choices)])


@lru_cache(maxsize=64)
def reference(wl: Workload) -> tuple[tuple[np.ndarray, ...], tuple[np.ndarray, ...]]:
    """Inputs (with the output gradient in training) and the float64 reference of ``wl``."""
    q, k, v = make_inputs(wl, seed=7)
    if not wl.training:
        return (q, k, v), (reference_attention(wl, q, k, v),)
    dout = make_output_gradient(wl, seed=7)
    return (q, k, v, dout), (reference_attention(wl, q, k, v), *reference_gradients(wl, q, k, v, dout))


def run(case: Case, ran_as: Workload | None = None) -> tuple[str, float]:
    """("ran", largest error / tolerance over the output and gradients) or ("refused", 0.0)
    when the pair cannot run (the refusal checked: raised before any process, with its
    reason). ``ran_as``: the workload the engine runs instead (a perturbed mask), checked
    against ``case``'s reference."""
    wl = case.workload
    engine_wl = ran_as or wl
    reasons = feasibility(engine_wl, case.config)
    inputs, expected = reference(wl)
    if reasons:
        try:
            run_engine(case, engine_wl, inputs)
        except InfeasibleConfigError as refused:
            assert reasons[0] in str(refused), (case.describe(), str(refused))
            return "refused", 0.0
        raise AssertionError(f"{case.describe()}: ran though feasibility said {reasons[0]}")
    got = run_engine(case, engine_wl, inputs)
    tolerance = get_engine(case.engine).tolerance[wl.dtype]
    return "ran", max(relative_error(g, e) for g, e in zip(got, expected, strict=True)) / tolerance


def run_engine(case: Case, wl: Workload, inputs: tuple[np.ndarray, ...]) -> tuple[np.ndarray, ...]:
    q, k, v = inputs[:3]
    if wl.training:
        return tuple(cptune.compute_gradients(wl, case.config, q, k, v, inputs[3], backend=case.engine))
    return (cptune.compute(wl, case.config, q, k, v, backend=case.engine),)


def perturbed(mask: str) -> dict[str, object]:
    """``mask``'s fields one token off: a document boundary moved, one sink fewer, the window
    one narrower, causal for full; joint text as two documents (the text seeing only itself)."""
    fields = dict(MASKS[mask])
    documents = fields.get("documents")
    if isinstance(documents, list) and len(documents) > 1:
        fields["documents"] = [documents[0] - 1, documents[1] + 1, *documents[2:]]
    elif fields.get("sinks"):
        fields["sinks"] = int(fields["sinks"]) - 1  # type: ignore[call-overload]
    elif "window" in fields:
        window: tuple[int, int] = fields["window"]  # type: ignore[assignment]
        fields["window"] = (window[0] - 1, window[1])
    elif "text" in fields:
        fields = {"documents": [int(fields["text"]), SEQ_LEN - int(fields["text"])]}  # type: ignore[call-overload]
    else:
        fields["causal"] = not fields.get("causal", False)
    return fields


def perturbed_cases(engines: tuple[str, ...] = ENGINES) -> Iterator[tuple[Case, Workload]]:
    """Per engine and mask one case (4 ranks, Ring, the last layout that runs both masks,
    forward and training alternating), with the workload of the perturbed mask it runs instead."""
    for i, (engine, mask) in enumerate(itertools.product(engines, MASKS)):
        mode = MODES[i % 2]
        wl = workload(mask, "gqa", mode)
        other = Workload(SEQ_LEN, HEADS, HEAD_DIM, kv_heads=2, dtype="fp32", mode=mode,
                         **perturbed(mask))  # type: ignore[arg-type]
        both = [c for c in layouts(wl, CPConfig("ring", 4)) if not feasibility(wl, c) + feasibility(other, c)]
        yield Case(engine, mask, "gqa", mode, both[-1]), other


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engines", nargs="+", default=list(ENGINES), choices=ENGINES)
    parser.add_argument("--slice", action="store_true", help="the suite's slice only")
    parser.add_argument("--out", type=Path, help="write the result here (default: stdout)")
    args = parser.parse_args(argv)
    engines = tuple(args.engines)
    cases = list(slice_matrix(engines) if args.slice else full_matrix(engines))
    started = time.monotonic()
    counts: dict[tuple[str, str, str], int] = {}
    worst: dict[str, tuple[float, str]] = {}
    failures: list[str] = []
    for case in cases:
        try:
            verdict, ratio = run(case)
        except Exception as error:  # noqa: BLE001 - every failure is listed, none stops the matrix
            verdict, ratio = "failed", 0.0
            failures.append(f"{case.describe()}: {type(error).__name__}: {error}")
        counts[case.engine, case.mode, verdict] = counts.get((case.engine, case.mode, verdict), 0) + 1
        if verdict == "ran" and ratio > 1:
            failures.append(f"{case.describe()}: error {ratio:.2f}x the tolerance")
        if verdict == "ran" and ratio > worst.get(case.engine, (-1.0, ""))[0]:
            worst[case.engine] = (ratio, case.describe())
    caught = []
    for case, other in perturbed_cases(engines):
        verdict, ratio = run(case, ran_as=other)
        caught.append((case, verdict, ratio))
        if verdict != "ran" or ratio <= 1:
            failures.append(f"{case.describe()}: a perturbed mask was not caught ({verdict}, {ratio:.2f})")
    seconds = time.monotonic() - started
    for engine in engines:
        get_engine(engine).close()
    lines = [f"# benchmarks/mask_matrix.py ({'slice' if args.slice else 'full matrix'}): {len(cases)} cases "
             f"in {seconds:.0f} s on this host, engines {', '.join(engines)}",
             f"# code {commit()}: {command('mask_matrix.py', argv if argv is not None else sys.argv[1:])}",
             f"# seq {SEQ_LEN}, {HEADS} heads x d{HEAD_DIM} (kv {', '.join(map(str, HEAD_KINDS.values()))}), "
             f"fp32, batch 1; {len(MASKS)} masks; {len(CONFIGS)} configurations on 1-4 ranks, every layout",
             "", "engine  mode     ran  refused  failed"]
    for engine, mode in itertools.product(engines, MODES):
        ran, refused, failed = (counts.get((engine, mode, v), 0) for v in ("ran", "refused", "failed"))
        lines.append(f"{engine:<7} {mode:<8} {ran:>4} {refused:>8} {failed:>7}")
    lines.append("")
    for engine, (ratio, where) in worst.items():
        lines.append(f"largest error on {engine}: {ratio:.3f} x its tolerance ({where})")
    lines.append("perturbed masks (error / tolerance of a run of the mask one token off; > 1 is caught):")
    lines += [f"  {case.engine} {case.mask} ({case.config.label}, {case.mode}): {ratio:.3g}"
              for case, _, ratio in caught]
    lines.append(f"failures: {len(failures)}")
    lines += [f"  {failure}" for failure in failures]
    text = "\n".join(lines) + "\n"
    if args.out:
        args.out.write_text(text)
    else:
        sys.stdout.write(text)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
