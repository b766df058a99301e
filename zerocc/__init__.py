"""zerocc: ZeRO data parallelism as a compiler.

    step = zerocc.compile(model, optimizer, stage=3)
    loss = step(*batch)

See ``zerocc/pipeline.py`` for the passes, in order.
"""
from . import ops  # registers zerocc:: custom ops
from .api import CompiledStep, compile
from .errors import CaptureError, ConfigError, PassError, UnsupportedOptimizerError, ZeroccError

__all__ = ["compile", "CompiledStep", "ZeroccError", "ConfigError", "CaptureError", "PassError",
           "UnsupportedOptimizerError"]
__version__ = "0.1.0"
