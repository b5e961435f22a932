"""Calibration: how fast this hardware moves bytes and computes attention, measured.

``calibrate`` times the engine's collectives, its attention kernel and (where its spec says
so) the kernel's memory-bound steps on 1..N ranks; the result is a ``Calibration``, a plain
record the store keeps and the cost model's prior reads.
"""

from cptune.calibration._calibrate import (
    ATTENTION_SHAPES,
    MESSAGE_SIZES,
    REPEATS,
    RESUMING,
    RETIMED,
    ROUNDS,
    STEP_SHAPES,
    CalibrationDisturbedError,
    CalibrationPieces,
    calibrate,
    group_sizes,
)
from cptune.calibration._record import (
    Calibration,
    CollectiveFit,
    ComputeRate,
    ExchangeWait,
    StepCost,
    fit_latency_bandwidth,
)

__all__ = [
    "ATTENTION_SHAPES",
    "MESSAGE_SIZES",
    "REPEATS",
    "RESUMING",
    "RETIMED",
    "ROUNDS",
    "STEP_SHAPES",
    "Calibration",
    "CalibrationDisturbedError",
    "CalibrationPieces",
    "CollectiveFit",
    "ComputeRate",
    "ExchangeWait",
    "StepCost",
    "calibrate",
    "fit_latency_bandwidth",
    "group_sizes",
]
