"""The mpi engine (the default): strategies on real processes, mpi4py over the MPICH wheel,
numpy math. Runs anywhere; one rank per core (more ranks share cores, marked so)."""

from cptune.engines.mpi._engine import MPIEngine

__all__ = ["MPIEngine"]
