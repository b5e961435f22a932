"""Two nodes, two link rates: what a search across nodes finds and what the calibrated prior
predicts for the same configurations, and how both move when the cross-node link is slower.

On the two-node testbed (tests/two_nodes.py: two network namespaces of this machine joined by a
tbf-shaped veth link; needs root), for each rate and engine: ``cptune calibrate --hosts`` then
``cptune search --hosts`` on 2 nodes x 2 ranks, into a database of its own; then, per sequence
length, each configuration's measured estimate (every clean visit combined) beside the prior's
prediction from that calibration, the measured verdict beside the prior's pick, and what
``recommend --nodes 2 --ranks 16`` says from the same calibration for 2 nodes x 8 ranks (a size
not measured), with the tier that decides. The emulated nodes share this machine's cores and
memory: compute is shared between them, only the link between them is a real, shaped one.

    sudo .venv/bin/python benchmarks/two_node_rates.py --out benchmarks/results/two_node_rates-DATE.txt
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPOSITORY = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPOSITORY / "tests"))  # the testbed lives with the tests that use it

from two_nodes import TwoNodes, unavailable  # noqa: E402

from cptune import CPConfig, Workload  # noqa: E402
from cptune.estimate import combine, judge  # noqa: E402
from cptune.model import CalibratedProfile, prior_time  # noqa: E402
from cptune.store import Store  # noqa: E402


def cli(bed: TwoNodes, *args: object) -> subprocess.CompletedProcess[str]:
    """``cptune *args`` on node0, its output kept; an error ends the benchmark."""
    done = bed.run([sys.executable, "-m", "cptune.cli", *map(str, args)], capture_output=True, text=True)
    if done.returncode != 0:
        said = done.stdout[-2000:] + done.stderr[-2000:]
        raise SystemExit(f"cptune {' '.join(map(str, args))} failed:\n{said}")
    return done


def compare(db: Path, seq_lens: list[int], heads: int, head_dim: int) -> list[str]:
    """Per length: each configuration measured beside the prior, and both picks."""
    lines = []
    with Store(str(db)) as store:
        (hardware,) = store.hardware().values()
        calibration = store.calibration(hardware.fingerprint)
        assert calibration is not None
        profile = CalibratedProfile(hardware, calibration=calibration)
        rows = store.results()
    for seq_len in seq_lens:
        workload = Workload(seq_len=seq_len, heads=heads, head_dim=head_dim)
        estimates = [e for e in combine([r for r in rows if r.workload == workload]).values()
                     if e.config.ranks == 4]
        verdict = judge(estimates)
        predicted = {e.config: prior_time(workload, e.config, profile).total_s * 1e3 for e in estimates}
        lines.append(f"  seq {seq_len}: measured {verdict.describe()}")
        lines.append(f"  seq {seq_len}: prior picks {min(predicted, key=predicted.__getitem__).describe()}")
        lines.append(f"    {'config':<24} {'measured ms (95%)':>22} {'prior ms':>9} {'prior/measured':>15}")
        for e in sorted(estimates, key=lambda e: e.median_ms):
            p = predicted[e.config]
            lines.append(f"    {e.config.label:<24} {e.median_ms:>8.2f} ({e.low_ms:.2f}-{e.high_ms:.2f}) "
                         f"{p:>9.2f} {p / e.median_ms:>15.2f}")
    return lines


def at_two_by_eight(bed: TwoNodes, db: Path, fingerprint: str, backend: str) -> list[str]:
    """``recommend --nodes 2 --ranks 16`` from this calibration: a Llama-3.1-8B-like layer's
    heads (32 x 128) at 32K tokens, causal, and FLUX.1-dev's (24 x 128) at 4096 + 512 tokens."""
    lines = []
    for shape in (["--heads", "32", "--kv-heads", "8", "--head-dim", "128", "--seq-len", "32768", "--causal"],
                  ["--heads", "24", "--head-dim", "128", "--seq-len", "4608"]):
        done = cli(bed, "recommend", "--db", db, "--hardware", fingerprint, "--backend", backend,
                   "--nodes", "2", "--ranks", "16", *shape, "--json")
        pick = json.loads(done.stdout)
        config = CPConfig(**pick["config"])
        lines.append(f"  2 nodes x 8 ranks, {' '.join(shape)}: {config.describe()}, "
                     f"{pick['latency_ms']:.1f} ms (prior); {pick['tiers']['describe']}")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rates", default="100,1000", help="cross-node rates, Mbit/s each way")
    parser.add_argument("--backends", default="mpi,torch")
    parser.add_argument("--seq-lens", default="512,2048")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=32)
    parser.add_argument("--out", type=Path, help="write the result here too")
    args = parser.parse_args()
    if (reason := unavailable()) is not None:
        raise SystemExit(f"two_node_rates: {reason}")
    seq_lens = [int(s) for s in args.seq_lens.split(",")]
    lines = [f"# two_node_rates: {' '.join(sys.argv[1:])}",
             f"# {time.strftime('%Y-%m-%d %H:%M:%S %Z')}; 2 emulated nodes x 2 ranks on one 2-core VM "
             f"(tests/two_nodes.py, node1 sharing node0's pids: the contention guard counts its ranks as "
             f"ours); calibrate --rounds 1 --repeats 3; search --ranks 4 --rounds 2 --race-rounds 2 "
             f"--confirm-rounds 0; layer {args.heads} heads x d{args.head_dim}, bf16, not causal"]
    folder = Path(tempfile.mkdtemp(prefix="two-node-rates-"))
    for rate in (float(r) for r in args.rates.split(",")):
        with TwoNodes(rate_mbit=rate, ranks_per_node=2, separate_pids=False) as bed:
            lines.append(f"\n## cross-node link {rate:g} Mbit/s set, {bed.measured_mbit:.0f} measured")
            for backend in args.backends.split(","):
                db = folder / f"{rate:g}-{backend}.db"
                started = time.monotonic()
                cli(bed, "calibrate", "--backend", backend, "--hosts", bed.hosts, "--db", db, "--rounds", "1",
                    "--repeats", "3")
                cli(bed, "search", "--backend", backend, "--hosts", bed.hosts, "--db", db, "--no-calibrate",
                    "--heads", args.heads, "--head-dim", args.head_dim, "--seq-lens", args.seq_lens,
                    "--ranks", "4", "--rounds", "2", "--race-rounds", "2", "--confirm-rounds", "0")
                with Store(str(db)) as store:
                    (fingerprint,) = store.hardware()
                    calibration = store.calibration(fingerprint)
                assert calibration is not None
                across = [f for f in calibration.collectives
                          if f.tier == "network" and f.ranks == 4 and f.group == 2]
                inside = [f for f in calibration.collectives
                          if f.tier == "node" and f.ranks == 4 and f.group == 2]
                lines.append(f"\n### {backend} engine ({time.monotonic() - started:.0f} s)")
                tiers = [*(f"{f.kind} in a node {f.bus_bandwidth / 1e9:.3f}" for f in inside),
                         *(f"{f.kind} across nodes {f.bus_bandwidth / 1e9:.3f}" for f in across)]
                lines.append(f"  calibrated on 4 ranks, groups of 2 (bus bandwidth at 16 MiB, GB/s): "
                             f"{', '.join(tiers)}")
                lines += compare(db, seq_lens, args.heads, args.head_dim)
                lines += at_two_by_eight(bed, db, fingerprint, backend)
            print("\n".join(lines), flush=True)  # so far: a rate's runs take minutes
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
