"""gpt-oss on Modular MAX: MXFP4 MoE kernels in Mojo and a Harmony-correct Responses API."""

__version__ = "0.1.0"

# `GPTOSS_MAX_DETERMINISTIC=on` must reach MAX before MAX is imported (settings.export_device_sync).
from gptoss_max import settings as _settings  # noqa: E402

try:
    _settings.export_device_sync()
except ValueError:  # a bad value is refused, with its message, where the setting is used
    pass
