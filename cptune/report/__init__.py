"""What a database holds, as pictures and tables: ``cptune report``.

``gather`` reads measurements, the strategy map (from ``recommend``) and the cost model's
held-out predictions into a ``ReportData``; ``write_report`` draws it as PNG figures and one
self-contained HTML page, ``text_tables`` as rich tables for the terminal. Measured and
predicted values are always told apart.
"""

from cptune.report._data import ReportData
from cptune.report._gather import gather
from cptune.report._html import write_report
from cptune.report._text import text_tables

__all__ = ["ReportData", "gather", "text_tables", "write_report"]
