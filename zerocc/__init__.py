"""zerocc: ZeRO data parallelism as a compiler.

    step = zerocc.compile(model, optimizer, stage=3)
    loss = step(*batch)

See ``zerocc/pipeline.py`` for the passes, in order.
"""
from . import ops  # registers zerocc:: custom ops
from .api import CompiledStep, compile
from .checkpoint import export_full_state_dict, load_checkpoint, save_checkpoint
from .errors import CaptureError, ConfigError, PassError, UnsupportedOptimizerError, ZeroccError
from .runtime.failures import RankFailureError, RankMismatchError

__all__ = ["compile", "CompiledStep", "ZeroccError", "ConfigError", "CaptureError", "PassError",
           "UnsupportedOptimizerError", "save_checkpoint", "load_checkpoint", "export_full_state_dict",
           "RankFailureError", "RankMismatchError"]
__version__ = "0.1.0"
