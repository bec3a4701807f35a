"""The packed int4 weight format the quantizers produce: defined beside the ops it feeds (``ops/format.py``,
the ops' contract for their weight operands) and re-exported here for the quantizers and their users."""
from ..ops.format import (ACT_DTYPES, LAYOUTS, QuantFormatError, QuantizedWeight,  # noqa: F401
                          check_group_params, check_spear_weight, pack_int4, unpack_int4)
