"""The onnx engine: every configuration as per-rank ONNX graphs, run on real MPI ranks.

The driver writes each rank's graph (``_graph``), serializes it and sends the bytes with the
rank's inputs; each rank runs exactly those bytes with ONNX's reference runtime, its
``DistCollective`` nodes as MPI collectives (``_rank``). The ranks live in the same
supervised pool as the mpi engine's (``cptune.engines._pool``). It checks that the graphs a
TensorRT deployment would build compute the right attention; it does not time them (numpy on
a CPU says nothing about a GPU), so ``measure`` and ``calibrate`` refuse it.

``export_graphs`` writes the same graphs to files with a manifest, for a deployment that
builds its own TensorRT engines.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import onnx

from cptune._files import check_ours, write_regular
from cptune.config import CPConfig
from cptune.engines import ENGINES, check_runs, untimed
from cptune.engines._pool import PooledEngine
from cptune.engines.onnx._builder import OPSET
from cptune.engines.onnx._dialect import DOMAIN, DOMAIN_VERSION
from cptune.engines.onnx._graph import io_shapes, tensorrt_rank_graph
from cptune.layout import SequenceLayout, position_runs
from cptune.version import __version__
from cptune.workload import Workload

MANIFEST = "manifest.json"
#: The fix offered when a file in the graphs' folder is something cptune never writes into.
_ELSEWHERE = "write the graphs into another folder (cptune export-graph -o DIR)"
_ONNX_TYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}
#: What begins the manifest cptune writes (``export_graphs``), by which one is told from other files.
_MANIFEST_START = b'{\n  "format": "cptune-onnx-graphs"'


def _our_graph(head: bytes) -> bool:
    """Whether a file beginning ``head`` is an ONNX graph cptune wrote: a ModelProto whose first
    fields, serialised in order, are its IR version and the producer name "cptune"."""
    return head[:1] == b"\x08" and b"\x12\x06cptune" in head[:16]


def _our_manifest(head: bytes) -> bool:
    return head.startswith(_MANIFEST_START)


class OnnxEngine(PooledEngine):
    """Runs each rank's exported ONNX graph on a pool of MPI ranks (correctness only)."""

    spec = ENGINES["onnx"]

    def run(
        self,
        workload: Workload,
        config: CPConfig,
        shards: Sequence[tuple[np.ndarray, ...]],
        timeout: float,
    ) -> tuple[list[np.ndarray], list[int]]:
        """Run ``config``'s graphs once, rank r holding ``shards[r]``: each rank's output
        shard (float32) and 0 peak bytes (not measured)."""
        check_runs(self.spec, workload, config)
        sent = []
        for rank, shard in enumerate(shards):
            model, feeds = tensorrt_rank_graph(workload, config, rank)
            graph = np.frombuffer(model.SerializeToString(), dtype=np.uint8)
            sent.append([*shard, graph, *(feeds[value.name] for value in model.graph.input[3:])])
        arrays, peaks = self._run(workload, config, sent, timeout, f"{config.describe()} as ONNX graphs")
        return [shard[0] for shard in arrays], peaks

    def time(self, warmup: int, repeats: int, timeout: float, what: str) -> np.ndarray:
        raise untimed(self.name)

    def time_collective(
        self,
        kind: str,
        ranks: int,
        group: int,
        chunks: Sequence[int],
        warmup: int,
        repeats: int,
        timeout: float,
        along: str = "heads",
    ) -> np.ndarray:
        raise untimed(self.name)

    def time_attention(
        self, ranks: int, shapes: Sequence[dict[str, int]], warmup: int, repeats: int, timeout: float
    ) -> np.ndarray:
        raise untimed(self.name)

    def time_steps(
        self, ranks: int, steps: Sequence[dict[str, object]], warmup: int, repeats: int, timeout: float
    ) -> np.ndarray:
        raise untimed(self.name)

    def describe(self) -> dict[str, str]:
        import mpi4py

        return {
            "engine": self.name,
            "onnx": onnx.__version__,
            "mpi4py": mpi4py.__version__,
            "numpy": np.__version__,
        }


def export_graphs(workload: Workload, config: CPConfig, directory: Path) -> Path:
    """Write ``rank<r>.onnx`` for every rank of ``config`` (the graph TensorRT builds; the
    same bytes on every rank but a hybrid's) and a JSON manifest (workload, configuration,
    opsets, each rank's tokens as [start, stop) runs, input/output shapes, the values of its
    rank inputs and the SHA-256 of its file) into ``directory``; returns the manifest's
    path. A file already there is replaced only if cptune wrote it (``check_ours``), each
    checked before the first is written."""
    check_runs(ENGINES["tensorrt"], workload, config)  # what the graphs are written for
    directory.mkdir(parents=True, exist_ok=True)
    for rank in range(config.ranks):
        check_ours(directory / f"rank{rank}.onnx", _our_graph, _ELSEWHERE)
    check_ours(directory / MANIFEST, _our_manifest, _ELSEWHERE)
    layout = SequenceLayout(workload, config)
    shapes = io_shapes(workload, config)
    dtype = _ONNX_TYPES[workload.dtype]
    ranks = []
    for rank in range(config.ranks):
        model, feeds = tensorrt_rank_graph(workload, config, rank)
        data = model.SerializeToString(deterministic=True)
        path = directory / f"rank{rank}.onnx"
        write_regular(path, data, _ELSEWHERE, _our_graph)
        positions = layout.rank_positions(rank)
        ranks.append(
            {
                "rank": rank,
                "file": path.name,
                "sha256": hashlib.sha256(data).hexdigest(),
                "nodes": len(model.graph.node),
                "tokens": [
                    [int(positions[a]), int(positions[b - 1]) + 1] for a, b in position_runs(positions)
                ],
                "inputs": {name: {"shape": list(shapes[name]), "dtype": dtype} for name in ("q", "k", "v")}
                | {name: {"shape": list(value.shape), "dtype": str(value.dtype),
                          "values": value.ravel().tolist()} for name, value in feeds.items()},
                "outputs": {"out": {"shape": list(shapes["out"]), "dtype": dtype}},
            }
        )
    manifest = {
        "format": "cptune-onnx-graphs",
        "version": 1,
        "cptune": __version__,
        "onnx": onnx.__version__,
        "opsets": {"": OPSET, DOMAIN: DOMAIN_VERSION},
        "workload": workload.to_dict(),
        "config": config.to_dict(),
        "padded_seq_len": layout.padded_len,
        "layout": "q, k, v and out are [batch, tokens, heads, head_dim]; rank r holds the token "
        "positions in its 'tokens' runs, in order; positions >= seq_len are padding "
        "(inputs zero, outputs dropped); inputs with 'values' are fed as given (they differ by rank, "
        "the graph does not)",
        "ranks": ranks,
    }
    out = directory / MANIFEST
    written = (json.dumps(manifest, indent=2) + "\n").encode()
    assert _our_manifest(written)  # what tells the next export this file is its own
    write_regular(out, written, _ELSEWHERE, _our_manifest)
    return out
