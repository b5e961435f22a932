"""The dashboard's view of one workload's search: every stored run of the workload on this
hardware kept as a trial of an Optuna study in the database (``StudyView``), named by
``study_name``, for ``optuna-dashboard`` and ``optuna.load_study``.

The store stays the source of truth: the view only copies in the runs it lacks (each one
``view_trial``), and a view that cannot be written is the store's error saying so
(``Store.failed``: a full disk is a ``DiskFullError``) with every measurement kept.
"""

from __future__ import annotations

from dataclasses import dataclass

import optuna
from optuna.storages import BaseStorage
from optuna.study import Study

from cptune.hardware import Hardware
from cptune.search._trials import study_name, view_trial
from cptune.store import Result, Store
from cptune.workload import Workload

#: What a study view that cannot be written leaves.
_STUDY_LACKS = "; every measurement is stored, and the next search adds what the study lacks"


@dataclass
class StudyView:
    """The Optuna study that shows ``store``'s runs of one workload on one hardware."""

    study: Study
    store: Store

    @classmethod
    def open(cls, storage: BaseStorage, store: Store, workload: Workload, hardware: Hardware) -> StudyView:
        """The study of ``workload`` on ``hardware`` in ``storage``, created if missing."""
        name = study_name(workload, hardware)
        try:
            study = optuna.create_study(storage=storage, direction="minimize", load_if_exists=True,
                                        study_name=name)
        except optuna.exceptions.StorageInternalError as exc:
            raise store.failed(exc, f"keep the Optuna study {name!r}", _STUDY_LACKS) from None
        return cls(study, store)

    def sync(self, stored: list[Result]) -> None:
        """Add every run in ``stored`` (``Ledger.stored``) that the study lacks."""
        try:
            kept = {trial.user_attrs.get("measurement_id") for trial in self.study.get_trials(deepcopy=False)}
            for row in stored:
                if row.id not in kept:
                    self.study.add_trial(view_trial(row))
        except optuna.exceptions.StorageInternalError as exc:
            doing = f"add to the Optuna study {self.study.study_name!r}"
            raise self.store.failed(exc, doing, _STUDY_LACKS) from None
