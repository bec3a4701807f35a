"""Graph inspection: what the spear passes did to a model.

    report = spear_compile.inspect.capture(model, (input_ids,))
    report.summary()          # {"matched_linears": 210, "by_source_form": {...}, "lowering": {...}, ...}
    report.write("out/")      # graph.json (networkx node-link), report.html, summary.json
"""
from .capture import Report, capture

__all__ = ["Report", "capture"]
