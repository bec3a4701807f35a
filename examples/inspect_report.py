"""Write the graph-inspection report (HTML, networkx JSON, summary) for a model.

    python examples/inspect_report.py [OUT_DIR]
"""
import sys

import torch

import spear_compile as spear
from spear_compile.inspect import capture
from spear_compile.models import tiny_llama

out = sys.argv[1] if len(sys.argv) > 1 else "inspect_out"
model = spear.quantize_(tiny_llama(), spear.QuantConfig(group_size=None))
report = capture(model, (torch.randint(0, 256, (1, 1)),), model_name="tiny-llama decode")
print(report.format_summary())
print(report.write(out))
assert report.summary()["matched_linears"] == 14
