"""The hardware a measurement or a recommendation is for.

``this_host()`` is the machine cptune runs on, reduced to a fingerprint (``Hardware``).
"""

from cptune.hardware._host import Hardware, mpi_library, this_host

__all__ = ["Hardware", "mpi_library", "this_host"]
